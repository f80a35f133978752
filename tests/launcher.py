"""The one helper every multi-process test uses: launch torchrun on CPU/gloo, with a
timeout, and always clean up the whole process group it started."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


class TorchrunError(RuntimeError):
    pass


def run_torchrun(
    nproc: int,
    args: list[str],
    *,
    module: str | None = "torchtitan.train",
    script: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run ``torchrun --nproc_per_node nproc -m module args`` (or a script) on CPU/gloo.

    The processes run in their own session so that a timeout kills every rank.
    """
    proc = start_torchrun(nproc, args, module=module, script=script, env=env)
    return _wait(proc, timeout, check)


def run_command(
    cmd: list[str],
    *,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    cwd: Path = REPO_ROOT,
) -> subprocess.CompletedProcess:
    """Run any command (run_train.sh, a script) from ``cwd`` (the repository root unless
    given) with the test environment of ``start_torchrun``; stdout holds stdout and stderr.
    Never raises on a non-zero exit."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=_test_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    return _wait(proc, timeout, check=False)


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (torchrun starts each rank in a session of its own,
    out of reach of a kill of torchrun's process group)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s session and every process below it, ranks included."""
    ranks = _descendants(proc.pid)
    for kill, pid in [(os.killpg, proc.pid), *((os.kill, rank) for rank in ranks)]:
        try:
            kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait(proc: subprocess.Popen, timeout: float, check: bool) -> subprocess.CompletedProcess:
    """Wait for ``proc``; on a timeout kill it and every rank below it. Always reaps every
    process."""
    cmd = proc.args
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, _ = proc.communicate()
        raise TorchrunError(
            f"timed out after {timeout}s: {' '.join(map(str, cmd))}\n{out[-6000:]}"
        ) from None
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, None)
    if check and proc.returncode != 0:
        raise TorchrunError(f"exit {proc.returncode}: {' '.join(map(str, cmd))}\n{out[-8000:]}")
    return result


def start_torchrun(
    nproc: int,
    args: list[str],
    *,
    module: str | None = "torchtitan.train",
    script: str | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """Start torchrun as ``run_torchrun`` does, without waiting: stdout (merged with stderr)
    is a text pipe, and ``kill_tree(proc)`` reaches every rank. The caller must reap it
    (tests that kill a run mid-way)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
    ]
    cmd += ["-m", module] if script is None else [str(script)]
    cmd += list(args)
    return subprocess.Popen(
        cmd,
        cwd=REPO_ROOT,
        env=_test_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _test_env(extra: dict[str, str] | None) -> dict[str, str]:
    """CPU/gloo, one thread per process, unbuffered output, this checkout first on the path."""
    env = dict(os.environ)
    env.update(
        TORCHTITAN_DEVICE_TYPE="cpu",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=f"{REPO_ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}",
    )
    env.update(extra or {})
    return env


def read_metrics(dump_folder: str | Path) -> list[dict]:
    """The per-step records a run wrote to ``{dump_folder}/metrics.jsonl``."""
    path = Path(dump_folder) / "metrics.jsonl"
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_probe(nproc: int, source: str, folder: Path, timeout: float = 110) -> dict[int, Any]:
    """Run the script ``source`` on ``nproc`` ranks; it writes ``$PROBE_DIR/{rank}.json``.
    Returns each rank's JSON by rank."""
    script = folder / "probe.py"
    script.write_text(source)
    run_torchrun(nproc, [], script=str(script), timeout=timeout, env={"PROBE_DIR": str(folder)})
    return {int(p.stem): json.loads(p.read_text()) for p in folder.glob("*.json")}


def start_lighthouse(min_replicas: int) -> tuple[subprocess.Popen, str]:
    """A torchft lighthouse on a free port, quick to notice joins and losses (tests and the
    soak script): its process (in a session of its own) and its address."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    binary = Path(sys.executable).parent / "torchft_lighthouse"
    proc = subprocess.Popen(
        [
            str(binary),
            "--min_replicas",
            str(min_replicas),
            "--bind",
            f"[::]:{port}",
            "--join_timeout_ms",
            "2000",
            "--heartbeat_timeout_ms",
            "1000",
            "--quorum_tick_ms",
            "50",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    return proc, f"http://localhost:{port}"
