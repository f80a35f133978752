"""``--memory_estimation.mode measure`` under torchrun: real CPU processes (gloo) run the
traced steps (FSDP 2, DDP 2 with its gradient buckets, HSDP 2 x 2, FSDP 2 x CP 2,
DeepSeek-V3 FSDP 4 x EP 2, PP 2 with 1F1B and Interleaved1F1B, PP 2 x TP 2), and every
rank's measured peak must match the estimate (under pipeline parallel: its pipeline
rank's)."""

from __future__ import annotations

import re

import pytest

from tests.launcher import REPO_ROOT, run_torchrun
from tests.layouts import DDP_2, HSDP_2X2

ESTIMATION = REPO_ROOT / "scripts" / "estimate" / "estimation.py"
MEASURE = ["--memory_estimation.mode", "measure", "--memory_estimation.target_device", "cpu"]
LLAMA = [
    "--job.config_file",
    str(REPO_ROOT / "train_configs" / "debug_model.toml"),
    "--model.flavor",
    "debugmodel_tiny",
    "--training.seq_len",
    "256",
    "--training.local_batch_size",
    "8",
]
# Forced balance: the estimate assumes balanced routing, so the real run routes that way.
DEEPSEEK_EP2 = [
    "--job.config_file",
    str(REPO_ROOT / "train_configs" / "deepseek_v3_debug.toml"),
    "--parallelism.expert_parallel_degree",
    "2",
    "--debug.moe_force_load_balance",
]
RANK_LINE = re.compile(
    r"rank (\d+): tracker on real tensors ([\d,]+) B .*?; CPU allocator events .*? ([\d,]+) B"
)
ESTIMATE_LINE = re.compile(r"estimate \(fake tensors, rank 0 of \d+\): ([\d,]+) B")
PP_ESTIMATE_LINE = re.compile(
    r"estimate \(fake tensors, rank \d+ of \d+, pipeline rank (\d+)\): ([\d,]+) B"
)
PP_RANK_LINE = re.compile(
    r"rank (\d+): schedule: CPU allocator events .*? ([\d,]+) B .*?; "
    r"replayed schedule: tracker on real tensors ([\d,]+) B"
)


def _bytes(text: str) -> int:
    return int(text.replace(",", ""))


# gloo stages a full-size copy of every all_gather_single output and reduce_scatter_single
# input in torch's allocator (NCCL does not). With context parallel's gathered keys/values
# those copies reach 1-7 % of the peak in the allocator events, varying with how gloo's
# asynchronous work overlaps, so there only the tensors the tracker sees are compared.
GLOO_CP_STAGING = None
# gloo's uneven all_to_all (expert parallel's token exchange) stages its buffers too:
# 0-5 % of the peak, varying the same way.
GLOO_ALLTOALL_STAGING = None


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("nproc", "args", "allocator_rtol"),
    [
        # FSDP 2 alone: CI runs it inside HSDP 2 x 2; --matrix runs it alone
        pytest.param(2, LLAMA, 0.02, marks=pytest.mark.matrix),
        (2, LLAMA + DDP_2, 0.02),
        (4, LLAMA + HSDP_2X2, 0.02),
        (4, LLAMA + ["--parallelism.context_parallel_degree", "2"], GLOO_CP_STAGING),
        (4, DEEPSEEK_EP2, GLOO_ALLTOALL_STAGING),
    ],
    ids=["fsdp2", "ddp2", "hsdp2x2", "fsdp2_cp2", "deepseek_fsdp4_ep2"],
)
def test_estimate_matches_real_cpu_processes(nproc, args, allocator_rtol: float | None):
    out = run_torchrun(nproc, args + MEASURE, script=str(ESTIMATION), timeout=280).stdout
    estimate = _bytes(ESTIMATE_LINE.search(out).group(1))
    ranks = RANK_LINE.findall(out)
    assert sorted(int(r) for r, _, _ in ranks) == list(range(nproc)), out[-3000:]
    for _, tracker, allocator in ranks:
        # The tracker follows tensor storages; the allocator events also see buffers that
        # gloo's asynchronous work keeps alive a little longer (under 1 % with FSDP).
        assert abs(estimate / _bytes(tracker) - 1) < 0.02
        if allocator_rtol is not None:
            assert abs(estimate / _bytes(allocator) - 1) < allocator_rtol


PP = ["--parallelism.pipeline_parallel_degree", "2"]
# gloo stages tensor-parallel collectives in the allocator too (NCCL does not): on these tiny
# stages the allocator events run 20-40 % above the tensors, varying by rank.
GLOO_TP_STAGING = None
# gloo's worker thread drops its reference to a collective's tensors when it finishes, which
# races with the main thread: now and then the real replay holds one more activation at its
# peak (seen: +64 KiB, one 256 x 64 fp32 sample, on 1 run in 4 at pp2_tp2, +1.4 %).
REPLAY_TRACKER_RTOL = 0.02


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("nproc", "overrides", "allocator_rtol"),
    [
        # 1F1B (pp2_tp2: the first stage holds two micro-batches, the last one) and a
        # looped schedule (two stages per rank)
        (2, PP + ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"], 0.02),
        (4, PP + ["--parallelism.tensor_parallel_degree", "2"], GLOO_TP_STAGING),
    ],
    ids=["pp2_interleaved", "pp2_tp2"],
)
def test_pipeline_estimate_matches_real_schedule(nproc, overrides, allocator_rtol: float | None):
    """Every pipeline rank's trace (the schedule replayed on fake tensors) against torch's
    schedule running for real (allocator events; torch's MemTracker cannot follow it), and
    against the same replay on real tensors (tracker: what fake tensors may have missed)."""
    out = run_torchrun(
        nproc, LLAMA + overrides + MEASURE, script=str(ESTIMATION), timeout=280
    ).stdout
    estimates = {int(pp): _bytes(b) for pp, b in PP_ESTIMATE_LINE.findall(out)}
    assert sorted(estimates) == [0, 1], out[-3000:]
    ranks = PP_RANK_LINE.findall(out)
    assert sorted(int(r) for r, _, _ in ranks) == list(range(nproc)), out[-3000:]
    for rank, allocator, replayed_tracker in ranks:
        estimate = estimates[int(rank) * 2 // nproc]
        assert abs(estimate / _bytes(replayed_tracker) - 1) < REPLAY_TRACKER_RTOL
        if allocator_rtol is not None:
            assert abs(estimate / _bytes(allocator) - 1) < allocator_rtol
