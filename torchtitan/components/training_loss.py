"""Which training loss a run uses: the train spec's summed loss on the model's logits, or,
for a decoder whose output layer is a plain linear, the chunked linear cross-entropy
(``layers/loss.LinearCrossEntropy``): the decoder then returns its final hidden states and
the loss projects them a chunk of tokens at a time, so the full logits never exist. Either
is divided per step by the global batch's valid tokens (``GlobalTokenMeanLoss``)."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from torchtitan.components.adapters.lora_linear import has_lora
from torchtitan.config import CompileConfig, ConfigError, TrainingConfig
from torchtitan.layers.loss import (
    MIN_AUTO_CHUNK,
    GlobalTokenMeanLoss,
    LinearCrossEntropy,
    build_cross_entropy_loss,
)
from torchtitan.protocols import TrainSpec
from torchtitan.tools.compile import compile_loss
from torchtitan.tools.logging import logger


def _why_not_plain(model: nn.Module, output: nn.Module) -> str | None:
    """Why the chunked loss cannot project with this output layer's weight alone (a model
    may say why it needs its whole logits in ``needs_full_logits``)."""
    if has_lora(output):
        return "the output layer carries LoRA adapters (lora.target_modules selects it)"
    if type(output) is not nn.Linear:
        return (
            f"the output layer is a {type(output).__name__} (float8.filter_fqns keeps 'output' "
            "plain)"
        )
    if output.bias is not None:
        return "the output layer has a bias"
    reason = getattr(model, "needs_full_logits", None)
    return None if reason is None else f"the model {reason}"


def _full_logits(chunk: int, reason: str) -> None:
    """The full logits because of ``reason``: refused where the chunked loss was asked for."""
    if chunk > 0:
        raise ConfigError(
            f"training.loss_chunk_size={chunk}: {reason} (set training.loss_chunk_size = 0)"
        )
    logger.info(f"loss: on the full logits: {reason}")


def chunked_loss_for(
    training: TrainingConfig,
    spec: TrainSpec,
    model: nn.Module,
    device_type: str,
    tp: int,
    logits_for: str | None = None,
) -> LinearCrossEntropy | None:
    """The chunked loss when ``training.loss_chunk_size`` asks for it and the model allows it
    (then ``model.hidden_output`` is set); None for the full logits, which ``logits_for``
    (a loss that reads them, e.g. "DPO") always gets. Says which in one line."""
    chunk = training.loss_chunk_size
    if logits_for is not None:
        return _full_logits(
            chunk, f"{logits_for} reads each token's log-probability from the whole logits"
        )
    output = getattr(model, "output", None)
    if chunk == 0 or output is None or not hasattr(model, "hidden_output"):
        logger.info("loss: cross-entropy on the full logits (training.loss_chunk_size = 0)")
        return None
    if spec.build_loss_fn is not build_cross_entropy_loss:
        logger.info(f"loss: the train spec's own loss ({spec.name}) on the full logits")
        return None
    reason = _why_not_plain(model, output)
    if reason is not None:
        return _full_logits(chunk, f"{reason}; the chunked loss needs a plain linear output")
    if training.loss_kernel == "liger" and device_type != "cuda":
        raise ConfigError(
            f"training.loss_kernel='liger': Liger Kernel runs on CUDA, this run is on "
            f"{device_type!r}; use 'native'"
        )
    vocab, dim = output.weight.shape
    if training.loss_kernel == "liger":
        size = "Liger Kernel's fused kernel"
    elif chunk > 0:
        size = f"{chunk} tokens per chunk"
    else:
        size = (
            f"ceil(local vocabulary {vocab // tp} / dim {dim}) = {-(-vocab // tp // dim)} "
            f"chunks per micro-batch, each at least {MIN_AUTO_CHUNK} tokens"
        )
    logger.info(f"loss: chunked linear cross-entropy, {size}; the logits never exist whole")
    model.hidden_output = True
    return LinearCrossEntropy(chunk, training.loss_kernel)


def build_loss_fn(
    training: TrainingConfig,
    compile_config: CompileConfig,
    spec: TrainSpec,
    model: nn.Module,
    device_type: str,
    tp: int,
    logits_for: str | None = None,
) -> GlobalTokenMeanLoss:
    """The run's summed loss (the spec's compiled if asked; the chunked loss runs eager),
    divided per step by the global batch's valid tokens (``train_step`` sets the divisor).
    ``logits_for``: see ``chunked_loss_for``. Call :func:`bind_output` once the model is
    parallelized or split into stages."""
    chunked = chunked_loss_for(training, spec, model, device_type, tp, logits_for)
    if chunked is not None:
        return GlobalTokenMeanLoss(chunked)
    loss_fn = spec.build_loss_fn()
    if compile_config.enable and "loss" in compile_config.components:
        loss_fn = compile_loss(loss_fn, compile_config.backend)
    return GlobalTokenMeanLoss(loss_fn)


def bind_output(loss_fn: GlobalTokenMeanLoss, parts: Iterable[nn.Module]) -> None:
    """Point a chunked loss at the output layer of this rank's parts (the last pipeline
    stage's; ranks without it never compute the loss)."""
    if not isinstance(loss_fn.loss_sum, LinearCrossEntropy):
        return
    for part in parts:
        if getattr(part, "output", None) is not None:
            loss_fn.loss_sum.bind(part.output)
