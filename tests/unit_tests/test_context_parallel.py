"""Context parallel: the sequence layout (one process) and, in one 4-rank torchrun launch,
every attention configuration and a Llama 3 model against their unsharded results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.launcher import run_torchrun
from torchtitan.distributed.context_parallel.attention import (
    ContextParallelAttention,
    apply_cp,
    check_cp_config,
)
from torchtitan.distributed.context_parallel.layout import (
    cp_positions,
    cp_shard,
    rank_major_chunks,
    to_global_order,
    to_rank_major,
)
from torchtitan.layers.attention import ScaledDotProductAttention
from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.models.llama3.model import Transformer

PROBE = Path(__file__).with_name("context_parallel_probe.py")


class FakeMesh:
    """What the layout helpers read from a DeviceMesh."""

    def __init__(self, size: int, rank: int = 0) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank


@pytest.mark.parametrize(
    "cp, balancer, chunks",
    [
        (2, "headtail", [0, 3, 1, 2]),
        (4, "headtail", [0, 7, 1, 6, 2, 5, 3, 4]),
        (4, "none", [0, 1, 2, 3]),
    ],
)
def test_rank_major_chunk_order(cp, balancer, chunks):
    assert rank_major_chunks(cp, balancer) == chunks


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("balancer", ["headtail", "none"])
def test_shards_and_positions_cover_the_sequence(cp, balancer):
    seq = torch.arange(24).view(1, 24) * 10
    shards = [cp_shard(seq, 1, FakeMesh(cp, r), balancer) for r in range(cp)]
    for rank, shard in enumerate(shards):
        positions = cp_positions(24, FakeMesh(cp, rank), balancer)
        assert torch.equal(shard[0], positions * 10)
    assert torch.equal(to_global_order(shards, 1, balancer), seq)
    assert torch.equal(to_rank_major(seq, 1, cp, balancer), torch.stack(shards))


def test_headtail_balances_causal_work():
    # A query at position p attends p + 1 keys: every rank's total is the same.
    work = {int((cp_positions(64, FakeMesh(4, r)) + 1).sum()) for r in range(4)}
    assert len(work) == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(seq_len=30, cp=2, tp=1), r"divisible by 4 \(= 2 \* cp 2 \* tp 1\)"),
        (dict(seq_len=20, cp=2, tp=2), r"divisible by 8"),
        (dict(seq_len=6, cp=4, tp=1, load_balancer="none"), r"divisible by 4 \(= cp 4"),
        (dict(seq_len=32, cp=4, tp=1, n_heads=6, rotate_method="ulysses"), "n_heads 6"),
        (dict(seq_len=32, cp=2, tp=2, n_heads=6, rotate_method="ulysses"), "cp 2 \\* tp 2"),
        (dict(seq_len=32, cp=2, tp=1, rotate_method="ring"), "rotate_method must be one of"),
    ],
)
def test_check_cp_config_rejects_with_one_line(kwargs, match):
    args = dict(n_heads=8, rotate_method="allgather") | kwargs
    with pytest.raises(ValueError, match=match) as info:
        check_cp_config(**args)
    assert "\n" not in str(info.value)


def test_check_cp_config_accepts_valid_layouts():
    check_cp_config(4096, cp=4, tp=2, n_heads=32, rotate_method="ulysses")
    check_cp_config(12, cp=3, tp=1, n_heads=3, rotate_method="alltoall", load_balancer="none")


def test_apply_cp_replaces_every_attention_seam():
    args = TransformerModelArgs(
        dim=16, n_layers=3, n_heads=2, vocab_size=8, multiple_of=8, max_seq_len=8
    )
    model = Transformer(args)
    assert apply_cp(model, FakeMesh(2), "alltoall", "none") == 3
    seams = [m.attention.inner_attention for m in model.layers.values()]
    assert all(isinstance(s, ContextParallelAttention) for s in seams)
    assert not any(isinstance(m, ScaledDotProductAttention) for m in model.modules())
    with pytest.raises(ValueError, match="no `inner_attention`"):
        apply_cp(nn.Linear(2, 2), FakeMesh(2))
    with pytest.raises(ValueError, match="unknown context-parallel rotate method"):
        ContextParallelAttention(FakeMesh(2), "ring")


@pytest.fixture(scope="module")
def probe_results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("cp_probe")
    run_torchrun(4, [], script=str(PROBE), timeout=150, env={"OUT_DIR": str(out)})
    ranks = [json.loads(p.read_text())["results"] for p in sorted(out.glob("rank*.json"))]
    assert len(ranks) == 4
    return [case for rank in ranks for case in rank]


def _cases(results: list[dict], kind: str) -> list[dict]:
    cases = [c for c in results if c["kind"] == kind]
    assert cases, kind
    return cases


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_cp_attention_matches_sdpa_output_and_grads(probe_results):
    cases = _cases(probe_results, "attention")
    # 2 cp degrees x 3 methods x 2 balancers x 2 shapes, on 4 ranks
    assert len(cases) == 24 * 4
    assert {(c["cp"], c["method"], c["balancer"]) for c in cases} == {
        (cp, m, b)
        for cp in (2, 4)
        for m in ("allgather", "alltoall", "ulysses")
        for b in ("headtail", "none")
    }
    bad = [c for c in cases if max(c["errors"].values()) > 1e-5]
    assert not bad, bad
    bf16 = [c for c in _cases(probe_results, "attention_bf16") if max(c["errors"].values()) > 5e-2]
    assert not bf16, bf16


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_cp_attention_with_document_and_window_masks_matches_dense_masks(probe_results):
    cases = _cases(probe_results, "masked_attention")
    assert {(c["cp"], c["method"], c["balancer"], c["mask"]) for c in cases} == {
        (cp, m, b, mask)
        for cp in (2, 4)
        for m in ("allgather", "alltoall", "ulysses")
        for b in ("headtail", "none")
        for mask in ("block_causal", "window", "block_causal_window")
    }
    bad = [c for c in cases if max(c["errors"].values()) > 1e-5]
    assert not bad, bad
    for case in _cases(probe_results, "masked_attention_shifted"):  # boundaries one token late
        assert case["errors"]["out"] > 1e-2, case


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_cp_llama_matches_unsharded_loss_and_grads(probe_results):
    cases = _cases(probe_results, "model")
    assert len(cases) == 2 * 3 * 2 * 4
    cases += _cases(probe_results, "model_tp")  # TP 2 x CP 2, CP applied after TP
    cases += _cases(probe_results, "model_block_causal") + _cases(
        probe_results, "model_tp_block_causal"
    )
    bad = [c for c in cases if c["errors"]["loss"] > 1e-5 or c["errors"]["grads"] > 1e-5]
    assert not bad, bad


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_negative_controls_do_not_match(probe_results):
    """The parity checks can fail: the wrong layout or local RoPE positions break them."""
    for case in _cases(probe_results, "attention_wrong_layout"):
        assert case["errors"]["out"] > 1e-2, case
    for case in _cases(probe_results, "model_no_positions"):
        assert case["errors"]["loss"] > 1e-4 and case["errors"]["grads"] > 1e-4, case
