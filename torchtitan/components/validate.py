"""Validation: the token-weighted mean loss over the validation split every ``validation.freq``
steps, logged to the console, TensorBoard and ``{dump_folder}/validation.jsonl``.

Every pass starts from the beginning of the split and reads the same global sequences under
any data-parallel layout (see ``torchtitan/datasets/packing.py``), so a layout changes the
validation loss only by rounding.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from torchtitan.components.dataloader import build_dataloader
from torchtitan.components.loss import LossFn
from torchtitan.components.metrics import MetricsProcessor, _open_jsonl
from torchtitan.config import ConfigError
from torchtitan.tools.logging import logger

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]


class Validator:
    """Runs ``model_parts[0]`` over the validation loader; see the module docstring.

    ``loss_mesh`` (the ``dp_cp`` view, None in one process) sums loss x tokens and tokens
    over the ranks that hold different data.
    """

    def __init__(
        self,
        *,
        dataloader: Iterable[Batch],
        loss_fn: LossFn,
        train_context: Callable[[], AbstractContextManager],
        freq: int,
        steps: int,
        loss_mesh: Any | None = None,
        metrics_processor: MetricsProcessor | None = None,
    ) -> None:
        self.dataloader = dataloader
        self.loss_fn = loss_fn
        self.train_context = train_context
        self.freq = freq
        self.steps = steps
        self.loss_mesh = loss_mesh
        self.metrics_processor = metrics_processor
        self._jsonl_opened = False

    def should_validate(self, step: int) -> bool:
        return step % self.freq == 0

    def validate(self, model_parts: list[nn.Module], step: int) -> dict[str, float]:
        """One pass over the split; returns the record logged for ``step``."""
        model = model_parts[0]
        model.eval()
        try:
            loss_sum, tokens = self._loss_sum_and_tokens(model)
        finally:
            _reshard(model)
            model.train()
        loss = (loss_sum / tokens).item()
        record = {"step": step, "validation_loss": loss, "validation_perplexity": _perplexity(loss)}
        self._log(record, int(tokens.item()))
        return record

    @torch.no_grad()
    def _loss_sum_and_tokens(self, model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum over batches of mean loss x tokens, tokens), reduced over ``loss_mesh``."""
        device = next(model.parameters()).device
        totals = torch.zeros(2, dtype=torch.float64, device=device)
        for index, (input_dict, labels) in enumerate(self.dataloader):
            if index == self.steps:
                break
            inputs, labels = input_dict["input"].to(device), labels.to(device)
            with self.train_context():
                loss = self.loss_fn(model(inputs), labels)
            if isinstance(loss, DTensor):
                loss = loss.full_tensor()
            totals[0] += loss.double() * labels.numel()
            totals[1] += labels.numel()
        if self.loss_mesh is not None:
            dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.loss_mesh.get_group())
        if totals[1] == 0:
            raise ValueError("validation.dataset: the validation split produced no batches")
        return totals[0], totals[1]

    def _log(self, record: dict[str, float], tokens: int) -> None:
        step, loss, perplexity = record["step"], record["validation_loss"], record["validation_perplexity"]
        logger.info(f"validation step {step}: loss {loss:.4f}  perplexity {perplexity:.4f}  ({tokens:,} tokens)")
        processor = self.metrics_processor
        if processor is None:
            return
        if processor.tb is not None:
            processor.tb.add_scalar("validation/loss", loss, step)
            processor.tb.add_scalar("validation/perplexity", perplexity, step)
        if processor.jsonl_path is not None:
            self._append_jsonl(Path(processor.jsonl_path).parent / "validation.jsonl", record)

    def _append_jsonl(self, path: Path, record: dict[str, float]) -> None:
        """The first write of a run keeps only records of earlier steps (a resumed run
        continues the file, a fresh one starts it over), as metrics.jsonl does."""
        with (open(path, "a") if self._jsonl_opened else _open_jsonl(path, first_step=record["step"])) as f:
            f.write(json.dumps(record) + "\n")
        self._jsonl_opened = True


def _perplexity(loss: float) -> float:
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def _reshard(model: nn.Module) -> None:
    """Free the parameters FSDP left unsharded (the root's, and every block's when
    reshard_after_forward is off): a forward without backward never reshards them."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def build_validator(
    *,
    job_config,
    parallel_dims,
    tokenizer,
    loss_fn: LossFn,
    train_context: Callable[[], AbstractContextManager],
    metrics_processor: MetricsProcessor | None = None,
) -> Validator:
    """The train spec's ``build_validator_fn``: reads the ``dp`` (through the data loader)
    and ``dp_cp`` views of ``parallel_dims.world_mesh`` itself."""
    if parallel_dims.pp_enabled:
        raise ConfigError(
            "validation.enable: validation under pipeline parallel is not supported yet; "
            "disable validation or set parallelism.pipeline_parallel_degree = 1"
        )
    if parallel_dims.cp_enabled:
        raise ConfigError(
            "validation.enable: validation under context parallel is not supported yet; "
            "disable validation or set parallelism.context_parallel_degree = 1"
        )
    config = job_config.validation
    return Validator(
        dataloader=build_dataloader(job_config, parallel_dims, tokenizer, split="validation"),
        loss_fn=loss_fn,
        train_context=train_context,
        freq=config.freq,
        steps=config.steps,
        loss_mesh=parallel_dims.world_mesh["dp_cp"] if parallel_dims.dp_cp_enabled else None,
        metrics_processor=metrics_processor,
    )

