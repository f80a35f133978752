"""Context parallel for the Gated DeltaNet mixer (``ContextParallelDeltaRule``):
``apply_cp_to_delta_rules`` swaps the delta-rule kernel (one process), and in one 4-rank
torchrun launch the sharded convolution and delta rule equal ``DeltaRule`` on the whole
sequence, forward and backward (cp 2 and 4, headtail and none, with and without document
ids), while two planted errors fail the same check."""

from __future__ import annotations

import json

import pytest
from torch import nn

from tests.launcher import REPO_ROOT, run_torchrun
from torchtitan.distributed.context_parallel.delta_rule import (
    ContextParallelDeltaRule,
    apply_cp_to_delta_rules,
)
from torchtitan.layers.gated_deltanet import DeltaRule, GatedDeltaNet

WORKER = REPO_ROOT / "tests" / "integration_tests" / "scripts" / "cp_delta_rule_worker.py"
CASES = [
    f"cp{cp}_{balancer}_{docs}"
    for cp in (2, 4)
    for balancer in ("headtail", "none")
    for docs in ("nodocs", "docs")
] + ["cp4_headtail_docs_short"]
PLANTED = {
    "planted_dropped_state": {"out", "grad_q", "grad_k", "grad_v", "grad_g", "grad_beta"},
    "planted_dropped_conv_tail": {"conv", "grad_x", "grad_weight"},
}


class FakeMesh:
    def size(self) -> int:
        return 2


def mixer(block_causal: bool) -> GatedDeltaNet:
    return GatedDeltaNet(16, 2, 2, 8, 8, 4, 1e-6, chunk_size=16, block_causal=block_causal)


def test_apply_cp_replaces_every_delta_rule():
    model = nn.ModuleList([mixer(False), mixer(True)])
    assert apply_cp_to_delta_rules(model, FakeMesh(), "none") == 2
    rules = [m.inner_rule for m in model]
    assert all(isinstance(r, ContextParallelDeltaRule) for r in rules)
    assert [(r.chunk_size, r.spec.block_causal, r.load_balancer) for r in rules] == [
        (16, False, "none"),
        (16, True, "none"),
    ]
    # nothing left to replace: a context-parallel rule is not replaced again
    assert apply_cp_to_delta_rules(model, FakeMesh(), "none") == 0
    assert not any(type(m) is DeltaRule for m in model.modules())


@pytest.fixture(scope="module")
def worker_results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("cp_delta_rule")
    run_torchrun(4, [], script=str(WORKER), timeout=120, env={"OUT_DIR": str(out)})
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    return results


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_sharded_delta_rule_equals_whole_sequence(worker_results):
    for rank, results in enumerate(worker_results):
        for case in CASES:
            failed = {n: r["max_diff"] for n, r in results[case].items() if not r["close"]}
            assert not failed, f"rank {rank}, {case}: off by more than 1e-5: {failed}"


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_planted_errors_fail_the_check(worker_results):
    for rank, results in enumerate(worker_results):
        for case, affected in PLANTED.items():
            failed = {n for n, r in results[case].items() if not r["close"]}
            assert failed == affected, f"rank {rank}, {case}: {failed}"
