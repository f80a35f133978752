"""Upstream v0.2.x keys supported for real: lr_scheduler.total_steps, profiling.profiler_active
and profiler_warmup, debug.deterministic_warn_only, activation_checkpoint.preserve_rng_state,
training.dtype, validation.dataloader, comm.save_traces_file_prefix,
model.print_after_conversion."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from torchtitan.components.optimizers.builder import build_optimizers
from torchtitan.components.optimizers.lr_schedule import build_lr_schedulers
from torchtitan.config import ConfigError, ConfigManager
from torchtitan.data.loader import build_dataloader
from torchtitan.data.tokenizers import ByteTokenizer
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.process import set_determinism
from torchtitan.recipe import cast_parameters
from torchtitan.tools.profiling import maybe_enable_profiling


def _config(*args: str):
    return ConfigManager().parse_args(list(args))


def _lrs(*args: str, steps: int) -> list[float]:
    config = _config(
        "--optimizer.lr",
        "1.0",
        "--optimizer.implementation",
        "for-loop",
        "--lr_scheduler.warmup_steps",
        "0",
        *args,
    )
    optimizers = build_optimizers([nn.Linear(2, 2)], config.optimizer, None)
    schedulers = build_lr_schedulers(optimizers, config.lr_scheduler, config.training.steps)
    seen = []
    for _ in range(steps):
        seen.append(optimizers.param_groups[0]["lr"])
        optimizers.step()
        schedulers.step()
    return seen


def test_total_steps_sets_the_schedule_length_apart_from_training_steps() -> None:
    long_schedule = _lrs("--training.steps", "4", "--lr_scheduler.total_steps", "8", steps=4)
    assert long_schedule == pytest.approx([1.0, 7 / 8, 6 / 8, 5 / 8])
    past_the_end = _lrs("--training.steps", "6", "--lr_scheduler.total_steps", "4", steps=6)
    assert past_the_end == pytest.approx([1.0, 3 / 4, 2 / 4, 1 / 4, 0.0, 0.0])
    assert _lrs("--training.steps", "4", steps=4) == pytest.approx([1.0, 3 / 4, 2 / 4, 1 / 4])


def _profiled_steps(tmp_path, warmup: int, active: int) -> list[int]:
    """The ProfilerStep numbers in the one trace a 4-step cycle writes."""
    config = _config(
        "--profiling.enable_profiling",
        "--profiling.profile_freq",
        "4",
        "--profiling.profiler_warmup",
        str(warmup),
        "--profiling.profiler_active",
        str(active),
        "--job.dump_folder",
        str(tmp_path),
    )
    with maybe_enable_profiling(config.profiling, config.job.dump_folder) as profiler:
        for _ in range(4):
            torch.ones(8).sum()
            profiler.step()
    (trace,) = (tmp_path / "profile_traces").rglob("rank0_trace.json")
    names = [event.get("name", "") for event in json.loads(trace.read_text())["traceEvents"]]
    return sorted({int(n.split("#")[1]) for n in names if n.startswith("ProfilerStep#")})


def test_profiler_records_profiler_active_steps_after_the_warmup(tmp_path) -> None:
    assert _profiled_steps(tmp_path / "a", warmup=1, active=2) == [2, 3]
    assert _profiled_steps(tmp_path / "b", warmup=3, active=1) == [3]


def test_a_profiler_cycle_longer_than_profile_freq_is_refused() -> None:
    with pytest.raises(
        ConfigError, match=r"^profiling.profile_freq \(4\) must be >= profiler_warmup"
    ):
        _config(
            "--profiling.enable_profiling",
            "--profiling.profile_freq",
            "4",
            "--profiling.profiler_active",
            "3",
        )


@pytest.mark.parametrize("warn_only", [True, False])
def test_deterministic_warn_only_reaches_torch(warn_only: bool) -> None:
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    saved_env = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    try:
        set_determinism(
            SimpleNamespace(pp_enabled=False), torch.device("cpu"), 0, True, warn_only=warn_only
        )
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled() is warn_only
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        if saved_env is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def _dropout_grad(preserve_rng_state: bool | None) -> torch.Tensor:
    """Gradient through a dropout block: without AC (None) or under full AC."""
    torch.manual_seed(0)
    blocks = nn.ModuleDict({"0": nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5))})
    if preserve_rng_state is not None:
        apply_ac(blocks, "full", "1", preserve_rng_state=preserve_rng_state)
    x = torch.ones(4, 16, requires_grad=True)
    blocks["0"](x).square().sum().backward()
    return x.grad


def test_preserve_rng_state_replays_dropout_in_the_recomputation() -> None:
    reference = _dropout_grad(None)
    assert torch.equal(_dropout_grad(True), reference)
    assert not torch.equal(_dropout_grad(False), reference)


def test_cast_parameters_keeps_buffers_and_ties() -> None:
    model = nn.Module()
    model.embed, model.out = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
    model.out.weight = model.embed.weight
    model.register_buffer("table", torch.ones(3))
    cast_parameters(model, torch.bfloat16)
    assert model.out.weight is model.embed.weight
    assert model.embed.weight.dtype == torch.bfloat16 and model.table.dtype == torch.float32


def test_bf16_training_with_another_compute_dtype_is_refused() -> None:
    _config("--training.dtype", "bfloat16")
    with pytest.raises(
        ConfigError,
        match=r"^training.mixed_precision_param='float32' with training.dtype='bfloat16'",
    ):
        _config("--training.dtype", "bfloat16", "--training.mixed_precision_param", "float32")


def test_validation_loader_uses_validation_dataloader_options(monkeypatch) -> None:
    from torchtitan.data import loader as dataloader

    requested = []
    built = dataloader.SequenceDataLoader.__init__

    def recording_init(self, *args, pin_memory: bool = False, **kwargs) -> None:
        requested.append(pin_memory)
        built(self, *args, pin_memory=pin_memory, **kwargs)

    monkeypatch.setattr(dataloader.SequenceDataLoader, "__init__", recording_init)
    config = _config(
        "--validation.seq_len",
        "16",
        "--training.seq_len",
        "16",
        "--validation.dataloader.pin_memory",
    )
    build_dataloader(config.validation, None, ByteTokenizer(), split="validation")
    build_dataloader(config.training, None, ByteTokenizer())
    assert requested == [True, False]


def test_flight_recorder_files_use_the_configured_prefix(tmp_path, monkeypatch) -> None:
    from torchtitan.distributed.process import _set_nccl_env

    monkeypatch.delenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", raising=False)
    config = _config("--job.dump_folder", str(tmp_path), "--comm.save_traces_file_prefix", "trace_")
    _set_nccl_env(config.comm, config.job.dump_folder)
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "comm_traces" / "trace_")
