"""Validation: the token-weighted mean loss over the validation split every ``validation.freq``
steps, logged to the console, TensorBoard and ``{dump_folder}/validation.jsonl``.

Every pass starts from the beginning of the split and reads the same global sequences under
any data-parallel layout (see ``torchtitan/data/packing.py``), so a layout changes the
validation loss only by rounding. Under context parallel each rank scores its share of every
sequence; under pipeline parallel the training schedule runs forward only and the last stage
scores the batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from torchtitan.components.metrics import MetricsProcessor
from torchtitan.data.loader import build_validation_dataloaders
from torchtitan.data.micro_batch import MicroBatch, model_inputs
from torchtitan.distributed import ParallelDims
from torchtitan.layers.loss import GlobalTokenMeanLoss, LossFn, valid_tokens
from torchtitan.tools.logging import logger

if TYPE_CHECKING:
    from torchtitan.config import ValidationConfig
    from torchtitan.protocols import BaseTokenizer

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]


@dataclass
class PipelineEval:
    """The trainer's pipeline schedule, run forward only (``schedule.eval``), and the
    schedule's loss, switched to a plain sum while validating."""

    schedule: Any
    has_first_stage: bool
    has_last_stage: bool
    loss: GlobalTokenMeanLoss


class Validator:
    """Runs the model parts over the validation loaders (one per source of a mixture, else
    one); see the module docstring. Reads the ``cp``, ``dp_cp`` and ``pp`` views of
    ``parallel_dims.world_mesh`` itself."""

    def __init__(
        self,
        *,
        dataloaders: dict[str, Iterable[Batch]],
        loss_fn: LossFn,
        train_context: Callable[[], AbstractContextManager],
        freq: int,
        steps: int,
        parallel_dims: ParallelDims,
        pipeline: PipelineEval | None = None,
        metrics_processor: MetricsProcessor | None = None,
        reset_positions: bool = False,
    ) -> None:
        self.dataloaders = dataloaders
        self.reset_positions = reset_positions
        self.loss_fn = loss_fn
        self.train_context = train_context
        self.freq = freq
        self.steps = steps
        self.parallel_dims = parallel_dims
        self.pipeline = pipeline
        self.metrics_processor = metrics_processor

    def should_validate(self, step: int) -> bool:
        return step % self.freq == 0

    def validate(self, model_parts: list[nn.Module], step: int) -> dict[str, float]:
        """One pass over the split (over each source's); returns the record logged for
        ``step``: the token-weighted mean loss, and with several sources each one's."""
        for part in model_parts:
            part.eval()
        try:
            totals = {
                name: self._loss_sum_and_tokens(model_parts, loader)
                for name, loader in self.dataloaders.items()
            }
        finally:
            for part in model_parts:
                _reshard(part)
                part.train()
        loss_sum = sum(loss for loss, _ in totals.values())
        tokens = sum(count for _, count in totals.values())
        loss = (loss_sum / tokens).item()
        record = {"step": step, "validation_loss": loss, "validation_perplexity": _perplexity(loss)}
        if len(totals) > 1:
            for name, (source_sum, source_tokens) in totals.items():
                record[f"validation_loss/{name}"] = (source_sum / source_tokens).item()
        self._log(record, int(tokens.item()))
        return record

    @torch.no_grad()
    def _loss_sum_and_tokens(
        self, model_parts: list[nn.Module], dataloader: Iterable[Batch]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, valid tokens), summed over the ranks that hold different data
        (``dp_cp``) and, under PP, brought from the last stage to every stage."""
        device = _buffer_device(model_parts[0])
        totals = torch.zeros(2, dtype=torch.float64, device=device)
        for index, (input_dict, labels) in enumerate(dataloader):
            if index == self.steps:
                break
            inputs, labels = input_dict["input"].to(device), labels.to(device)
            document_ids = input_dict.get("document_ids")
            batch = MicroBatch(
                inputs, labels, None if document_ids is None else document_ids.to(device)
            )
            inputs, labels, kwargs = model_inputs(batch, self.parallel_dims, self.reset_positions)
            with self.train_context():
                if self.pipeline is not None:
                    loss = self._pipeline_loss(inputs, labels, kwargs)
                else:
                    loss = self.loss_fn(model_parts[0](inputs, **kwargs), labels)
            if loss is None:  # a pipeline stage without the loss
                continue
            if isinstance(loss, DTensor):
                loss = loss.full_tensor()
            totals[0] += loss.double()
            totals[1] += valid_tokens(labels)
        for mesh in self._reduce_meshes():
            dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=mesh.get_group())
        if totals[1] == 0:
            raise ValueError(
                "validation.dataset: the validation split produced no batches with valid labels"
            )
        return totals[0], totals[1]

    def _reduce_meshes(self) -> list[DeviceMesh]:
        parallel_dims = self.parallel_dims
        names = (["dp_cp"] if parallel_dims.dp_cp_enabled else []) + (
            ["pp"] if parallel_dims.pp_enabled else []
        )
        return [parallel_dims.world_mesh[name] for name in names]

    def _pipeline_loss(
        self, inputs: torch.Tensor, labels: torch.Tensor, kwargs: dict[str, torch.Tensor]
    ) -> torch.Tensor | None:
        """The batch's summed loss on the last stage, else None."""
        pipeline = self.pipeline
        losses: list[torch.Tensor] = []
        targets = {"target": labels, "losses": losses} if pipeline.has_last_stage else {}
        args = (inputs,) if pipeline.has_first_stage else ()
        pipeline.loss.set_global_tokens(None)  # sum; the next training step sets its divisor
        pipeline.schedule.eval(
            *args, return_outputs=False, **targets, **kwargs
        )  # logits are not needed
        if not pipeline.has_last_stage:
            return None
        losses = [loss.full_tensor() if isinstance(loss, DTensor) else loss for loss in losses]
        return torch.stack(losses).sum()

    def _log(self, record: dict[str, float], tokens: int) -> None:
        step, loss, perplexity = (
            record["step"],
            record["validation_loss"],
            record["validation_perplexity"],
        )
        sources = "".join(
            f"  {key.removeprefix('validation_loss/')} {value:.4f}"
            for key, value in record.items()
            if key.startswith("validation_loss/")
        )
        logger.info(
            f"validation step {step}: loss {loss:.4f}  perplexity {perplexity:.4f}  "
            f"({tokens:,} tokens){sources}"
        )
        if self.metrics_processor is not None:
            self.metrics_processor.log_validation(record)


def _perplexity(loss: float) -> float:
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def _buffer_device(model: nn.Module) -> torch.device:
    """The compute device (parameters may be offloaded to the CPU; buffers never are)."""
    for tensor in model.buffers():
        return tensor.device
    return next(model.parameters()).device


def _reshard(model: nn.Module) -> None:
    """Free the parameters FSDP left unsharded (the root's, and every block's when
    reshard_after_forward is off): a forward without backward never reshards them."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def build_validator(
    *,
    validation: ValidationConfig,
    reset_positions: bool,
    parallel_dims: ParallelDims,
    tokenizer: BaseTokenizer,
    loss_fn: LossFn,
    train_context: Callable[[], AbstractContextManager],
    metrics_processor: MetricsProcessor | None = None,
    pipeline: PipelineEval | None = None,
) -> Validator:
    """The train spec's ``build_validator_fn``: the ``[validation]`` split scored every
    ``validation.freq`` steps (``reset_positions``: ``training.reset_position_ids_per_document``).
    Under PP it needs the trainer's schedule (``pipeline``)."""
    if parallel_dims.pp_enabled and pipeline is None:
        raise ValueError(
            "build_validator: pipeline parallel needs the trainer's schedule (pipeline=...)"
        )
    return Validator(
        dataloaders=build_validation_dataloaders(validation, parallel_dims, tokenizer),
        loss_fn=loss_fn,
        train_context=train_context,
        freq=validation.freq,
        steps=validation.steps,
        parallel_dims=parallel_dims,
        pipeline=pipeline if parallel_dims.pp_enabled else None,
        metrics_processor=metrics_processor,
        reset_positions=reset_positions,
    )
