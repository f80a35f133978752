"""Soak test of checkpoints on object storage: FSDP 2 (CPU, gloo, tiny Llama 3) saves
asynchronously every 2 steps into ``s3://`` of a local S3 server (SeaweedFS, started here),
and the whole job is killed (SIGKILL, every rank) at a random moment ``--kills`` times, then
started again; the last attempt runs to the end.

    python scripts/soak_object_storage.py [--steps 80] [--kills 5] [--seed 0]

After each kill the bucket is listed: committed steps (marker present) and uncommitted ones
(files without a marker). Each restart must resume from the newest committed step, delete
the uncommitted ones, and every step it logs must equal, bitwise (loss and grad norm), the
same step of an uninterrupted run with a local checkpoint folder. Prints one line per kill
and a JSON summary; exit status 1 if any check failed. Not part of CI (minutes long).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from scripts.s3_server import S3Server  # noqa: E402
from tests.launcher import kill_tree, read_metrics, run_torchrun, start_torchrun  # noqa: E402
from tests.parity import train_args  # noqa: E402

NPROC = 2
LOADED = re.compile(r"loaded checkpoint s3://\S+/step-(\d+) ")
REMOVED = re.compile(r"removing s3://\S+/step-(\d+), left by an interrupted")


def run_flags(steps: int, folder: str) -> list[str]:
    return [
        *("--training.steps", str(steps), "--checkpoint.enable", "--checkpoint.interval", "2"),
        *("--checkpoint.async_mode", "async", "--checkpoint.folder", folder),
        "--checkpoint.no_last_save_model_only",
    ]


def bucket_state(server: S3Server, prefix: str) -> tuple[list[int], list[int]]:
    """(committed steps, uncommitted steps) under ``prefix``."""
    fs = server.filesystem()
    committed, uncommitted = [], []
    for entry in fs.ls(prefix) if fs.exists(prefix) else []:
        name = entry.rsplit("/", 1)[1]
        # SeaweedFS lists an emptied folder as its own directory object ("step-2/")
        files = [f for f in fs.ls(entry) if not f.endswith("/")]
        if not name.startswith("step-") or not files:
            continue
        step = int(name.removeprefix("step-"))
        (committed if fs.exists(f"{entry}/checkpoint.json") else uncommitted).append(step)
    return sorted(committed), sorted(uncommitted)


def attempt(dump: Path, flags: list[str], env: dict[str, str], kill_after: float | None) -> str:
    """One start of the job; killed ``kill_after`` seconds after its first step (None: runs
    to the end). Returns its output."""
    proc = start_torchrun(NPROC, train_args(NPROC, dump, flags), env=env)
    lines: list[str] = []
    first_step = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "step:" in line:
                first_step.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if kill_after is not None:
        first_step.wait(timeout=180)
        time.sleep(kill_after)
        kill_tree(proc)
    proc.wait(timeout=600)
    reader.join(timeout=10)
    return "".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    failures: list[str] = []
    kills = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        reference_flags = run_flags(args.steps, str(root / "reference-checkpoint"))
        run_torchrun(NPROC, train_args(NPROC, root / "reference", reference_flags), timeout=900)
        reference = {r["step"]: r for r in read_metrics(root / "reference")}
        server = S3Server(root / "s3")
        try:
            folder = f"{server.make_bucket('soak')}/run"
            flags = run_flags(args.steps, folder)
            newest_committed: int | None = None
            previous_uncommitted: list[int] = []
            for index in range(args.kills + 1):
                last = index == args.kills
                kill_after = None if last else rng.uniform(0.5, 6.0)
                dump = root / f"attempt-{index}"
                output = attempt(dump, flags, server.env, kill_after)
                loaded = [int(s) for s in LOADED.findall(output)]
                removed = sorted(int(s) for s in REMOVED.findall(output))
                want_loaded = [] if newest_committed is None else [newest_committed]
                if index and loaded != want_loaded:
                    failures.append(
                        f"attempt {index}: loaded {loaded}, newest committed step "
                        f"{newest_committed}"
                    )
                records = read_metrics(dump) if (dump / "metrics.jsonl").exists() else []
                for record in records:
                    want = reference[record["step"]]
                    if (record["loss"], record["grad_norm"]) != (want["loss"], want["grad_norm"]):
                        failures.append(f"attempt {index}: step {record['step']} differs")
                committed, uncommitted = bucket_state(server, "soak/run")
                line = {
                    "attempt": index,
                    "killed_after_s": None if last else round(kill_after, 2),
                    "resumed_from": loaded,
                    "purged_at_start": removed,
                    "steps_logged": [records[0]["step"], records[-1]["step"]] if records else [],
                    "committed_after": committed,
                    "uncommitted_after": uncommitted,
                }
                kills.append(line)
                print(json.dumps(line), flush=True)
                if index and removed != previous_uncommitted:
                    failures.append(
                        f"attempt {index}: purged {removed}, uncommitted were "
                        f"{previous_uncommitted}"
                    )
                previous_uncommitted = uncommitted
                newest_committed = max(committed, default=None)
            if kills[-1]["steps_logged"][-1:] != [args.steps]:
                failures.append("the last attempt did not reach the last step")
        finally:
            server.stop()
    summary = {
        "kills": args.kills,
        "resumes_from_the_newest_committed_step": sum(1 for k in kills[1:] if k["resumed_from"]),
        "uncommitted_steps_purged": sum(len(k["purged_at_start"]) for k in kills),
        "failures": failures,
    }
    print(json.dumps(summary, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
