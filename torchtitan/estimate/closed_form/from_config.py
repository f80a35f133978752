"""The closed form's inputs for a configured run: the model's geometry, and the layout and the
run from the config's sections and what the trainer's checks built."""

from __future__ import annotations

import dataclasses

from torchtitan.components.adapters.lora import LORA, matches_target
from torchtitan.components.adapters.qlora import uses_nf4
from torchtitan.components.optimizers.muon import resolve_ns_dtype
from torchtitan.components.quantization import FLOAT8_LINEAR
from torchtitan.config import (
    ActivationCheckpointConfig,
    ConfigError,
    LoRAConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    TrainingConfig,
)
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import keeps_attention_output
from torchtitan.estimate.closed_form.inputs import Layout, LoRA, Run
from torchtitan.estimate.closed_form.shapes import dense_linears
from torchtitan.protocols.geometry import Geometry
from torchtitan.protocols.model import BaseModelArgs


def closed_form_inputs(
    model_args: BaseModelArgs,
    parallel_dims: ParallelDims,
    grad_accum: int,
    target: str,
    *,
    training: TrainingConfig,
    optimizer: OptimizerConfig,
    parallelism: ParallelismConfig,
    activation_checkpoint: ActivationCheckpointConfig,
    model: ModelConfig,
    lora: LoRAConfig,
) -> tuple[Geometry | None, Layout, Run]:
    """The analytic inputs of a configured run (geometry None: not a decoder the closed
    form knows)."""
    run = Run(
        seq_len=training.seq_len,
        local_batch=training.local_batch_size,
        grad_accum=grad_accum,
        param_bytes=4 if training.mixed_precision_param == "float32" else 2,
        foreach_optimizer=optimizer.implementation == "foreach",
        muon_ns_bytes=_muon_ns_bytes(optimizer, target),
        state_bytes=4 if optimizer.state_dtype == "float32" else 2,
        float8=any(name in FLOAT8_LINEAR for name in model.converters),
        loss_parallel=not parallelism.disable_loss_parallel,
        target=target,
        pp_microbatch=parallelism.pipeline_parallel_microbatch_size,
        pp_all_in_flight=parallelism.pipeline_parallel_schedule in ("GPipe", "LoopedBFS"),
        cp_rotate=parallel_dims.cp_rotate_method,
        cp_headtail=parallel_dims.cp_load_balancer == "headtail",
        ac_keeps_attention=keeps_attention_output(activation_checkpoint, parallel_dims.ring_cp),
    )
    geometry = model_args.geometry()
    if geometry is not None and LORA in model.converters:
        run = dataclasses.replace(run, lora=lora_adapters(lora, model.name, geometry))
    if run.lora is None or "output" not in run.lora.adapted:  # components/training_loss.py's choice
        run = dataclasses.replace(run, loss_chunk=training.loss_chunk_size)
    return geometry, _layout(parallel_dims, activation_checkpoint), run


def _layout(parallel_dims: ParallelDims, ac: ActivationCheckpointConfig) -> Layout:
    ac_mode = ac.mode if ac.mode != "selective" else f"selective:{ac.selective_ac_option}"
    return Layout(
        dp_replicate=parallel_dims.dp_replicate,
        dp_shard=parallel_dims.dp_shard,
        cp=parallel_dims.cp,
        tp=parallel_dims.tp,
        pp=parallel_dims.pp,
        ac=ac_mode,
        ep=parallel_dims.ep,
        etp=parallel_dims.etp,
    )


def _muon_ns_bytes(optimizer: OptimizerConfig, target: str) -> int:
    """Bytes per value of Muon's Newton-Schulz iteration on ``target`` (0: not Muon)."""
    if optimizer.name != "Muon":
        return 0
    return {"bfloat16": 2, "float32": 4}[resolve_ns_dtype(optimizer.muon.ns_dtype, target)]


_BLOCK_MODULE = {"wq": "attention", "wk": "attention", "wv": "attention", "wo": "attention"}


def lora_adapters(lora: LoRAConfig, model_name: str, g: Geometry) -> LoRA:
    """The linears that ``lora.target_modules`` adapts, matched as the converter matches them
    against this geometry's FQNs; ConfigError where the closed form cannot follow."""
    if g.experts is not None or g.mla is not None or g.delta_rule is not None:
        raise ConfigError(
            f"model.converters=['lora'] on {model_name!r}: the closed form covers "
            "LoRA on dense decoders only (no Gated DeltaNet); use --memory_estimation.mode estimate"
        )
    patterns = lora.target_modules

    def adapted_in(layer: int) -> frozenset[str]:
        return frozenset(
            name
            for name in dense_linears(g)
            if any(
                matches_target(
                    p, f"layers.{layer}.{_BLOCK_MODULE.get(name, 'feed_forward')}.{name}"
                )
                for p in patterns
            )
        )

    per_block = {adapted_in(layer) for layer in range(g.n_layers)}
    if len(per_block) > 1:
        raise ConfigError(
            "lora.target_modules: adapts different linears in different blocks, which the "
            "closed form does not model; use --memory_estimation.mode estimate"
        )
    output = {"output"} if any(matches_target(p, "output") for p in patterns) else set()
    return LoRA(lora.rank, per_block.pop() | output, uses_nf4(lora))
