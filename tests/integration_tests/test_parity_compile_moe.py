"""torch.compile of MoE blocks trains like eager (per-step loss and grad norm within 1e-4,
fp32): every MoE debug model compiled on one process (each block one graph, no host sync:
token counts stay on the device), and under expert parallel, FSDP x EP and TP x EP x ETP
(blocks compiled part by part around the experts, whose FSDP hooks and token all-to-alls
run eager; the experts' matmuls compiled with a dynamic row count). Routing is
forced-balanced so that it cannot flip on near-ties between eager and compiled numerics.
CI runs two cases; ``--matrix`` runs every model under every layout."""

import os

import pytest

from tests.parity import assert_parity, train

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

COMPILE = ["--compile.enable"]
EP2 = ["--parallelism.expert_parallel_degree", "2"]
TP2_EP2_ETP2 = [
    "--parallelism.tensor_parallel_degree",
    "2",
    *EP2,
    "--parallelism.expert_tensor_parallel_degree",
    "2",
]
MODELS = {
    "deepseek_v3": ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"],
    "qwen3_moe": ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"],
    "gpt_oss": ["--model.name", "gpt_oss", "--model.flavor", "debugmodel"],
    "qwen3_5_moe": ["--model.name", "qwen3_5", "--model.flavor", "debugmodel_moe"],
}
FORCED = ["--debug.moe_force_load_balance"]

# layout: (processes, data-parallel degree, overrides)
LAYOUTS = {
    "1proc": (1, 1, []),
    "ep2": (2, 2, EP2),
    "fsdp4_ep2": (4, 4, EP2),
    "tp2_ep2_etp2": (4, 2, TP2_EP2_ETP2),
}
# CI runs these (one process; TP x EP x ETP, which runs EP's all-to-alls too); --matrix runs
# every model x layout.
IN_CI = {"qwen3_moe_1proc", "deepseek_v3_tp2_ep2_etp2"}
CASES = {f"{model}_{layout}": (model, layout) for model in MODELS for layout in LAYOUTS}


@pytest.fixture(scope="module")
def eager_reference(tmp_path_factory):
    """The eager 1-process run of each model, trained once."""
    runs = {}

    def run(model: str) -> list[dict]:
        if model not in runs:
            folder = tmp_path_factory.mktemp(f"eager_{model}")
            runs[model] = train(1, folder, MODELS[model] + FORCED)
        return runs[model]

    return run


@pytest.fixture
def inductor_cache(tmp_path_factory):
    """One inductor cache for all compile tests so CI compiles each graph once."""
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(
        tmp_path_factory.getbasetemp().parent / "torchtitan-inductor-cache"
    )
    return {"TORCHINDUCTOR_CACHE_DIR": cache}


@pytest.mark.parametrize(
    "case", [c if c in IN_CI else pytest.param(c, marks=pytest.mark.matrix) for c in CASES]
)
def test_compiled_matches_eager(case, eager_reference, inductor_cache, tmp_path):
    model, layout = CASES[case]
    nproc, dp, overrides = LAYOUTS[layout]
    args = MODELS[model] + FORCED + COMPILE + overrides
    records = train(nproc, tmp_path, args, dp=dp, env=inductor_cache, timeout=380)
    assert_parity(eager_reference(model), records)
