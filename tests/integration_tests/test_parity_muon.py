"""Muon trains like Muon on one process on every layout: per-step loss and grad norm (1e-4)
under FSDP 2 (also with gradient accumulation), FSDP 4, HSDP 2 x 2, TP 2, FSDP 2 x TP 2 and
PP 2, with expert parallel on the DeepSeek-V3 MoE (EP 2, FSDP 2 x EP 2), with LoRA adapters
(FSDP 2, TP 2) and with float8 linears (FSDP 2); a checkpoint saved under FSDP 4 resumes
bitwise under FSDP 4 and under FSDP 2 x TP 2 continues the one-process losses. The
Newton-Schulz iteration runs in fp32 here (bf16, the default, rounds the whole matrix:
layouts would differ by its rounding, not by 1e-4)."""

import json
import shutil
from pathlib import Path

import pytest

from tests.integration_tests.test_parity_float8 import FLOAT8, FLOAT8_RTOL, FSDP_FLOAT8
from tests.launcher import REPO_ROOT, run_torchrun
from tests.parity import assert_parity, ci_subset, train

PROBE = REPO_ROOT / "tests" / "integration_tests" / "scripts" / "muon_layout_probe.py"
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

MUON = [
    "--optimizer.name",
    "Muon",
    "--optimizer.muon.ns_dtype",
    "float32",
    "--optimizer.muon.adjust_lr",
    "original",  # the scaling these lrs are for (float8's tolerance holds at them)
    "--optimizer.lr",
    "2e-2",
    "--optimizer.muon.adamw_lr",
    "3e-3",
]
TP = "--parallelism.tensor_parallel_degree"

# name: (processes, data-parallel degree, overrides)
CASES = {
    "fsdp2": (2, 2, []),
    "fsdp2_accum2": (2, 2, ["--training.local_batch_size", "2"]),  # 2 micro-batches a step
    "hsdp2x2": (4, 4, ["--parallelism.data_parallel_replicate_degree", "2"]),
    "tp2": (2, 1, [TP, "2"]),
    "fsdp2_tp2": (4, 2, [TP, "2"]),
    "pp2": (2, 1, ["--parallelism.pipeline_parallel_degree", "2"]),
}
DEEPSEEK = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"]
DEEPSEEK_MUON = DEEPSEEK + ["--debug.moe_force_load_balance", *MUON]


@pytest.fixture(scope="module")
def muon_reference(tmp_path_factory):
    records = train(1, tmp_path_factory.mktemp("muon_reference"), MUON)
    assert records[-1]["loss"] < records[0]["loss"] - 0.5, "Muon did not learn"
    return records


# CI runs each of these layouts inside the composition beside it; --matrix runs them alone
COVERED_BY = {
    "fsdp2": "fsdp2_tp2",
    "tp2": "fsdp2_tp2",
}


@pytest.mark.parametrize("case", ci_subset(CASES, COVERED_BY))
def test_muon_parity_with_one_process(case, muon_reference, tmp_path):
    nproc, dp, overrides = CASES[case]
    assert_parity(muon_reference, train(nproc, tmp_path, MUON + overrides, dp=dp))


def test_muon_on_moe_with_expert_parallel(tmp_path):
    """EP 2 (each rank orthogonalises its own experts) and FSDP 2 x EP 2 on 4 processes."""
    reference = train(1, tmp_path / "one", DEEPSEEK_MUON)
    ep = DEEPSEEK_MUON + ["--parallelism.expert_parallel_degree", "2"]
    assert_parity(reference, train(2, tmp_path / "ep2", ep))
    assert_parity(reference, train(4, tmp_path / "fsdp2_ep2", ep))


LORA_MUON = [
    *MUON,
    "--model.converters",
    "lora",
    "--lora.target_modules",
    "attention,mlp,output",
    "--lora.rank",
    "4",
]


def test_lora_adapters_with_muon_train_like_one_process(tmp_path):
    """LoRA x Muon: the adapters' matrices (column- and row-wise, and the output's, which
    ``output.*`` sends to AdamW) under FSDP 2 and TP 2."""
    reference = train(1, tmp_path / "one", LORA_MUON)
    assert reference[-1]["loss"] < reference[0]["loss"] - 0.3, "LoRA with Muon did not learn"
    assert_parity(reference, train(2, tmp_path / "fsdp2", LORA_MUON))
    assert_parity(reference, train(2, tmp_path / "tp2", LORA_MUON + [TP, "2"], dp=1))


def test_muon_with_float8_linears(tmp_path):
    """Float8 linears (emulated) keep high-precision weights that Muon updates; under FSDP 2
    with float8 all-gather the losses and grad norms follow one process within the float8
    tolerance of test_parity_float8.py."""
    one = train(1, tmp_path / "one", MUON + FLOAT8)
    assert_parity(one, train(2, tmp_path / "fsdp2", MUON + FSDP_FLOAT8), rtol=FLOAT8_RTOL)


def test_checkpoint_from_fsdp4_resumes_under_fsdp2_tp2(muon_reference, tmp_path):
    """FSDP 4 trains like one process; its step-5 checkpoint resumes bitwise under FSDP 4
    and, the momentum buffers resharded like AdamW's states, under FSDP 2 x TP 2, whose
    steps 6-10 follow the one-process run."""
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "5"]
    fsdp4 = train(4, tmp_path / "fsdp4", MUON + ckpt)
    assert_parity(muon_reference, fsdp4)
    step5 = Path("checkpoint") / "step-5"
    for folder in ("same_layout", "fsdp2_tp2"):
        shutil.copytree(tmp_path / "fsdp4" / step5, tmp_path / folder / step5)
    same = train(4, tmp_path / "same_layout", MUON + ckpt)
    assert [(r["loss"], r["grad_norm"]) for r in same] == [
        (r["loss"], r["grad_norm"]) for r in fsdp4[5:]
    ], "a resume under the same layout repeats steps 6-10 bitwise"
    resumed = train(4, tmp_path / "fsdp2_tp2", MUON + ckpt + [TP, "2"], dp=2)
    assert [r["step"] for r in resumed] == list(range(6, 11))
    assert_parity(muon_reference[5:], resumed)


def test_sharded_muon_equals_whole_muon_on_awkward_layouts(tmp_path):
    """4 processes: uneven and empty shards, a partial round, 2 x 2 cuts, FSDP's strided
    shard, expert stacks: the weights after 3 steps equal Muon on the whole tensors (1e-6)."""
    run_torchrun(4, [], script=str(PROBE), env={"OUT_DIR": str(tmp_path)}, timeout=170)
    results = [json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")]
    assert len(results) == 4
    for result in results:
        assert result["moved"] > 1e-2, result  # the weights did change
        assert result["worst"] < 1e-6, result
