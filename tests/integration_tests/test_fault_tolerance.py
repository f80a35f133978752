"""Replica-group fault tolerance on torchft (CPU/gloo, tiny Llama 3, fp32): a torchft
lighthouse and replica groups that are separate torchrun jobs.

- Without failures, 2 groups x FSDP 2 match one process (loss and grad norm, 1e-4).
- One group is killed with SIGKILL mid-run: the other keeps stepping alone, the killed group
  is relaunched, heals from the survivor, and both end with bitwise identical weights.
- A group that joins behind a malicious peer refuses the state it is sent (a pickle that
  would run code) in one line and stops; the code never runs.
- DiLoCo and LocalSGD, 2 groups x FSDP 2 each, outer sync every 3 steps: the loss falls, the
  outer syncs are logged, and the groups hold bitwise equal weights after each sync only.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.launcher import kill_tree, read_metrics, start_lighthouse, start_torchrun
from tests.parity import assert_loss_falls, assert_parity, train_args

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

FT = [
    "--fault_tolerance.enable",
    "--fault_tolerance.group_size",
    "2",
    "--fault_tolerance.process_group_timeout_ms",
    "5000",
]
QUIET = {"RUST_LOG": "warn"}  # torchft's Rust side logs every quorum at INFO


@pytest.fixture
def lighthouse(request) -> Iterator[str]:
    """A torchft lighthouse on a free port; ``request.param`` is its min_replicas."""
    proc, address = start_lighthouse(request.param)
    try:
        yield address
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class _Group:
    """One replica group's torchrun job; its output is read continuously (a full pipe would
    stall the ranks)."""

    def __init__(
        self,
        replica: int,
        nproc: int,
        folder: Path,
        address: str,
        extra: list[str],
        env: dict[str, str] | None = None,
    ) -> None:
        args = train_args(
            nproc, folder, FT + ["--fault_tolerance.replica_id", str(replica)] + extra, dp=nproc * 2
        )
        env = {"TORCHFT_LIGHTHOUSE": address, **QUIET, **(env or {})}
        self.proc = start_torchrun(nproc, args, env=env)
        self.lines: list[str] = []
        self.reader = threading.Thread(
            target=lambda: self.lines.extend(self.proc.stdout), daemon=True
        )
        self.reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def kill(self) -> None:
        kill_tree(self.proc)
        self.proc.wait()
        self.reader.join()

    def finish(self, timeout: float = 300) -> str:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.kill()
        self.reader.join()
        assert self.proc.returncode == 0, self.output[-6000:]
        return self.output


def _group_metrics(folder: Path, replica: int) -> list[dict]:
    return read_metrics(folder / f"replica_{replica}")


@pytest.mark.parametrize("lighthouse", [2], indirect=True)
def test_two_replica_groups_of_fsdp2_match_one_process(lighthouse, reference_run, tmp_path):
    both = ["--fault_tolerance.min_replica_size", "2"]
    groups = [_Group(r, 2, tmp_path, lighthouse, both) for r in (0, 1)]
    for group in groups:
        group.finish()
    for replica in (0, 1):
        records = _group_metrics(tmp_path, replica)
        assert_parity(reference_run, records)
        assert {r["replica_groups"] for r in records} == {2}


def _wait_for(predicate, what: str, group: _Group, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline or group.proc.poll() is not None:
            group.kill()
            raise AssertionError(f"gave up waiting for {what}:\n{group.output[-6000:]}")
        time.sleep(0.1)


def _steps(folder: Path, replica: int) -> list[dict]:
    path = folder / f"replica_{replica}" / "metrics.jsonl"
    return _group_metrics(folder, replica) if path.exists() else []


def _final_weights(folder: Path, replica: int, step: int, out: Path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(folder / f"replica_{replica}" / "checkpoint" / f"step-{step}", out)
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("lighthouse", [1], indirect=True)
def test_a_killed_group_rejoins_from_the_survivor_with_identical_weights(lighthouse, tmp_path):
    steps, kill_after = 36, 4
    # slow steps keep the survivor running while the killed group restarts (~15 s here);
    # checkpointing on: each rank's data position is written after every committed step
    extra = [
        "--training.steps",
        str(steps),
        "--debug.step_sleep_seconds",
        "0.8",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "1000",
    ]
    survivor = _Group(0, 2, tmp_path, lighthouse, extra)
    victim = _Group(1, 2, tmp_path, lighthouse, extra)
    _wait_for(
        lambda: len(_steps(tmp_path, 1)) >= kill_after,
        f"replica group 1 to log step {kill_after}",
        survivor,
    )
    victim.kill()
    killed_at = _steps(tmp_path, 1)[-1]["step"]
    _wait_for(
        lambda: sum(r["replica_groups"] == 1 for r in _steps(tmp_path, 0)) >= 2,
        "the survivor to step alone",
        survivor,
    )
    relaunched = time.monotonic()
    rejoining = _Group(1, 2, tmp_path, lighthouse, extra)
    _wait_for(
        lambda: any(r["step"] > killed_at for r in _steps(tmp_path, 1)),
        "the relaunched group's first step",
        rejoining,
    )
    recovery_s = time.monotonic() - relaunched
    log = rejoining.finish()
    retried = survivor.finish().count("not committed") // 2  # both ranks warn

    alone = [r for r in _steps(tmp_path, 0) if r["replica_groups"] == 1]
    survivor_records = _steps(tmp_path, 0)
    first = survivor_records[0]["step"]
    # no step lost or repeated; on a busy machine group 1 may reach the first quorum alone,
    # and group 0 then joins by healing from it: group 1 alone trained the steps before
    assert [r["step"] for r in survivor_records] == list(range(first, steps + 1))
    assert [r["step"] for r in _steps(tmp_path, 1)][: first - 1] == list(range(1, first))
    assert first <= killed_at, "group 0 joined after the kill: the test would mean nothing"
    assert survivor_records[-1]["replica_groups"] == 2, "the relaunched group never rejoined"
    before = max(r["loss"] for r in survivor_records if killed_at - 3 < r["step"] <= killed_at)
    assert all(r["loss"] < before * 1.1 for r in alone), "the survivor's loss jumped after the kill"
    assert_loss_falls(survivor_records)
    assert (
        "recovered from a live replica group" in log and "data loader resumes after step" in log
    ), log[-4000:]
    rejoined_at = next(r["step"] for r in _steps(tmp_path, 1) if r["step"] > killed_at)
    print(
        f"killed after step {killed_at}; "
        f"survivor alone for steps {alone[0]['step']}-{alone[-1]['step']}; "
        f"rejoined at step {rejoined_at}, {recovery_s:.1f}s after the relaunch; "
        f"survivor steps run again: {retried}"
    )

    weights = [_final_weights(tmp_path, r, steps, tmp_path / f"w{r}.pt") for r in (0, 1)]
    assert weights[0].keys() == weights[1].keys()
    for key in weights[0]:
        assert torch.equal(weights[0][key], weights[1][key]), key


@pytest.mark.parametrize("lighthouse", [1], indirect=True)
def test_a_heal_from_a_malicious_peer_is_refused_and_never_runs(lighthouse, tmp_path):
    """Group 0 publishes, as its state for healing, a pickle that would touch a marker; group
    1 joins behind it, refuses the state in one error line and stops; the marker never
    appears (torchft's own transport would run it: test_heal_transport.py)."""
    marker = tmp_path / "code-ran"
    extra = ["--training.steps", "200", "--debug.step_sleep_seconds", "0.5"]  # outlasts the join
    peer = _Group(
        0,
        1,
        tmp_path,
        lighthouse,
        extra + ["--experimental.custom_import", "tests.integration_tests.malicious_heal_peer"],
        env={"MALICIOUS_HEAL_MARKER": str(marker)},
    )
    try:
        _wait_for(lambda: len(_steps(tmp_path, 0)) >= 3, "the peer's third step", peer)
        joining = _Group(1, 1, tmp_path, lighthouse, extra)
        joining.proc.wait(timeout=240)
        joining.reader.join()
    finally:
        peer.kill()
    out = joining.output
    assert joining.proc.returncode != 0, out[-4000:]
    refusals = [line for line in out.splitlines() if "is not plain tensors and data" in line]
    assert len(refusals) == 1 and "error:" in refusals[0], out[-4000:]
    assert "got exception in recovery" not in out, out[-4000:]
    assert not marker.exists()
    assert not _steps(tmp_path, 1), "the joining group trained on"


SYNC_STEPS, SEMI_SYNC_STEPS = 3, 9


@pytest.mark.parametrize("lighthouse", [2], indirect=True)
@pytest.mark.parametrize("method", ["diloco", "local_sgd"])
def test_semi_sync_groups_of_fsdp2_train_and_agree_after_every_outer_sync(
    lighthouse, method, tmp_path
):
    """2 groups x FSDP 2: the loss falls, the outer syncs are logged, and after each one (a
    checkpoint of the step it ends) the two groups hold bitwise equal weights, which differ
    between syncs."""
    extra = [
        "--fault_tolerance.semi_sync_method",
        method,
        "--fault_tolerance.sync_steps",
        str(SYNC_STEPS),
        "--fault_tolerance.min_replica_size",
        "2",
        "--training.steps",
        str(SEMI_SYNC_STEPS),
        "--checkpoint.enable",
        "--checkpoint.interval",
        "1",
        "--checkpoint.keep_latest_k",
        "0",
        "--checkpoint.no-last_save_model_only",
    ]
    groups = [_Group(r, 2, tmp_path, lighthouse, extra) for r in (0, 1)]
    for group in groups:
        group.finish()
    for replica in (0, 1):
        records = _group_metrics(tmp_path, replica)
        assert_loss_falls(records)
        syncs = [r["outer_syncs"] for r in records]
        assert syncs == [(step + 1) // SYNC_STEPS for step in range(SEMI_SYNC_STEPS)]
    for step in range(1, SEMI_SYNC_STEPS + 1):
        weights = [
            _model_weights(tmp_path, replica, step, tmp_path / f"w{replica}.pt")
            for replica in (0, 1)
        ]
        equal = all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
        assert equal == (step % SYNC_STEPS == 0), f"step {step}: groups equal is {equal}"


def _model_weights(folder: Path, replica: int, step: int, out: Path) -> dict[str, torch.Tensor]:
    """The model's weights (a full checkpoint holds them beside "optimizer" and "rng")."""
    state = _final_weights(folder, replica, step, out)
    return {k: v for k, v in state.items() if k not in ("optimizer", "rng")}
