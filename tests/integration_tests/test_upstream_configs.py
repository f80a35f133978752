"""Upstream torchtitan's own Llama 3 debug configs (2025-07 and v0.2.2) train here with only the
dataset and tokenizer pointed at ours (and a small batch, for time); full bf16 training
(training.dtype) keeps parameters, gradients and optimizer states in bf16. The configs'
data_parallel_shard_degree -1 makes every run FSDP over the 2 ranks of one launch, which runs
them one after another in one process group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launcher import REPO_ROOT, read_metrics, run_probe

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

UPSTREAM_CONFIGS = REPO_ROOT / "tests" / "assets" / "upstream_configs"
OURS = ["--model.tokenizer_path", "byte", "--training.dataset", "python_stdlib"]
SMALL = ["--training.steps", "3", "--training.seq_len", "64", "--training.local_batch_size", "2"]

PROBE = """
import json, logging, os
from torchtitan.config import ConfigManager
from torchtitan.tools.logging import init_logger, logger
from torchtitan.train import Trainer, main

def train(argv):
    trainer = Trainer(ConfigManager().parse_args(argv))
    trainer.train()
    trainer.close()
    return trainer

runs = json.load(open(os.path.join(os.environ["PROBE_DIR"], "runs.args")))
init_logger()
messages = []
handler = logging.Handler()
handler.emit = lambda record: messages.append(record.getMessage())
logger.addHandler(handler)
trainer = train(runs["bf16"])
params = list(trainer.model_parts[0].parameters())
optimizer_states = trainer.optimizers.optimizers[0].state.values()
states = [t for s in optimizer_states for t in s.values() if t.dim() > 0]
dtypes = {"params": sorted({str(p.dtype) for p in params}),
          "grads": sorted({str(p.grad.dtype) for p in params if p.grad is not None}),
          "states": sorted({str(t.dtype) for t in states})}
train(runs["new"])
dtypes["printed_model"] = any(m.startswith("model after the converters:") for m in messages)
main(runs["old"])  # the entry point itself (job.save_config_file); it ends the process group
with open(os.path.join(os.environ["PROBE_DIR"], os.environ["RANK"] + ".json"), "w") as f:
    json.dump(dtypes, f)
"""


def _losses(dump_folder: Path) -> list[float]:
    return [record["loss"] for record in read_metrics(dump_folder)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("upstream_configs")
    old = UPSTREAM_CONFIGS / "llama3_debug_2025_07.toml"
    new = UPSTREAM_CONFIGS / "llama3_debug_v0_2_2.toml"
    run_args = {
        "old": [
            "--job.config_file",
            str(old),
            *OURS,
            *SMALL,
            "--job.dump_folder",
            str(folder / "old"),
            "--job.save_config_file",
            "config.json",
        ],
        "new": [
            "--job.config_file",
            str(new),
            *OURS,
            *SMALL,
            "--job.dump_folder",
            str(folder / "new"),
            "--model.print_after_conversion",
        ],
        "bf16": [
            "--job.config_file",
            str(new),
            *OURS,
            *SMALL,
            "--job.dump_folder",
            str(folder / "bf16"),
            "--training.dtype",
            "bfloat16",
            "--training.cpu_low_precision",  # tests bf16 itself: even where the CPU emulates it
            "force",
        ],
    }
    (folder / "runs.args").write_text(json.dumps(run_args))
    return folder, run_probe(2, PROBE, folder, timeout=240)


@pytest.mark.parametrize("generation", ["old", "new", "bf16"])
def test_upstream_config_trains_three_steps(runs, generation: str) -> None:
    folder, _ = runs
    losses = _losses(folder / generation)
    assert len(losses) == 3 and all(loss == loss and loss < 20 for loss in losses)


def test_save_config_file_holds_the_merged_config(runs) -> None:
    folder, _ = runs
    saved = json.loads((folder / "old" / "config.json").read_text())
    assert saved["checkpoint"]["last_save_model_only"] is False  # aliased upstream key
    assert saved["training"]["dataset"] == "python_stdlib"


def test_full_bf16_training_under_fsdp_keeps_no_float32_copy(runs) -> None:
    _, found = runs
    bf16_only = {
        "params": ["torch.bfloat16"],
        "grads": ["torch.bfloat16"],
        "states": ["torch.bfloat16"],
    }
    assert [{k: found[rank][k] for k in bf16_only} for rank in (0, 1)] == [bf16_only, bf16_only]


def test_print_after_conversion_logs_the_model(runs) -> None:
    _, found = runs
    assert found[0]["printed_model"] and found[1]["printed_model"]
