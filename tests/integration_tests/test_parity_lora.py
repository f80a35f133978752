"""LoRA fine-tuning trains like one process on every layout: per-step loss and grad norm
(1e-4) with adapters on attention, the dense MLP and the output layer (so column-wise,
row-wise and loss-parallel adapter placements all run), under FSDP 2 (with full activation
checkpointing), TP 2, FSDP 2 x TP 2, PP 2 and CP 2, and with expert parallel on the
DeepSeek-V3 MoE."""

import pytest

from tests.parity import assert_parity, train

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
