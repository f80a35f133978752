"""Parallelisms of ``HFCausalLM``: tensor parallel from transformers' own
``base_model_tp_plan`` (its styles as DTensor styles; the activations between blocks
replicated, no sequence parallel) or, where a model ships none, a plan derived from the
standard projection names, context parallel by replacing each attention module's
kernel (``inner_attention``) with the context-parallel one, expert parallel over the stacked
experts (``experts.py``), activation checkpointing and per-block compile of the decoder
layers, then FSDP/HSDP (the split experts over ``efsdp`` first, then each decoder layer), or
DDP."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtitan.components.adapters.lora import with_lora_styles
from torchtitan.config.errors import ConfigError
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.context_parallel.attention import apply_cp
from torchtitan.distributed.data_parallel import apply_ddp, apply_fsdp
from torchtitan.distributed.expert_parallel import apply_expert_fsdp
from torchtitan.layers.attention import AttentionKernel
from torchtitan.models.common.args import check_tp_divides_heads
from torchtitan.models.common.parallelize import fsdp_settings
from torchtitan.models.hf.experts import apply_ep
from torchtitan.models.hf.model import HFCausalLM, is_attention
from torchtitan.tools.compile import compile_blocks
from torchtitan.tools.logging import logger

if TYPE_CHECKING:
    from torchtitan.config import (
        ActivationCheckpointConfig,
        CompileConfig,
        ParallelismConfig,
        TrainingConfig,
    )


class MlaKvAProjection(ParallelStyle):
    """Multi-head latent attention's ``kv_a_proj_with_mqa`` (transformers' style
    ``mla_kv_a_proj``): a replicated linear whose output is the key/value latent and, in its
    last ``rope_dim`` channels, the rotary key every head shares. The latent reaches the
    colwise ``kv_b_proj``, whose replicated input gets its whole gradient back; the rotary
    key goes straight into attention, where each rank applies it to its own heads only, so
    its gradient is summed over the tp ranks."""

    def __init__(self, rope_dim: int) -> None:
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def outputs(module: nn.Module, out: DTensor, mesh: DeviceMesh) -> torch.Tensor:
            latent, rope = out.split([out.shape[-1] - self.rope_dim, self.rope_dim], dim=-1)
            return torch.cat([latent.to_local(), rope.to_local(grad_placements=[Partial()])], -1)

        _replicated(module, device_mesh, outputs)
        return module


class LocalParameters(ParallelStyle):
    """transformers' ``local_params``: the module's own parameters that the plan splits by
    name (attention sinks, a per-head gate bias: bare parameters no module hook reaches) are
    seen by its forward as this rank's pieces. The split DTensor stays the parameter (for the
    optimizer and checkpoints); autograd flows from each piece back to it."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def local_pieces(module: nn.Module, args: tuple) -> None:
            module._split_parameters = {
                name: p for name, p in module._parameters.items() if isinstance(p, DTensor)
            }
            for name, param in module._split_parameters.items():
                module._parameters[name] = param.to_local()

        def split_again(module: nn.Module, args: tuple, output: Any) -> None:
            module._parameters.update(module._split_parameters)

        module.register_forward_pre_hook(local_pieces)
        module.register_forward_hook(split_again)
        return module


STYLES: dict[str, Callable[[Any], ParallelStyle]] = {
    "colwise": lambda text: ColwiseParallel(),
    "rowwise": lambda text: RowwiseParallel(),
    "colwise_gather_output": lambda text: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda text: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda text: RowwiseParallel(
        input_layouts=Replicate(), output_layouts=Replicate()
    ),
    # a norm over the last dim of local heads: its input is declared sharded on a non-normalised
    # dim, so the replicated weight's gradient is summed over the tp ranks
    "replicated_with_grad_allreduce": lambda text: SequenceParallel(
        sequence_dim=1, use_local_output=True
    ),
    "mla_kv_a_proj": lambda text: MlaKvAProjection(text.qk_rope_head_dim),
    "local_params": lambda text: LocalParameters(),
    # transformers replicates heads over the ranks when they are fewer; the tp degree here
    # divides the key/value heads (check_tp_divides_heads), so each rank splits whole heads
    "unit_colwise": lambda text: ColwiseParallel(),
}
"""transformers' plan styles as DTensor styles, each made from the text config; a plan
naming another style on a module the model has refuses tensor parallel for the model."""


PROJECTIONS = {
    "q_proj": "colwise",
    "k_proj": "colwise",
    "v_proj": "colwise",
    "o_proj": "rowwise",
    "gate_proj": "colwise",
    "up_proj": "colwise",
    "down_proj": "rowwise",
}
"""The standard projection names of a decoder layer and their styles, for a model whose
config ships no plan."""


def derived_plan(model: HFCausalLM) -> dict[str, str]:
    """A plan from the standard projection names (``layers.*.self_attn.q_proj``: colwise,
    ...) when transformers ships none: every module of a decoder layer that holds parameters
    must be such a projection or one of the layer's own norms (which see the whole hidden
    state); anything else (a fused QKV, a norm between the projections, a wrapper) is refused
    in one line, since splitting around it would be silently wrong."""
    plan = {}
    for layer in model.layers.values():
        for name, module in layer.named_modules():
            if not any(True for _ in module.parameters(recurse=False)):
                continue
            if "." not in name and "Norm" in type(module).__name__:
                continue
            style = PROJECTIONS.get(name.rsplit(".", 1)[-1]) if type(module) is nn.Linear else None
            if style is None or "." not in name:
                raise ConfigError(
                    f"parallelism.tensor_parallel_degree: {type(model.base).__name__} ships no "
                    "tensor parallel plan (base_model_tp_plan) in transformers, and a plan from "
                    f"the standard projection names cannot split its {name} "
                    f"({type(module).__name__}); leave the degree at 1"
                )
            plan[f"layers.*.{name}"] = style
    return plan


def tp_plan(model: HFCausalLM) -> dict[str, ParallelStyle]:
    """The model's ``base_model_tp_plan`` (else :func:`derived_plan`) resolved to its
    modules' FQNs (under the base model), refused in one line where it names a style we do
    not apply. A tied model keeps its input embedding whole (replicated): the same weight is
    also ``lm_head``, which the plan does not split alike."""
    text = model.model_args.hf_config.get_text_config()
    plan = text.base_model_tp_plan or derived_plan(model)
    modules = dict(model.base.named_modules())
    if model.tied:
        modules = {n: m for n, m in modules.items() if not isinstance(m, nn.Embedding)}
    names = list(modules)
    styles: dict[str, ParallelStyle] = {}
    for pattern, style in plan.items():
        matched = fnmatch.filter(names, pattern.replace(".*.", ".*[0-9].")) or []
        if not matched:
            continue  # or a bare parameter (bare_parameters)
        if style not in STYLES:
            raise ConfigError(
                f"parallelism.tensor_parallel_degree: transformers' plan for {pattern} is "
                f"{style!r}, which the hf backend does not apply (it applies "
                f"{', '.join(STYLES)}); leave the degree at 1"
            )
        styles.update({name: STYLES[style](text) for name in matched})
    return styles


def bare_parameters(model: HFCausalLM) -> list[tuple[nn.Module, str]]:
    """(owner, name) of the parameters the plan splits by name rather than through a module
    (``layers.*.self_attn.sinks``: one value per head): split by heads like a colwise output,
    seen as local pieces in the owner's forward (its ``local_params`` style). Another style
    on a bare parameter is refused in one line."""
    text = model.model_args.hf_config.get_text_config()
    plan = text.base_model_tp_plan or {}
    modules = dict(model.base.named_modules())
    found = []
    for pattern, style in plan.items():
        owner_pattern, _, name = pattern.rpartition(".")
        owners = fnmatch.filter(modules, owner_pattern.replace(".*.", ".*[0-9]."))
        held = [modules[o] for o in owners if name in modules[o]._parameters]
        if held and style != "colwise":
            raise ConfigError(
                f"parallelism.tensor_parallel_degree: transformers' plan splits the parameter "
                f"{pattern} as {style!r}, which the hf backend does not apply to a bare "
                "parameter (it splits them by heads, colwise); leave the degree at 1"
            )
        found += [(module, name) for module in held]
    return found


def _split_bare_parameters(model: HFCausalLM, tp_mesh: DeviceMesh) -> None:
    for owner, name in bare_parameters(model):
        param = owner._parameters[name]
        split = distribute_tensor(param, tp_mesh, [Shard(0)], src_data_rank=None)
        owner.register_parameter(name, nn.Parameter(split, param.requires_grad))


HEAD_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads", "hidden_size")
"""The attention attributes some transformers models reshape by (``view(b, s, self.num_heads,
head_dim)``); models with a shipped plan reshape by ``-1``."""


def _local_head_counts(model: HFCausalLM, tp: int) -> None:
    """Under a derived plan, each attention module's head counts and width become its rank's
    share, so its reshapes see its local heads."""
    for module in model.layers.modules():
        if is_attention(module):
            for name in HEAD_COUNTS:
                if isinstance(getattr(module, name, None), int):
                    setattr(module, name, getattr(module, name) // tp)


def _replicated(
    module: nn.Module,
    mesh: DeviceMesh,
    local_outputs: Callable[[nn.Module, Any, DeviceMesh], Any] | None = None,
) -> None:
    """Make the module's own plain parameters replicated DTensors (the optimizer's fused and
    foreach steps need one tensor type); its inputs enter as replicated DTensors and its
    outputs leave as local tensors (``local_outputs`` where a part of them needs its
    gradient summed), so the code around it sees plain tensors."""

    def replicate_parameters(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                replicated = distribute_tensor(param, mesh, [Replicate()], src_data_rank=None)
                module.register_parameter(param_name, nn.Parameter(replicated, param.requires_grad))

    def inputs(module: nn.Module, args: tuple, mesh: DeviceMesh) -> tuple:
        return tuple(
            DTensor.from_local(a, mesh, [Replicate()], run_check=False)
            if isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
            else a
            for a in args
        )

    def outputs(module: nn.Module, out: Any, mesh: DeviceMesh) -> Any:
        if isinstance(out, tuple):  # e.g. a router (a linear) returning logits, weights, choices
            return tuple(o.to_local() if isinstance(o, DTensor) else o for o in out)
        return out.to_local() if isinstance(out, DTensor) else out

    distribute_module(module, mesh, replicate_parameters, inputs, local_outputs or outputs)


def _replicable(name: str, module: nn.Module) -> bool:
    """Modules whose parameters become replicated DTensors under tensor parallel: embeddings,
    linears and norms, but for a MoE router's (LongCat's router reads its classifier's weight
    in its own forward, past the hooks that would bring its input in as a DTensor). Others
    (a router, stacked experts) keep plain parameters, which every tp rank updates alike from
    the same replicated inputs."""
    if "router" in name.split("."):
        return False
    return isinstance(module, (nn.Embedding, nn.Linear)) or "Norm" in type(module).__name__


def apply_tp(model: HFCausalLM, tp_mesh: DeviceMesh) -> None:
    """transformers' plan (LoRA adapters placed as the split linear's, ``lora.py``), then
    every module whose own parameters the plan left plain (embedding, norms, output, an
    adapted ``lm_head`` with its adapters) replicated over the tp ranks; routers and experts
    stay plain."""
    text = model.model_args.hf_config.get_text_config()
    check_tp_divides_heads(
        tp_mesh.size(),
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
    )
    _split_bare_parameters(model, tp_mesh)
    parallelize_module(model.base, tp_mesh, with_lora_styles(model.base, tp_plan(model)))
    if not text.base_model_tp_plan:
        _local_head_counts(model, tp_mesh.size())
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if own and _replicable(name, module) and not any(isinstance(p, DTensor) for p in own):
            _replicated(module, tp_mesh)
    model.tie_embeddings()
    logger.info(f"applied transformers' tensor parallel plan over {tp_mesh.size()} ranks")


def check_context_parallel(model: HFCausalLM) -> None:
    """Context parallel splits the sequence at the attention kernels only: a decoder layer
    that mixes tokens without attention (a convolution, a linear-attention or state-space
    mixer) would see its piece of the sequence alone, so it is refused in one line."""
    for index, layer in model.layers.items():
        if not any(isinstance(m, AttentionKernel) for m in layer.modules()):
            raise ConfigError(
                f"parallelism.context_parallel_degree: decoder layer {index} "
                f"({type(layer).__name__}) mixes tokens without attention, which context "
                "parallel cannot split in the hf backend; leave the degree at 1"
            )


def parallelize_hf(
    model: HFCausalLM,
    parallel_dims: ParallelDims,
    *,
    training: TrainingConfig,
    parallelism: ParallelismConfig,
    activation_checkpoint: ActivationCheckpointConfig,
    compile_config: CompileConfig,
) -> HFCausalLM:
    model.fit_config_to_held_layers()
    if parallel_dims.tp_enabled:
        apply_tp(model, parallel_dims.world_mesh["tp"])
    if parallel_dims.cp_enabled:
        check_context_parallel(model)
        apply_cp(
            model,
            parallel_dims.world_mesh["cp"],
            parallel_dims.cp_rotate_method,
            parallel_dims.cp_load_balancer,
        )
    split_experts = []
    if parallel_dims.ep_enabled:
        split_experts = apply_ep(model, parallel_dims.world_mesh["ep"])
        logger.info(f"applied expert parallel over {parallel_dims.ep} ranks")
    ac = activation_checkpoint
    compiled = compile_config.enable and "model" in compile_config.components
    if compiled and ac.mode != "none":
        raise ConfigError(
            f"compile.enable with activation_checkpoint.mode {ac.mode!r}: torch.compile refuses "
            "transformers' decoder layers inside a checkpoint (a side effect on state outside "
            "it); for the hf backend use one of the two"
        )
    apply_ac(
        model.layers,
        ac.mode,
        ac.selective_ac_option,
        ac.preserve_rng_state,
        False,
        ac.memory_budget,
    )
    if compiled:
        compile_blocks(model.layers, compile_config.backend, prefix=f"{model.base_prefix}.layers")
    if parallel_dims.fsdp_enabled:
        settings = fsdp_settings(training, parallelism, parallel_dims)
        for experts in split_experts:
            apply_expert_fsdp(experts, parallel_dims, **settings)
        apply_fsdp(model, parallel_dims.fsdp_mesh, list(model.layers.values()), **settings)
    elif parallel_dims.dp_replicate_enabled:
        apply_ddp(model, parallel_dims.world_mesh["dp_replicate"])
    return model
