"""LoRA fine-tuning trains like one process on every layout: per-step loss and grad norm
(1e-4) with adapters on attention, the dense MLP and the output layer (so column-wise,
row-wise and loss-parallel adapter placements all run), under FSDP 2 (with full activation
checkpointing), TP 2, FSDP 2 x TP 2, PP 2 and CP 2, and with expert parallel on the
DeepSeek-V3 MoE; QLoRA (NF4 base) under FSDP 2 and its adapters-only resume."""

import shutil
from pathlib import Path

import pytest

from tests.launcher import read_metrics, run_torchrun
from tests.parity import assert_parity, train, train_args

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

LORA = [
    "--model.converters",
    "lora",
    "--lora.target_modules",
    "attention,mlp,output",
    "--lora.rank",
    "4",
    "--optimizer.lr",
    "1e-2",
]
TP = "--parallelism.tensor_parallel_degree"

# name: (processes, data-parallel degree, overrides)
CASES = {
    "fsdp2_ac": (2, 2, ["--activation_checkpoint.mode", "full"]),
    "tp2": (2, 1, [TP, "2"]),
    "fsdp2_tp2": (4, 2, [TP, "2"]),
    "pp2": (2, 1, ["--parallelism.pipeline_parallel_degree", "2"]),
    "cp2": (2, 1, ["--parallelism.context_parallel_degree", "2"]),
}
DEEPSEEK = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"]
DEEPSEEK_LORA = DEEPSEEK + ["--debug.moe_force_load_balance", *LORA[:2], "--lora.rank", "4"]


@pytest.fixture(scope="module")
def lora_reference(tmp_path_factory):
    records = train(1, tmp_path_factory.mktemp("lora_reference"), LORA)
    assert records[-1]["loss"] < records[0]["loss"] - 0.3, "LoRA did not learn"
    return records


@pytest.mark.parametrize("case", list(CASES))
def test_lora_parity_with_one_process(case, lora_reference, tmp_path):
    nproc, dp, overrides = CASES[case]
    assert_parity(lora_reference, train(nproc, tmp_path, LORA + overrides, dp=dp))


def test_lora_on_moe_with_expert_parallel(tmp_path):
    reference = train(1, tmp_path / "one", DEEPSEEK_LORA)
    ep2 = train(2, tmp_path / "ep2", DEEPSEEK_LORA + ["--parallelism.expert_parallel_degree", "2"])
    assert_parity(reference, ep2)


# QLoRA needs weights of whole NF4 groups (16,384 values): the 256-wide debug model.
QLORA = LORA[:2] + [
    "--model.flavor",
    "debugmodel",
    "--lora.target_modules",
    "attention,mlp",
    "--lora.rank",
    "4",
    "--optimizer.lr",
    "1e-2",
    "--lora.base_quantization",
    "nf4",
]
NF4_LOG = "adapted linears are NF4 now"


def qlora_run(nproc: int, folder: Path, overrides: list[str] = ()) -> list[dict]:
    out = run_torchrun(nproc, train_args(nproc, folder, QLORA + list(overrides))).stdout
    assert NF4_LOG in out, out[-3000:]
    return read_metrics(folder)


def test_qlora_fsdp2_trains_like_one_process_and_resumes_exactly(tmp_path):
    """The NF4 base quantized whole and split into FSDP rows: FSDP 2 matches one process
    (1e-4), and a resume from the adapters-only step-5 checkpoint (base re-quantized from the
    seeded initialisation) repeats steps 6-10 bitwise."""
    reference = qlora_run(1, tmp_path / "one")
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "5"]
    straight = qlora_run(2, tmp_path / "fsdp2", ckpt)
    assert_parity(reference, straight)
    step5 = Path("checkpoint") / "step-5"
    shutil.copytree(tmp_path / "fsdp2" / step5, tmp_path / "resumed" / step5)
    resumed = qlora_run(2, tmp_path / "resumed", ckpt)
    assert [r["step"] for r in resumed] == list(range(6, 11))
    for got, want in zip(resumed, straight[5:]):
        assert (got["loss"], got["grad_norm"]) == (want["loss"], want["grad_norm"]), got["step"]
