"""The global data order must not depend on the data-parallel layout.

Ranks are simulated in one process: one loader per (dp_rank, dp_degree). A global batch is
assembled in position order (rank r's i-th sequence of a step is position r + dp * i of it).
"""

import multiprocessing
import random
import threading
from collections import Counter

import pytest
import torch

from torchtitan.data import DatasetConfig, merge_data_states, register_dataset
from torchtitan.data.loader import build_text_dataloader
from torchtitan.data.tokenizers import ByteTokenizer

GLOBAL_BATCH = 8
SHARDS = 8
EPOCH_DOCS = [
    "first document",
    "2nd",
    "the third one is longer",
    "iv",
    "five!",
    "six six six six six",
]

register_dataset("test_epoch_docs", DatasetConfig("test_epoch_docs", lambda path: EPOCH_DOCS))


def _finite_docs() -> list[str]:
    rng = random.Random(2)
    return [
        "".join(rng.choice("abc xyz\n") for _ in range(rng.randint(20, 400))) for _ in range(80)
    ]


register_dataset("test_finite_docs", DatasetConfig("test_finite_docs", lambda path: _finite_docs()))
FINITE = dict(dataset="test_finite_docs", seq_len=32, global_batch=12, infinite=False)


def rank_loader(
    dp: int,
    rank: int,
    *,
    dataset: str = "python_stdlib",
    seq_len: int = 32,
    shards: int = SHARDS,
    global_batch: int = GLOBAL_BATCH,
    **kwargs,
):
    return build_text_dataloader(
        dataset=dataset,
        dataset_path=None,
        tokenizer=ByteTokenizer(),
        seq_len=seq_len,
        local_batch_size=global_batch // dp,
        dp_rank=rank,
        dp_degree=dp,
        data_shards=shards,
        **kwargs,
    )


def rank_loaders(dp: int, **kwargs):
    return [rank_loader(dp, rank, **kwargs) for rank in range(dp)]


def _windows(batch) -> torch.Tensor:
    """Full (seq_len + 1)-token windows of a micro-batch: input plus the last label."""
    inputs, labels = batch
    assert torch.equal(inputs["input"][:, 1:], labels[:, :-1])
    return torch.cat([inputs["input"], labels[:, -1:]], dim=1)


def _assemble(per_rank: list[torch.Tensor]) -> torch.Tensor:
    dp, rows = len(per_rank), sum(len(windows) for windows in per_rank)
    return torch.stack([per_rank[p % dp][p // dp] for p in range(rows)])


def global_batches(loaders, count: int) -> list[torch.Tensor]:
    iterators = [iter(loader) for loader in loaders]
    return [_assemble([_windows(next(it)) for it in iterators]) for _ in range(count)]


def same_batches(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b, strict=True)
    )


def as_multiset(batches: list[torch.Tensor]) -> Counter:
    return Counter(tuple(row.tolist()) for batch in batches for row in batch)


@pytest.fixture(scope="module")
def reference() -> list[torch.Tensor]:
    """Global batches 0..5 of the 1-process run."""
    return global_batches(rank_loaders(1), 6)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_global_batches_do_not_depend_on_dp(reference, dp):
    batches = global_batches(rank_loaders(dp), 3)
    assert as_multiset(batches) == as_multiset(reference[:3])
    assert same_batches(batches, reference[:3])


def test_shifted_start_does_not_compare_equal(reference):
    loaders = rank_loaders(2)
    next(iter(loaders[1]))  # rank 1 one micro-batch ahead
    batches = global_batches(loaders, 3)
    assert not same_batches(batches, reference[:3])
    assert as_multiset(batches) != as_multiset(reference[:3])


def test_rank_only_reads_its_own_shards():
    seen: list[int] = []

    class Recording(list):
        def __getitem__(self, index):
            seen.append(index)
            return super().__getitem__(index)

    register_dataset(
        "test_recording", DatasetConfig("test_recording", lambda path: Recording(EPOCH_DOCS * 8))
    )
    loader = rank_loaders(4, dataset="test_recording", seq_len=8)[3]
    global_batches([loader], 4)
    assert seen and all(index % SHARDS in (3, 7) for index in seen)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_resume_matches_uninterrupted_run(reference, dp):
    loaders = rank_loaders(dp)
    assert same_batches(global_batches(loaders, 2), reference[:2])
    states = [loader.state_dict() for loader in loaders]
    resumed = rank_loaders(dp)
    for loader, state in zip(resumed, states, strict=True):
        loader.load_state_dict(state)
    assert same_batches(global_batches(resumed, 3), reference[2:5])


@pytest.mark.parametrize("new_dp", [1, 2, 8])
def test_merged_state_loads_under_another_dp(reference, new_dp):
    loaders = rank_loaders(4)
    global_batches(loaders, 3)
    merged = merge_data_states([loader.state_dict() for loader in loaders])
    assert merged["next_position"] == 3 * GLOBAL_BATCH and len(merged["shards"]) == SHARDS
    resumed = rank_loaders(new_dp)
    for loader in resumed:
        loader.load_state_dict(merged)
    assert same_batches(global_batches(resumed, 3), reference[3:6])


@pytest.mark.parametrize(
    "options",
    [dict(num_workers=2), dict(num_workers=4, prefetch_factor=1, persistent_workers=True)],
)
def test_worker_processes_keep_the_order_and_the_exact_state(reference, options):
    loaders = rank_loaders(2, **options)
    assert same_batches(global_batches(loaders, 2), reference[:2])
    assert same_batches(global_batches(loaders, 1), reference[2:3])  # a second iter() continues
    merged = merge_data_states([loader.state_dict() for loader in loaders])
    assert (
        merged["next_position"] == 3 * GLOBAL_BATCH
    )  # what was taken, not what workers prefetched
    resumed = rank_loaders(1, num_workers=2)
    resumed[0].load_state_dict(merged)
    assert same_batches(global_batches(resumed, 3), reference[3:6])
    for loader in [*loaders, *resumed]:
        loader.close()
    assert not multiprocessing.active_children()  # close() stopped every worker


class _Streamed:
    """Re-iterable, not indexable: read through StreamedDocuments."""

    def __iter__(self):
        return iter(_finite_docs())


register_dataset(
    "test_streamed_docs", DatasetConfig("test_streamed_docs", lambda path: _Streamed())
)


def test_worker_processes_over_a_streamed_dataset():
    streamed = dict(dataset="test_streamed_docs", seq_len=32)
    expected = global_batches(rank_loaders(1, **streamed), 4)
    loaders = rank_loaders(1, num_workers=2, **streamed)
    assert same_batches(global_batches(loaders, 4), expected)
    loaders[0].close()


def test_unmerged_state_of_another_layout_is_refused():
    loaders = rank_loaders(2)
    global_batches(loaders, 1)
    target = rank_loaders(4)[1]  # owns shards 1 and 5; rank 0 of dp 2 holds 0, 2, 4, 6
    with pytest.raises(ValueError, match=r"no cursors for data shards \[1, 5\].*merge_data_states"):
        target.load_state_dict(loaders[0].state_dict())


def test_inconsistent_or_mismatched_states_are_refused():
    loader = rank_loaders(1)[0]
    global_batches([loader], 1)
    state = loader.state_dict()
    with pytest.raises(ValueError, match=r"data state is inconsistent: data shard 0"):
        rank_loaders(1)[0].load_state_dict(
            {**state, "next_position": state["next_position"] + SHARDS}
        )
    with pytest.raises(
        ValueError, match=r"training.data_shards: .*saved with 8 data shards.*is 16"
    ):
        rank_loaders(1, shards=16)[0].load_state_dict(state)
    with pytest.raises(ValueError, match=r"disagree on data_shards"):
        merge_data_states([state, {**state, "data_shards": 16}])
    with pytest.raises(ValueError, match=r"no state holds data shards \[1, 3, 5, 7\]"):
        merge_data_states([rank_loaders(2)[0].state_dict()])


def test_dp_must_divide_data_shards():
    message = r"training.data_shards \(8\) must be divisible by the data-parallel degree \(3\)"
    with pytest.raises(ValueError, match=message):
        rank_loaders(3, shards=8)


def _expected_epoch_windows(shard: int, shards: int, window: int, count: int) -> list[list[int]]:
    epoch = [t for doc in EPOCH_DOCS[shard::shards] for t in ByteTokenizer().encode(doc)]
    stream = epoch * (count * window // len(epoch) + 1)
    return [stream[i * window : (i + 1) * window] for i in range(count)]


def test_epoch_rollover_restarts_each_shard_on_its_own_documents():
    shards, seq_len, steps = 2, 16, 6
    loaders = rank_loaders(2, dataset="test_epoch_docs", seq_len=seq_len, shards=shards)
    batches = global_batches(loaders, steps)
    positions = torch.cat(batches)
    per_shard = {
        s: _expected_epoch_windows(s, shards, seq_len + 1, len(positions) // shards)
        for s in range(shards)
    }
    expected = [per_shard[p % shards][p // shards] for p in range(len(positions))]
    assert positions.tolist() == expected
    state = merge_data_states([loader.state_dict() for loader in loaders])
    assert all(cursor[0] >= 2 for cursor in state["shards"].values())  # several epochs deep

    single = dict(dataset="test_epoch_docs", seq_len=seq_len, shards=shards)
    uninterrupted = global_batches(rank_loaders(1, **single), steps + 4)
    resumed = rank_loaders(1, **single)
    resumed[0].load_state_dict(state)
    assert same_batches(global_batches(resumed, 4), uninterrupted[steps:])


def _finite_run(dp: int) -> list[torch.Tensor]:
    """Every rank iterates its finite loader to the end in its own thread, as real ranks would;
    ``global_min`` is a barrier-synchronised MIN over the simulated ranks."""
    barrier, values = threading.Barrier(dp, timeout=60), [0] * dp
    results: list[list[torch.Tensor]] = [[] for _ in range(dp)]

    def run(rank: int) -> None:
        def global_min(value: int) -> int:
            values[rank] = value
            barrier.wait()
            return min(values)

        loader = rank_loader(dp, rank, global_min=global_min, **FINITE)
        results[rank] = [_windows(batch) for batch in loader]

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(dp)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    steps = {len(r) for r in results}
    assert len(steps) == 1, f"ranks ran different numbers of steps: {steps}"
    return [_assemble([results[rank][step] for rank in range(dp)]) for step in range(steps.pop())]


@pytest.mark.slow
def test_finite_loader_is_layout_independent_and_restartable():
    one = _finite_run(1)
    assert (
        len(one) > 2 and 0 < len(one[-1]) < FINITE["global_batch"]
    )  # ends with a partial global batch
    for dp in (2, 4):
        assert same_batches(_finite_run(dp), one), f"dp={dp}"
    loader = rank_loaders(1, **FINITE)[0]
    first, second = [_windows(b) for b in loader], [_windows(b) for b in loader]
    assert same_batches(first, one) and same_batches(second, one)


@pytest.mark.slow
def test_finite_loader_resumes_mid_iteration():
    loader = rank_loaders(1, **FINITE)[0]
    full = [_windows(b) for b in loader]
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    resumed = rank_loaders(1, **FINITE)[0]
    resumed.load_state_dict(state)
    assert same_batches([_windows(b) for b in resumed], full[1:])
    assert same_batches([_windows(b) for b in resumed], full)  # the next iteration starts over


GLOO_PROBE = """
import hashlib, json, os, sys
import torch.distributed as dist
from torchtitan.data.loader import build_dataloader
from torchtitan.data.tokenizers import ByteTokenizer
from torchtitan.distributed import ParallelDims
dist.init_process_group("gloo")
dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1,
                    world_size=dist.get_world_size(), device_type="cpu")
from torchtitan.config import ConfigManager
job = ConfigManager().parse_args(
    ["--validation.seq_len", "512", "--validation.local_batch_size", "3"]
)
loader = build_dataloader(job.validation, dims, ByteTokenizer(), split="validation")
rows = [x + [y[-1]] for inputs, labels in loader \
for x, y in zip(inputs["input"].tolist(), labels.tolist())]
with open(os.path.join(os.environ["PROBE_DIR"], f"{dist.get_rank()}.json"), "w") as f:
    json.dump(rows, f)
from torchtitan.distributed.process import exit_skipping_static_destructors, leave_together
leave_together()
exit_skipping_static_destructors(0)
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_validation_loader_under_real_gloo_dp(tmp_path):
    """build_dataloader's validation loader all-reduces its end over the real dp group."""
    from tests.launcher import run_probe

    probes = run_probe(2, GLOO_PROBE, tmp_path)
    per_rank = [torch.tensor(probes[rank]) for rank in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) > 0
    single = rank_loader(
        1, 0, dataset="python_stdlib_validation", seq_len=512, global_batch=3, infinite=False
    )
    assert torch.equal(_assemble(per_rank), torch.cat([_windows(batch) for batch in single]))
