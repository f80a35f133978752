"""Per-step metrics: console line, ``{dump_folder}/metrics.jsonl``, TensorBoard and
Weights & Biases.

metrics.jsonl is written by the rank that owns the loss, whatever LOG_RANK says; every
tool and test that compares runs reads it (full-precision floats), never the console.
Weights & Biases gets the same scalars as TensorBoard, from the rank that owns the loss, in a
run whose config is the job config (project from ``WANDB_PROJECT``, default ``torchtitan``;
``WANDB_MODE=offline`` keeps it on disk under ``{dump_folder}/wandb``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchtitan.config.errors import ConfigError
from torchtitan.tools.logging import logger
from torchtitan.tools.peaks import PeakFlops, peak_flops, peak_memory_gib

if TYPE_CHECKING:
    from torchtitan.config import MetricsConfig
    from torchtitan.distributed import ParallelDims


class _Colors:
    def __init__(self, enabled: bool) -> None:
        codes = {"cyan": 36, "green": 32, "yellow": 33, "blue": 34, "magenta": 35, "red": 31}
        for name, code in codes.items():
            setattr(self, name, f"\033[{code}m" if enabled else "")
        self.reset = "\033[0m" if enabled else ""


@dataclass
class StepTimer:
    """Accumulates data-loading time and token counts between two log steps."""

    tokens: int = 0
    data_seconds: float = 0.0
    steps: int = 0
    start: float = field(default_factory=time.perf_counter)


class MetricsProcessor:
    """The ``[metrics]`` outputs of one rank. ``run_config``: the whole job config as plain
    data (a Weights & Biases run records it); ``description``: ``job.description``."""

    def __init__(
        self,
        metrics: MetricsConfig,
        *,
        dump_folder: str,
        total_steps: int,
        parallel_dims: ParallelDims,
        device: torch.device,
        flops_per_token: int,
        owns_loss: bool,
        compute_dtype: torch.dtype,
        run_config: dict[str, Any] | None = None,
        description: str = "",
    ) -> None:
        self.config = metrics
        self.parallel_dims = parallel_dims
        self.device = device
        self.flops_per_token = flops_per_token
        self.owns_loss = owns_loss
        self.total_steps = total_steps
        self.run_config = run_config or {}
        self.description = description
        self.colors = _Colors(not metrics.disable_color_printing and sys.stderr.isatty())
        self.peak = peak_flops(device, compute_dtype)
        logger.info(f"MFU against {_rate(self.peak.flops)}: {self.peak.source}")
        self.timer = StepTimer()
        self.total_tokens = 0
        self.run_start = time.perf_counter()
        dump = Path(dump_folder)
        self.jsonl_path = dump / "metrics.jsonl" if owns_loss else None
        self.jsonl = None
        self.validation_jsonl_started = False
        self.tb = self._build_tensorboard(dump)
        self.wandb = self._build_wandb(dump)

    def _build_wandb(self, dump: Path):
        if not self.config.enable_wandb or not self.owns_loss:
            return None
        import wandb

        dump.mkdir(parents=True, exist_ok=True)
        try:
            return wandb.init(
                project=os.environ.get("WANDB_PROJECT", "torchtitan"),
                dir=str(dump),
                config=self.run_config,
                notes=self.description or None,
            )
        except wandb.errors.Error as e:
            message = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(
                f"metrics.enable_wandb: wandb cannot start a run ({message}); "
                "run `wandb login` or set WANDB_MODE=offline"
            ) from None

    def _build_tensorboard(self, dump: Path):
        cfg = self.config
        if not cfg.enable_tensorboard or not (self.owns_loss or cfg.save_for_all_ranks):
            return None
        from torch.utils.tensorboard import SummaryWriter

        folder = dump / cfg.save_tb_folder / datetime.now().strftime("%Y%m%d-%H%M")
        if cfg.save_for_all_ranks:
            folder = folder / f"rank_{self.parallel_dims.world_mesh.get_rank()}"
        writer = SummaryWriter(str(folder))
        if self.description:
            writer.add_text("job/description", self.description)
        return writer

    def should_log(self, step: int) -> bool:
        return step == 1 or step % self.config.log_freq == 0

    def record_step(self, tokens: int, data_seconds: float) -> None:
        """Called every step with this rank's tokens and data-loading time (no syncs)."""
        self.timer.tokens += tokens
        self.timer.data_seconds += data_seconds
        self.timer.steps += 1

    def log(
        self,
        step: int,
        loss: float,
        loss_max: float,
        grad_norm: float,
        lr: float,
        extra: dict[str, float] | None = None,
    ) -> dict[str, Any]:
        # The next interval starts now, so it includes this call's own cost: the step times
        # of consecutive records add up to the wall-clock time of the loop.
        timer, self.timer = self.timer, StepTimer()
        elapsed = self.timer.start - timer.start
        tps = timer.tokens / elapsed / self.parallel_dims.non_data_parallel_size
        tflops = self.flops_per_token * tps / 1e12
        mfu = 100 * self._flops_fraction(self.flops_per_token * tps)
        self.total_tokens += timer.tokens * self.parallel_dims.dp_degree
        memory = peak_memory_gib(self.device)
        step_time = elapsed / max(timer.steps, 1)
        eta = step_time * (self.total_steps - step)
        record = {
            "step": step,
            "loss": loss,
            "loss_max": loss_max,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens": self.total_tokens,
            "tps": tps,
            "tflops": tflops,
            "mfu": mfu,
            "memory_gib": memory,
            "step_time": step_time,
            "data_time": timer.data_seconds / max(timer.steps, 1),
            **(extra or {}),
        }
        c = self.colors
        logger.info(
            f"{c.red}step: {step:>4}/{self.total_steps}  {c.green}loss: {loss:8.4f}  "
            f"{c.reset}grad_norm: {grad_norm:7.4f}  lr: {lr:.2e}  "
            f"{c.yellow}memory: {memory:5.2f}GiB  {c.blue}tps: {tps:,.0f}  "
            f"{c.cyan}tflops: {tflops:,.2f}  {c.magenta}mfu: {mfu:.2f}%  "
            f"{c.reset}data: {100 * record['data_time'] / max(step_time, 1e-9):.1f}%  "
            f"eta: {_format_seconds(eta)}{c.reset}"
        )
        if self.jsonl_path is not None:
            if self.jsonl is None:
                self.jsonl = _open_jsonl(self.jsonl_path, first_step=step)
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        self._log_scalars({key: value for key, value in record.items() if key != "step"}, step)
        return record

    def _flops_fraction(self, achieved: float) -> float:
        """``achieved`` FLOP/s as a fraction of the peak, never above 1: a rate above the
        peak means the peak was measured low (a busy CPU), so the highest rate achieved
        becomes the peak, with one warning."""
        if achieved > self.peak.flops:
            logger.warning(
                f"MFU: {_rate(achieved)} achieved exceeds the peak it divides by "
                f"({_rate(self.peak.flops)}, {self.peak.source}); the achieved rate is the peak "
                "from here on"
            )
            self.peak = PeakFlops(achieved, f"the highest rate achieved (above {self.peak.source})")
        return achieved / self.peak.flops

    def _log_scalars(self, scalars: dict[str, float], step: int) -> None:
        """To TensorBoard and Weights & Biases, where enabled."""
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def log_validation(self, record: dict[str, float]) -> None:
        """A validation pass's record: TensorBoard scalars under ``validation/`` and a line of
        ``validation.jsonl`` beside metrics.jsonl. Its first write of a run keeps only
        records of earlier steps (a resumed run continues the file, a fresh one starts it
        over), as metrics.jsonl does."""
        step = record["step"]
        sources = {
            f"validation/{key.removeprefix('validation_')}": value
            for key, value in record.items()
            if key.startswith("validation_loss/")
        }
        self._log_scalars(
            {
                "validation/loss": record["validation_loss"],
                "validation/perplexity": record["validation_perplexity"],
                **sources,
            },
            step,
        )
        if self.jsonl_path is None:
            return
        path = self.jsonl_path.parent / "validation.jsonl"
        with (
            open(path, "a") if self.validation_jsonl_started else _open_jsonl(path, first_step=step)
        ) as f:
            f.write(json.dumps(record) + "\n")
        self.validation_jsonl_started = True

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _open_jsonl(path: Path, first_step: int):
    """Open metrics.jsonl for appending, keeping only records of steps before
    ``first_step``: a resumed run continues the file without duplicating steps that the
    interrupted run logged after its last checkpoint; a fresh run starts it empty."""
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = []
    if path.exists() and first_step > 1:
        with open(path) as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] < first_step]
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w") as f:
        f.writelines(kept)
    tmp.replace(path)
    return open(path, "a")


def _rate(flops: float) -> str:
    return f"{flops / 1e12:,.2f} TFLOP/s" if flops >= 1e11 else f"{flops / 1e9:,.1f} GFLOP/s"


def _format_seconds(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"
