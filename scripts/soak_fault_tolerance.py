"""Soak test of replica-group fault tolerance: 2 replica groups x FSDP 2 (CPU, gloo, tiny
Llama 3) train for ``--steps`` steps while a random group is killed (SIGKILL) at random
moments ``--kills`` times and relaunched; each time the survivor must go on alone and the
relaunched group must heal from it and rejoin. At the end both groups' final weights must
be bitwise equal.

    python scripts/soak_fault_tolerance.py [--steps 300] [--kills 4] [--seed 0] [--folder F]

Prints one line per kill and a JSON summary: kills, recoveries, seconds to rejoin, steps run
again (uncommitted when a peer died mid-step), and whether the final weights agree.
Exit status 1 if any recovery failed or the weights differ. Not part of CI (minutes long).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests.launcher import kill_tree, read_metrics, start_lighthouse, start_torchrun  # noqa: E402
from torchtitan.components.checkpointing.safe_loading import load_plain_state  # noqa: E402

NPROC = 2
CONFIG = [
    "--job.config_file",
    str(REPO_ROOT / "train_configs" / "debug_model.toml"),
    "--model.flavor",
    "debugmodel_tiny",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--training.mixed_precision_param",
    "float32",
    "--training.data_shards",
    "8",
    "--metrics.log_freq",
    "1",
    "--debug.seed",
    "0",
    "--fault_tolerance.enable",
    "--fault_tolerance.group_size",
    "2",
    "--fault_tolerance.process_group_timeout_ms",
    "5000",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "100000",
]


class Group:
    """One replica group's torchrun job, its output drained by a thread."""

    def __init__(self, replica: int, folder: Path, lighthouse: str, steps: int) -> None:
        self.replica = replica
        args = CONFIG + [
            "--job.dump_folder",
            str(folder),
            "--fault_tolerance.replica_id",
            str(replica),
            "--training.steps",
            str(steps),
            "--debug.step_sleep_seconds",
            "0.3",
        ]
        env = {"TORCHFT_LIGHTHOUSE": lighthouse, "RUST_LOG": "warn"}
        self.proc = start_torchrun(NPROC, args, env=env)
        self.lines: list[str] = []
        self.reader = threading.Thread(
            target=lambda: self.lines.extend(self.proc.stdout), daemon=True
        )
        self.reader.start()

    def kill(self) -> None:
        kill_tree(self.proc)
        self.proc.wait()
        self.reader.join()

    def wait(self, timeout: float) -> int:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.kill()
        self.reader.join()
        return self.proc.returncode


def steps_of(folder: Path, replica: int) -> list[dict]:
    try:
        return read_metrics(folder / f"replica_{replica}")
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def wait_until(condition, what: str, timeout: float = 300) -> float:
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.5)
    return time.monotonic() - start


def final_weights(folder: Path, replica: int, step: int) -> dict[str, torch.Tensor]:
    out = folder / f"final_{replica}.pt"
    dcp_to_torch_save(folder / f"replica_{replica}" / "checkpoint" / f"step-{step}", out)
    state = load_plain_state(out.read_bytes(), str(out))
    return {k: v for k, v in state.items() if k not in ("optimizer", "rng")}


def soak(steps: int, kills: int, seed: int, folder: Path) -> dict:
    rng = random.Random(seed)
    lighthouse, address = start_lighthouse(min_replicas=1)
    groups = {r: Group(r, folder, address, steps) for r in (0, 1)}
    launched = list(groups.values())
    events = []
    try:
        wait_until(lambda: all(len(steps_of(folder, r)) >= 5 for r in (0, 1)), "both groups")
        for kill in range(1, kills + 1):
            time.sleep(rng.uniform(2.0, 12.0))
            victim = rng.choice((0, 1))
            survivor = 1 - victim
            groups[victim].kill()
            killed_at = steps_of(folder, victim)[-1]["step"]
            alone = wait_until(
                lambda s=survivor: steps_of(folder, s)[-1]["replica_groups"] == 1,
                "the survivor to step alone",
            )
            relaunched = time.monotonic()
            groups[victim] = Group(victim, folder, address, steps)
            launched.append(groups[victim])
            wait_until(
                lambda v=victim, k=killed_at: any(r["step"] > k for r in steps_of(folder, v)),
                "the relaunched group's first step",
            )
            recovery = time.monotonic() - relaunched
            event = {
                "kill": kill,
                "group": victim,
                "after_step": killed_at,
                "survivor_alone_after_s": round(alone, 1),
                "rejoined_after_s": round(recovery, 1),
            }
            events.append(event)
            print(json.dumps(event), flush=True)
            if steps_of(folder, survivor)[-1]["step"] > steps - 30:
                break  # too close to the end for another kill
        codes = {r: g.wait(timeout=900) for r, g in groups.items()}
    finally:
        for group in groups.values():
            if group.proc.poll() is None:
                group.kill()
        os.killpg(lighthouse.pid, signal.SIGKILL)
        lighthouse.wait()
    retried = sum("".join(g.lines).count("not committed") for g in launched) // NPROC
    weights = [final_weights(folder, r, steps) for r in (0, 1)]
    equal = weights[0].keys() == weights[1].keys() and all(
        torch.equal(weights[0][k], weights[1][k]) for k in weights[0]
    )
    losses = [r["loss"] for r in steps_of(folder, 0)]
    return {
        "steps": steps,
        "kills": len(events),
        "recoveries": len(events),
        "rejoin_seconds": [e["rejoined_after_s"] for e in events],
        "steps_run_again": retried,
        "exit_codes": codes,
        "final_weights_bitwise_equal": equal,
        "loss_first_last": [losses[0], losses[-1]],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kills", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--folder", type=Path, default=None)
    args = parser.parse_args(argv)
    folder = args.folder or Path(tempfile.mkdtemp(prefix="soak-"))
    summary = soak(args.steps, args.kills, args.seed, folder)
    print(json.dumps(summary))
    ok = summary["final_weights_bitwise_equal"] and set(summary["exit_codes"].values()) == {0}
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
