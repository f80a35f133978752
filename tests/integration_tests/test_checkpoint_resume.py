"""Checkpointing end to end (tiny Llama 3, fp32, CPU/gloo): exact resume, resharding to other
layouts, kill -9 in the middle of a save, seed checkpoints, automatic restart after a fault.

The uninterrupted runs and the seed are shared through module-scoped fixtures: 17 launches.
"""

from __future__ import annotations

import json
import math
import shutil
import threading
from pathlib import Path

import pytest

from tests.integration_tests.pause_line import PAUSE_LINE
from tests.launcher import kill_tree, read_metrics, run_command, run_torchrun, start_torchrun
from tests.layouts import DDP_2, HSDP_2X2
from tests.parity import SEED, train_args
from torchtitan.components.checkpointing.folders import MANIFEST
from torchtitan.components.checkpointing.safe_loading import read_dcp_metadata

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

STEPS = 20
RESUME_AT = 10
CKPT = [
    "--checkpoint.enable",
    "--checkpoint.interval",
    str(RESUME_AT),
    "--training.steps",
    str(STEPS),
]
FULL_LAST = ["--checkpoint.no-last_save_model_only"]  # step-20 keeps the data state to compare
LAYOUTS = {
    "1proc": (1, []),
    "fsdp2": (2, []),
    "fsdp4": (4, []),
    "hsdp2x2": (4, HSDP_2X2),
    "ddp2": (2, DDP_2),
    "fsdp2_tp2": (
        4,
        ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"],
    ),
    "pp2_fsdp2": (
        4,
        ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4"],
    ),
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "8"]),
}
RESHARD_RTOL = 1e-4


def run(layout: str, folder: Path, overrides: list[str]) -> tuple[list[dict], str]:
    """(metrics.jsonl records, console output) of one run."""
    nproc, layout_args = LAYOUTS[layout]
    out = run_torchrun(
        nproc, train_args(nproc, folder, layout_args + list(overrides)), timeout=300
    ).stdout
    return read_metrics(folder), out


def copy_checkpoint(src: Path, dst: Path, step: int) -> None:
    shutil.copytree(src / "checkpoint" / f"step-{step}", dst / "checkpoint" / f"step-{step}")


def manifest(folder: Path, step: int) -> dict:
    return json.loads((folder / "checkpoint" / f"step-{step}" / MANIFEST).read_text())


def by_step(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records}


class StraightRuns:
    """20 uninterrupted steps per layout (full checkpoint at 10), each run once per module."""

    def __init__(self, factory) -> None:
        self.factory = factory
        self.cache: dict[str, tuple[Path, list[dict]]] = {}

    def __call__(self, layout: str) -> tuple[Path, list[dict]]:
        if layout not in self.cache:
            folder = self.factory.mktemp(f"straight-{layout}")
            extra = FULL_LAST if layout == "fsdp4" else []
            self.cache[layout] = (folder, run(layout, folder, CKPT + extra)[0])
        return self.cache[layout]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> StraightRuns:
    return StraightRuns(tmp_path_factory)


def stop_after_step_10(layout: str, folder: Path, overrides: list[str] = ()) -> list[dict]:
    """Train as if preempted after step 10: a forced full checkpoint, exit 0; its records."""
    stopped, _ = run(layout, folder, CKPT + ["--debug.stop_after_step", str(RESUME_AT), *overrides])
    assert [r["step"] for r in stopped] == list(range(1, RESUME_AT + 1))
    state = manifest(folder, RESUME_AT)
    assert not state["model_only"]
    assert state["states"]["train_state"] == {"step": RESUME_AT, "seed": SEED}
    return stopped


def assert_bitwise_equal_after_10(straight: list[dict], resumed: list[dict]) -> None:
    assert_bitwise_equal(straight, resumed, range(RESUME_AT + 1, STEPS + 1))


def assert_bitwise_equal(straight: list[dict], other: list[dict], steps: range) -> None:
    for step in steps:
        a, b = by_step(straight)[step], by_step(other)[step]
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), (
            f"step {step}: {a} vs {b}"
        )


@pytest.mark.parametrize("layout", ["1proc", "fsdp2_tp2"])
def test_exact_resume(straight, layout, tmp_path):
    stop_after_step_10(layout, tmp_path)
    resumed, out = run(layout, tmp_path, CKPT)
    assert f"step-{RESUME_AT} (step {RESUME_AT}; model, optimizer, rng" in out
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    assert_bitwise_equal_after_10(straight(layout)[1], resumed)


WORKERS = [
    "--training.dataloader.num_workers",
    "2",
    "--training.dataloader.persistent_workers",
    "--training.dataloader.prefetch_factor",
    "4",
    "--training.dataloader.pin_memory",
]


def test_exact_resume_with_dataloader_workers(straight, tmp_path):
    """Two worker processes: the same batches as the 0-worker run (steps 1-10), and a resume
    whose steps 11-20 are bitwise those of the uninterrupted 0-worker run."""
    reference = straight("1proc")[1]
    stopped = stop_after_step_10("1proc", tmp_path, WORKERS)
    assert_bitwise_equal(reference, stopped, range(1, RESUME_AT + 1))
    resumed, _ = run("1proc", tmp_path, CKPT + WORKERS)
    assert_bitwise_equal(reference, resumed, range(1, STEPS + 1))


def _kill_when_paused(proc, timeout: float) -> str:
    """Read the run's output until the pause hook fires, then SIGKILL every rank."""
    watchdog = threading.Timer(timeout, kill_tree, (proc,))
    watchdog.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if PAUSE_LINE in line:
                kill_tree(proc)
                break
    finally:
        watchdog.cancel()
        proc.wait()
        proc.stdout.close()
    return "".join(lines)


def test_fsdp2_exact_resume_through_a_kill_during_save(straight, tmp_path):
    """FSDP 2 stopped after step 10; relaunched (async saves every 5 steps) and killed -9 on
    all ranks while step-15 is half-saved; relaunched again: it ignores the half-saved
    checkpoint, resumes from step-10 and trains on bitwise as the uninterrupted run."""
    stop_after_step_10("fsdp2", tmp_path)
    overrides = CKPT + ["--checkpoint.interval", "5", "--checkpoint.async_mode", "async"]
    nproc, _ = LAYOUTS["fsdp2"]
    pause = ["--experimental.custom_import", "tests.integration_tests.pause_checkpoint_publish"]
    proc = start_torchrun(nproc, train_args(nproc, tmp_path, overrides + pause))
    out = _kill_when_paused(proc, timeout=240)
    assert proc.returncode != 0 and PAUSE_LINE in out, out[-3000:]
    folder = tmp_path / "checkpoint"
    assert (folder / "step-15.tmp" / ".metadata").is_file()  # every rank's data is written ...
    assert not (folder / "step-15.tmp" / MANIFEST).exists()  # ... but the save never completed
    assert sorted(p.name for p in folder.iterdir()) == ["step-10", "step-15.tmp"]

    resumed, out = run("fsdp2", tmp_path, overrides)
    assert "step-15.tmp, left by an interrupted checkpoint save" in out
    assert f"step-{RESUME_AT} (step {RESUME_AT}; model, optimizer, rng" in out
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    assert_bitwise_equal_after_10(straight("fsdp2")[1], resumed)
    assert sorted(p.name for p in folder.iterdir()) == ["step-10", "step-15", "step-20"]


@pytest.mark.parametrize(
    "layout",
    # FSDP 2 alone: CI runs its reshard inside HSDP 2 x 2; --matrix runs it alone
    [pytest.param("fsdp2", marks=pytest.mark.matrix), "hsdp2x2", "ddp2", "fsdp2_tp2", "pp2_fsdp2"],
)
def test_resume_under_another_layout(straight, layout, tmp_path):
    """Saved at step 10 by FSDP 4, resumed by another layout: same losses, same data."""
    ref_folder, reference = straight("fsdp4")
    copy_checkpoint(ref_folder, tmp_path, RESUME_AT)
    resumed, out = run(layout, tmp_path, CKPT + FULL_LAST)
    dp = 2 if layout != "hsdp2x2" else 4
    assert f"data position restored for dp degree {dp} (saved under dp degree 4)" in out
    assert [r["step"] for r in resumed] == list(range(RESUME_AT + 1, STEPS + 1))
    worst = 0.0
    for got in resumed:
        ref = by_step(reference)[got["step"]]
        worst = max(worst, abs(got["loss"] - ref["loss"]) / abs(ref["loss"]))
        assert math.isclose(got["loss"], ref["loss"], rel_tol=RESHARD_RTOL), (
            f"step {got['step']}: {got['loss']} vs {ref['loss']}"
        )
    print(f"{layout}: max relative loss difference to FSDP 4 over steps 11-20: {worst:.2e}")
    # the same data position after step 20 (the merged cursors of every data shard)
    assert (
        manifest(tmp_path, STEPS)["states"]["dataloader"]
        == manifest(ref_folder, STEPS)["states"]["dataloader"]
    )


def test_checkpoint_keys_are_plain_fqns_for_every_layout(straight):
    def keys(layout: str) -> set[str]:
        folder = straight(layout)[0] / "checkpoint" / f"step-{RESUME_AT}"
        return {
            k for k in read_dcp_metadata(folder).state_dict_metadata if not k.startswith("rng.")
        }

    one, fsdp4 = keys("1proc"), keys("fsdp4")
    assert one == fsdp4
    assert (
        "layers.0.attention.wq.weight" in one
        and "optimizer.state.layers.0.attention.wq.weight.exp_avg" in one
    )
    assert not any(
        w in k
        for k in one
        for w in ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
    )


@pytest.fixture(scope="module")
def seed_folder(tmp_path_factory) -> Path:
    """A seed checkpoint of weights initialised with another seed than the runs use."""
    folder = tmp_path_factory.mktemp("seed")
    args = train_args(1, folder, ["--checkpoint.create_seed_checkpoint", "--debug.seed", "123"])
    out = run_torchrun(1, args, timeout=300).stdout
    assert "seed checkpoint written" in out
    assert manifest(folder, 0)["model_only"]
    assert not (folder / "metrics.jsonl").exists()
    return folder


def test_seed_checkpoint_gives_every_layout_the_same_start(straight, seed_folder, tmp_path):
    one_step = ["--checkpoint.enable", "--training.steps", "1"]
    seed = str(seed_folder / "checkpoint" / "step-0")
    losses = {}
    for layout in ("fsdp4", "tp2"):
        records, out = run(
            layout, tmp_path / layout, one_step + ["--checkpoint.initial_load_path", seed]
        )
        assert "step-0 (step 0; model)" in out
        losses[layout] = records[0]["loss"]
    copy_checkpoint(seed_folder, tmp_path / "1proc", 0)  # the seed in the run's own folder
    records, _ = run("1proc", tmp_path / "1proc", one_step)
    losses["1proc"] = records[0]["loss"]
    assert all(math.isclose(v, losses["1proc"], rel_tol=1e-6) for v in losses.values()), losses
    unseeded = straight("1proc")[1][0]["loss"]
    assert not math.isclose(unseeded, losses["1proc"], rel_tol=1e-3), "the seed was not loaded"


LORA = ["--model.converters", "lora", "--lora.target_modules", "attention,mlp", "--lora.rank", "4"]


def tensor_elements(folder: Path) -> int:
    """Elements of the model and optimizer tensors of a DCP checkpoint."""
    entries = read_dcp_metadata(folder).state_dict_metadata.items()
    return sum(math.prod(v.size) for k, v in entries if hasattr(v, "size") and "rng." not in k)


def test_lora_adapters_only_checkpoint_resumes_exactly(straight, seed_folder, tmp_path):
    """FSDP 2 LoRA on the seed as frozen base: the step-10 checkpoint holds adapters and
    their optimizer state only; the resume loads the base, then the adapters, and steps
    11-20 are bitwise those of the uninterrupted run."""
    base = ["--checkpoint.initial_load_path", str(seed_folder / "checkpoint" / "step-0")]
    straight_lora, _ = run("fsdp2", tmp_path / "straight", CKPT + LORA + base)
    unseeded = straight("1proc")[1][0]["loss"]  # the same init, no base loaded: B = 0 at step 1
    assert not math.isclose(straight_lora[0]["loss"], unseeded, rel_tol=1e-3), "base not loaded"
    stop_after_step_10("fsdp2", tmp_path / "resumed", LORA + base)
    step10 = tmp_path / "resumed" / "checkpoint" / f"step-{RESUME_AT}"
    keys = [k for k in read_dcp_metadata(step10).state_dict_metadata if not k.startswith("rng.")]
    assert keys and all(k.endswith(("lora_a", "lora_b")) or ".lora_" in k for k in keys), keys
    assert any(k.startswith("optimizer.state.") for k in keys)
    full = tensor_elements(straight("1proc")[0] / "checkpoint" / f"step-{RESUME_AT}")
    assert tensor_elements(step10) < full / 10, (tensor_elements(step10), full)
    resumed, out = run("fsdp2", tmp_path / "resumed", CKPT + LORA + base)
    assert out.index("step-0 (step 0; model)") < out.index(f"step-{RESUME_AT} (step {RESUME_AT};")
    assert_bitwise_equal_after_10(straight_lora, resumed)


# ------------------------------------------------------------------ automatic restart
ATTEMPT_MARK = " steps (starting at step "  # the trainer logs it once per attempt


def run_train_sh(nproc: int, folder: Path, overrides: list[str], max_restarts: int):
    """./run_train.sh (config check, then our launcher) with MAX_RESTARTS."""
    env = {"NGPU": str(nproc), "MAX_RESTARTS": str(max_restarts)}
    return run_command(
        ["./run_train.sh", *train_args(nproc, folder, overrides)], env=env, timeout=300
    )


def test_restart_after_a_fault_resumes_exactly(straight, tmp_path):
    """FSDP 2, saves every 5 steps; rank 1 raises at step 7 in the first attempt only.
    torchrun restarts both ranks (MAX_RESTARTS=1), they resume from step-5 on their own and
    finish with every step bitwise that of the uninterrupted run."""
    fault = ["--checkpoint.interval", "5", "--debug.fail_at_step", "7", "--debug.fail_on_rank", "1"]
    result = run_train_sh(2, tmp_path, CKPT + fault, max_restarts=1)
    out = result.stdout
    assert result.returncode == 0, out[-6000:]
    assert out.count(ATTEMPT_MARK) == 2 and "(starting at step 6)" in out, out[-6000:]
    assert "step-5 (step 5; model, optimizer, rng" in out, out[-6000:]
    restarted = read_metrics(tmp_path)
    assert [r["step"] for r in restarted] == list(range(1, STEPS + 1))
    assert_bitwise_equal(straight("fsdp2")[1], restarted, range(1, STEPS + 1))


def test_a_crash_loop_stops_with_one_line(tmp_path):
    """The fault at step 2 in every attempt: after the second failure there the launcher
    stops (exit 2, one error line) although MAX_RESTARTS would allow 3 more attempts."""
    fault = [
        "--training.steps",
        "3",
        "--debug.fail_at_step",
        "2",
        "--debug.fail_every_attempt",
        "--checkpoint.max_failures_at_same_step",
        "2",
    ]
    result = run_train_sh(1, tmp_path, fault, max_restarts=4)
    out = result.stdout
    assert result.returncode == 2, out[-6000:]
    assert out.count(ATTEMPT_MARK) == 2, out[-6000:]
    assert out.rstrip().splitlines()[-1] == (
        "error: checkpoint.max_failures_at_same_step: the run failed 2 times at step 2 "
        "(InjectedFault: debug.fail_at_step: injected fault at step 2 on rank 0); not restarting "
        f"again (tracebacks in {tmp_path / 'tracebacks.log'})"
    ), out[-6000:]
