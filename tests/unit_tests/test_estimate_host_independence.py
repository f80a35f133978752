"""A plan for a GPU run never depends on the CPU that computes it: the estimator's printed
estimate and plan for a CUDA target are the same bytes whether this host's bf16 matmuls are
(faked) native or emulated, and a CPU target follows the host as the trainer does."""

from __future__ import annotations

import re

import pytest
import torch

from tests.hermetic import PLANTED_BF16_RATIOS
from tests.launcher import REPO_ROOT
from torchtitan import recipe
from torchtitan.estimate import cli
from torchtitan.estimate.build import TrainingBuild
from torchtitan.estimate.cli import main
from torchtitan.tools.cpu_precision import ratio_measurement_name
from torchtitan.tools.machine_cache import CACHE_ENV, record_measurement

DEBUG = [
    "--job.config_file",
    str(REPO_ROOT / "train_configs" / "debug_model.toml"),
    "--memory_estimation.world_size",
    "2",
]
FLOAT8 = ["--model.converters", "float8", "--quantize.linear.float8.filter_fqns", "output"]
FLOAT8 += ["--quantize.linear.float8.enable_fsdp_float8_all_gather"]
RUNS = {
    "adamw": [],
    "muon": ["--optimizer.name", "Muon"],
    "float8": FLOAT8,
}
PLAN = ["--memory_estimation.mode", "plan", "--memory_estimation.device_memory_gib", "80"]
PLAN += ["--memory_estimation.plan_traced_layouts", "1"]


def estimate_as_on(host_bf16: str, args: list[str], monkeypatch, tmp_path, capsys) -> str:
    """The estimator's output with this host's bf16 speed planted; seconds masked."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / host_bf16))
    record_measurement(
        ratio_measurement_name(torch.bfloat16),
        PLANTED_BF16_RATIOS[host_bf16],
        per_thread_count=False,
    )
    capsys.readouterr()
    assert main(DEBUG + args) == 0
    return re.sub(r"\d+(\.\d+)? s\b", "<t> s", capsys.readouterr().out)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("run", "mode"),
    [("adamw", "estimate"), ("muon", "estimate"), ("float8", "estimate")]
    + [("adamw", "plan"), ("muon", "plan")],  # the planner does not model float8 yet
)
def test_a_cuda_plan_is_the_same_on_any_host(run, mode, monkeypatch, tmp_path, capsys):
    args = RUNS[run] + (PLAN if mode == "plan" else [])
    native, emulated = (
        estimate_as_on(host, args, monkeypatch, tmp_path, capsys) for host in ("native", "emulated")
    )
    assert "traced" in native and ("target device cuda" in native or mode == "plan")
    assert native == emulated


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_trace_resolved_for_the_host_differs(monkeypatch, tmp_path, capsys):
    """Planted error: the estimator decides for the CPU that traces instead of the target
    (Muon's iteration dtype, as it did before) and two hosts' estimates of one GPU run differ."""
    monkeypatch.setattr(
        cli, "resolve_for_device", lambda config, _: recipe.resolve_for_device(config, "cpu")
    )
    resolved_for = TrainingBuild.resolved_for
    monkeypatch.setattr(TrainingBuild, "resolved_for", lambda build, _: resolved_for(build, "cpu"))
    outputs = [
        estimate_as_on(host, ["--optimizer.name", "Muon"], monkeypatch, tmp_path, capsys)
        for host in ("native", "emulated")
    ]
    assert outputs[0] != outputs[1]


@pytest.mark.parametrize("host", ["native", "emulated"])
def test_a_cpu_target_follows_the_host(host, monkeypatch, tmp_path, capsys):
    """For a CPU target the host is the machine that trains: its bf16 speed decides, as in
    the trainer (mode analytic: no trace needed)."""
    args = ["--memory_estimation.target_device", "cpu", "--memory_estimation.mode", "analytic"]
    args += ["--memory_estimation.device_memory_gib", "80"]
    out = estimate_as_on(host, args + RUNS["muon"], monkeypatch, tmp_path, capsys)
    ns_dtype = "bfloat16" if host == "native" else "float32"
    assert f"note: optimizer.muon.ns_dtype=auto: Newton-Schulz in {ns_dtype} on cpu" in out
    assert ("trains in float32" in out) == (host == "emulated")
