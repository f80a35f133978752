"""The CPU precision decision (training.cpu_low_precision) with the measured matmul speed
faked both ways, and MFU, which never exceeds 100%."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.layouts import single_process_dims
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.config import ConfigManager, TrainingConfig
from torchtitan.tools import cpu_precision
from torchtitan.tools.cpu_precision import NATIVE_RATIO, resolve_cpu_precision
from torchtitan.tools.peaks import PeakFlops


@pytest.fixture
def speed(monkeypatch):
    """Set the measured ratio (low-precision / float32 matmul throughput) per dtype."""
    ratios: dict[torch.dtype, float] = {}
    monkeypatch.setattr(
        cpu_precision,
        "cached_measurement",
        lambda name, measure, **_: ratios[torch.bfloat16 if "bfloat16" in name else torch.float16],
    )
    return ratios


def _training(*args: str) -> TrainingConfig:
    return ConfigManager().parse_args(list(args)).training


def test_emulated_bf16_trains_in_float32_and_says_why(speed):
    speed[torch.bfloat16] = 0.012
    training = _training("--training.mixed_precision_param", "bfloat16")
    line = resolve_cpu_precision(training, "cpu")
    assert training.mixed_precision_param == "float32"
    assert line.startswith("training.cpu_low_precision=auto: this CPU (")
    assert "bfloat16 matmuls at 0.012x the speed of float32 (measured" in line
    assert "trains in float32 (training.mixed_precision_param)" in line
    assert "--training.cpu_low_precision force keeps bfloat16" in line and "\n" not in line


def test_full_bf16_and_bf16_reduce_follow_the_same_decision(speed):
    speed[torch.bfloat16] = 0.01
    training = _training(
        "--training.dtype", "bfloat16", "--training.mixed_precision_reduce", "bfloat16"
    )
    resolve_cpu_precision(training, "cpu")
    assert (training.dtype, training.mixed_precision_param, training.mixed_precision_reduce) == (
        "float32",
        "float32",
        "float32",
    )


def test_native_bf16_is_kept(speed):
    speed[torch.bfloat16] = 3.2
    training = _training()  # default: bf16 parameters for compute
    line = resolve_cpu_precision(training, "cpu")
    assert training.mixed_precision_param == "bfloat16"
    assert "bfloat16 (3.20x float32) native on this CPU (measured)" in line


def test_the_threshold_is_the_native_ratio(speed):
    speed[torch.bfloat16] = NATIVE_RATIO
    assert (
        resolve_cpu_precision(training := _training(), "cpu")
        and training.mixed_precision_param == "bfloat16"
    )
    speed[torch.bfloat16] = NATIVE_RATIO * 0.99
    assert (
        resolve_cpu_precision(training := _training(), "cpu")
        and training.mixed_precision_param == "float32"
    )


def test_fp16_is_decided_on_its_own_speed(speed):
    speed[torch.float16] = 0.02
    speed[torch.bfloat16] = 2.0
    training = _training("--training.mixed_precision_param", "float16")
    assert "float16 matmuls at 0.020x" in resolve_cpu_precision(training, "cpu")
    assert training.mixed_precision_param == "float32"


def test_force_keeps_the_configured_dtype(speed):
    speed[torch.bfloat16] = 0.01
    training = _training("--training.cpu_low_precision", "force")
    line = resolve_cpu_precision(training, "cpu")
    assert training.mixed_precision_param == "bfloat16"
    assert line.startswith("training.cpu_low_precision=force:") and "kept as configured" in line


def test_gpus_and_float32_runs_are_untouched(speed):
    speed[torch.bfloat16] = 0.01
    training = _training()
    assert resolve_cpu_precision(training, "cuda") is None
    assert training.mixed_precision_param == "bfloat16"
    assert (
        resolve_cpu_precision(_training("--training.mixed_precision_param", "float32"), "cpu")
        is None
    )


def test_the_real_measurement_runs_and_is_positive():
    """Not an assertion about this machine: only that the probe measures something."""
    assert cpu_precision.measure_matmul_ratio(torch.bfloat16) > 0


def _processor(tmp_path, peak: float) -> MetricsProcessor:
    config = ConfigManager().parse_args(["--job.dump_folder", str(tmp_path)])
    processor = MetricsProcessor(
        config.metrics,
        dump_folder=str(tmp_path),
        total_steps=10,
        parallel_dims=single_process_dims(),
        device=torch.device("cpu"),
        flops_per_token=1_000_000,
        owns_loss=True,
        compute_dtype=torch.float32,
    )
    processor.peak = PeakFlops(peak, "a planted peak")
    return processor


def test_mfu_never_exceeds_100_percent_when_the_peak_was_measured_low(tmp_path, caplog):
    processor = _processor(tmp_path, peak=1e3)  # far below any real rate: a planted slow peak
    processor.record_step(tokens=4096, data_seconds=0.0)
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        record = processor.log(1, loss=1.0, loss_max=1.0, grad_norm=1.0, lr=1e-3)
        again = processor.log(2, loss=1.0, loss_max=1.0, grad_norm=1.0, lr=1e-3)
    assert 0 < record["mfu"] <= 100 and again["mfu"] <= 100
    assert "exceeds the peak it divides by" in caplog.text
    processor.close()


def test_mfu_is_the_share_of_the_peak(tmp_path):
    processor = _processor(tmp_path, peak=1e18)
    processor.record_step(tokens=4096, data_seconds=0.0)
    record = processor.log(1, loss=1.0, loss_max=1.0, grad_norm=1.0, lr=1e-3)
    assert record["mfu"] == pytest.approx(100 * record["tflops"] * 1e12 / 1e18)
    processor.close()
