"""Any causal LM of the installed transformers, built from its ``config.json`` and trained
like the native models.

``HFCausalLM`` holds transformers' own modules under their own names (``model.layers.0.
self_attn.q_proj.weight``, ``lm_head.weight``), so its state dict is the published
checkpoint's and transformers' code runs every block as it does in transformers. What we
change:

- attention: the model's attention implementation is ``"torchtitan"``, a function registered
  in transformers' attention registry that calls our attention seam (``layers/attention.py``):
  every attention module gets an ``AttentionKernel`` (``inner_attention``) for its mask (causal,
  ``block_causal`` from the batch's document ids, the layer's sliding window), and the mask
  is prepared once per forward. transformers' own mask building is registered away (it would
  build an ``[seq, seq]`` mask per forward that our kernels do not read).
- initialisation per FQN: each module's parameters are drawn by transformers'
  ``_init_weights`` on a full-size CPU copy of the module, from the global RNG seeded by
  ``(seed, module FQN)``, and each rank keeps its piece: every layout starts from the same
  weights. Buffers (RoPE inverse frequencies) are recomputed by ``_init_weights`` in place.
- the output: the forward returns the logits of ``lm_head`` (scaled and soft-capped as the
  config says), or the final hidden states when ``hidden_output`` is set (the chunked loss
  projects them itself; a model that soft-caps its logits needs them whole).
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Collection
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from torchtitan.config.errors import ConfigError
from torchtitan.layers.attention import AttentionKernel, MaskSpec, build_attention, prepare_mask
from torchtitan.layers.init import assign_full_, clean_fqn, init_param_, param_seed
from torchtitan.models.hf.args import ATTENTION, HFModelArgs, logit_multiplier
from torchtitan.tools.logging import logger


def titan_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    titan_mask: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature (``[batch, heads, seq, head_dim]`` in,
    ``[batch, seq, heads, head_dim]`` out) over the module's ``inner_attention``. The kernel
    masks from ``titan_mask`` (the forward's prepared mask) and its own spec; transformers'
    mask builder is registered away, so an ``attention_mask`` here is one the model computed
    itself, refused in one line. Attention dropout is not applied. Values and keys of
    different head sizes (multi-head latent attention) are zero-padded to the wider for the
    kernel (flash kernels and context parallel take one head size; zeros change neither the
    scores nor the output) and the output cut back."""
    if attention_mask is not None:
        raise ConfigError(
            f"model.hf_assets_path: {type(module).__name__} computes its own attention mask "
            "(as Doge's dynamic mask), which the hf backend's attention kernels do not apply; "
            "train this model with transformers' own loop"
        )
    del dropout, kwargs
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    value_dim, key_dim = value.shape[-1], key.shape[-1]
    if value_dim != key_dim:
        scaling = key_dim**-0.5 if scaling is None else scaling
        query, key, value = (_pad_heads(t, max(value_dim, key_dim)) for t in (query, key, value))
    out = module.inner_attention(
        query, key, value, mask=titan_mask, scale=scaling, sinks=getattr(module, "sinks", None)
    )
    return out[..., :value_dim].transpose(1, 2).contiguous(), None


def _pad_heads(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else nn.functional.pad(t, (0, width - t.shape[-1]))


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """transformers' mask builder for our attention: nothing (the kernels mask themselves)."""
    return None


def register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, titan_attention)
    AttentionMaskInterface.register(ATTENTION, _no_mask)


def is_attention(module: nn.Module) -> bool:
    """transformers' attention modules: an ``...Attention`` (or multi-head latent attention,
    ``...MLA``) class that knows its layer and calls the attention-function registry (a
    linear-attention mixer, MiniMax's lightning attention, mixes tokens itself)."""
    return (
        type(module).__name__.endswith(("Attention", "MLA"))
        and hasattr(module, "layer_idx")
        and "ALL_ATTENTION_FUNCTIONS" in _forward_source(type(module))
    )


@functools.cache
def _forward_source(cls: type[nn.Module]) -> str:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""


_WARNED: set[str] = set()


def _constructed(cls: type[nn.Module]) -> dict[str, torch.Tensor]:
    """The parameters and buffers a module of ``cls`` built with its default arguments holds
    (transformers builds activations so); none when the class needs arguments."""
    try:
        with torch.device("cpu"):
            fresh = cls()
    except TypeError:
        return {}
    return {
        **dict(fresh.named_parameters(recurse=False)),
        **dict(fresh.named_buffers(recurse=False)),
    }


@torch.no_grad()
def fill_unset(cls: type[nn.Module], tensors: dict[str, torch.Tensor], fqn: str) -> None:
    """``tensors`` of a module of ``cls`` that transformers' ``_init_weights`` left unset
    (still NaN: set only by the module's constructor, as Apertus's xIELU coefficients) take
    the values of a ``cls()`` built with its defaults, else zero with a warning: every
    layout starts alike either way."""
    unset = {n: t for n, t in tensors.items() if t.is_floating_point() and t.isnan().all()}
    if not unset:
        return
    constructed = _constructed(cls)
    for name, tensor in unset.items():
        value = constructed.get(name)
        if value is not None and value.shape == tensor.shape:
            tensor.copy_(value)
            continue
        tensor.zero_()
        if cls.__name__ not in _WARNED:
            _WARNED.add(cls.__name__)
            logger.warning(
                f"transformers' _init_weights leaves {fqn}.{name} ({cls.__name__}) unset: it "
                "starts at zero; load the model's weights (checkpoint.initial_load_path) to "
                "train from its own values"
            )


def shallow_copy(module: nn.Module) -> nn.Module:
    """A new module of ``module``'s own class sharing its attributes (``copy.copy`` cannot
    copy a module FSDP wraps: FSDP's class re-runs ``__init__`` on creation)."""
    cls = type(module)
    if isinstance(module, FSDPModule):
        cls = next(base for base in cls.__bases__ if base is not FSDPModule)
    twin = object.__new__(cls)
    twin.__dict__.update(module.__dict__)
    return twin


class LayerDict(nn.ModuleDict):
    """Decoder layers keyed ``"0" .. "n-1"`` (the FQNs of transformers' ``ModuleList``) that
    transformers' code slices, indexes and iterates as it does its list, and from which a
    pipeline stage deletes the layers it does not hold (the others keep their FQNs)."""

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            return list(self.values())[key]
        return super().__getitem__(str(key))

    def __iter__(self) -> Any:
        return iter(self.values())


def decoder_layers(base: nn.Module) -> LayerDict:
    """The decoder layers of a transformers base model (``layers``), as a ``LayerDict``."""
    layers = getattr(base, "layers", None)
    if isinstance(layers, nn.ModuleList):
        base.layers = layers = LayerDict({str(i): layer for i, layer in enumerate(layers)})
    if not isinstance(layers, LayerDict):
        raise ConfigError(
            f"model.hf_assets_path: {type(base).__name__} keeps no decoder layers in `layers`; "
            "the hf backend builds decoders laid out as transformers' Llama-like models"
        )
    return layers


FINAL_NORMS = ("norm", "final_layer_norm", "final_layernorm", "ln_f", "norm_f")
"""The names transformers' base models give their final norm."""


class HFCausalLM(nn.Module):
    """A transformers causal LM under its own FQNs (see the module docstring)."""

    def __init__(self, model_args: HFModelArgs) -> None:
        from transformers import AutoModelForCausalLM

        super().__init__()
        register_attention()
        self.model_args = model_args
        hf = AutoModelForCausalLM.from_config(model_args.hf_config)
        self._hf_init = hf._init_weights
        self.tied = bool(model_args.hf_config.get_text_config().tie_word_embeddings)
        self.base_prefix = hf.base_model_prefix
        self.add_module(self.base_prefix, hf.base_model)
        embedding = hf.get_input_embeddings()
        self.embedding_name = next(n for n, m in self.base.named_children() if m is embedding)
        self.norm_name = next(
            (n for n in FINAL_NORMS if isinstance(getattr(self.base, n, None), nn.Module)), None
        )
        self.lm_head: nn.Linear | None = hf.get_output_embeddings()
        self.hidden_output = False
        text = model_args.hf_config.get_text_config()
        self.logit_scale = logit_multiplier(text)
        self.logit_softcap: float | None = getattr(text, "final_logit_softcapping", None)
        self.needs_full_logits = (
            None
            if self.logit_softcap is None
            else f"soft-caps its logits (final_logit_softcapping {self.logit_softcap})"
        )
        decoder_layers(self.base)
        self._add_kernels(model_args)
        self.tie_embeddings()

    def fit_config_to_held_layers(self) -> None:
        """transformers' decoder loop picks each layer's mask and RoPE by the layer's place
        in the loop (``config.layer_types[i]``); a pipeline stage loops over its own layers
        only, so its base model reads a config listing just their types (the layers keep
        the whole config)."""
        config = self.base.config
        types = getattr(config, "layer_types", None)
        held = [int(key) for key in self.layers.keys()]
        if types is None or len(held) == len(types):
            return
        stage_config = copy.copy(config)
        stage_config.layer_types = [types[i] for i in held]
        self.base.config = stage_config

    def _add_kernels(self, args: HFModelArgs) -> None:
        for module in self.base.modules():
            if is_attention(module):
                window = getattr(module, "sliding_window", None) or args.sliding_window
                spec = MaskSpec(
                    block_causal=args.attn_mask_type == "block_causal", sliding_window=window
                )
                attn_type = args.attn_type if spec.causal_only else "flex"
                module.inner_attention = build_attention(attn_type, spec)

    @property
    def base(self) -> nn.Module:
        return getattr(self, self.base_prefix)

    @property
    def layers(self) -> LayerDict:
        return decoder_layers(self.base)

    # A pipeline stage sets these three to None (``distributed/pipeline.build_stage_module``):
    # without the embedding the stage takes hidden states, without the final norm it returns
    # them unnormalised, without the output it returns hidden states.
    @property
    def tok_embeddings(self) -> nn.Module | None:
        return getattr(self.base, self.embedding_name)

    @tok_embeddings.setter
    def tok_embeddings(self, value: None) -> None:
        self._check_pipeline_split()
        setattr(self.base, self.embedding_name, value)

    @property
    def norm(self) -> nn.Module | None:
        return None if self.norm_name is None else getattr(self.base, self.norm_name)

    @norm.setter
    def norm(self, value: None) -> None:
        self._check_pipeline_split()
        setattr(self.base, self.norm_name, nn.Identity() if value is None else value)

    def _check_pipeline_split(self) -> None:
        """A pipeline stage runs the base model's forward without the embedding or without the
        final norm: a base whose final norm has a name we do not know, applies it twice
        (nanochat: also before the layers; read from its forward's source), or runs another
        module with parameters beside its layers (DeepSeek V4's hyper-connection head) would
        be split wrong, so it is refused in one line."""
        base = type(self.base).__name__
        if self.norm_name is None:
            raise ConfigError(
                f"parallelism.pipeline_parallel_degree: {base} has no final norm under a name "
                f"the hf backend knows ({', '.join(FINAL_NORMS)}); leave the degree at 1"
            )
        if _forward_source(type(self.base)).count(f"self.{self.norm_name}(") > 1:
            raise ConfigError(
                f"parallelism.pipeline_parallel_degree: {base} applies its final norm "
                f"({self.norm_name}) also before the decoder layers, which a pipeline stage "
                "without it would skip; leave the degree at 1"
            )
        known = {self.embedding_name, "layers", self.norm_name}
        for name, child in self.base.named_children():
            if name not in known and any(True for _ in child.parameters()):
                raise ConfigError(
                    f"parallelism.pipeline_parallel_degree: {base} runs its {name} "
                    f"({type(child).__name__}) beside the decoder layers, which every pipeline "
                    "stage would repeat; leave the degree at 1"
                )

    @property
    def output(self) -> nn.Linear | None:
        """The output projection (the chunked loss binds it)."""
        return self.lm_head

    @output.setter
    def output(self, value: None) -> None:
        self.lm_head = value

    def tie_embeddings(self) -> None:
        """Point ``lm_head`` at the input embedding again when the config ties them (moving
        the model gives each module its own copy)."""
        if self.tied and self.lm_head is not None and self.tok_embeddings is not None:
            self.lm_head.weight = self.tok_embeddings.weight

    def _apply(self, fn: Any, recurse: bool = True) -> HFCausalLM:
        super()._apply(fn, recurse)
        self.tie_embeddings()
        return self

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``tokens`` ``[batch, seq]`` (hidden states ``[batch, seq, dim]`` in a pipeline
        stage without the embedding) -> logits ``[batch, seq, vocab]`` (hidden states with
        ``hidden_output`` or without the output); ``positions``: RoPE positions
        ``[batch, seq]`` or ``[seq]`` (restarting per document; this rank's under context
        parallel), else 0..seq-1; ``document_ids``: the packed documents (of the whole
        sequences), for ``block_causal``."""
        mask = prepare_mask(self.base, document_ids, tokens.device)
        if positions is not None and positions.ndim == 1:  # one row for every sequence (CP)
            positions = positions.unsqueeze(0)
        given = {"inputs_embeds" if tokens.is_floating_point() else "input_ids": tokens}
        out = self.base(**given, position_ids=positions, titan_mask=mask, use_cache=False)
        hidden = out.last_hidden_state
        if self.lm_head is None:
            return hidden
        if self.logit_scale != 1.0:  # on the hidden states, so the chunked loss projects them
            hidden = hidden * self.logit_scale
        if self.hidden_output:
            return hidden
        logits = self.lm_head(hidden)
        if self.logit_softcap is not None:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    def init_weights(self, seed: int, buffer_device: torch.device | None = None) -> None:
        """Recompute the buffers (RoPE frequencies) where they live, then every parameter
        from ``(seed, FQN)``."""
        del buffer_device  # buffers are recomputed on the device they were allocated on
        for prefix, module in self.named_modules():
            buffers = {name: b for name, b in module._buffers.items() if b is not None}
            if buffers and not isinstance(module, AttentionKernel):
                for buffer in buffers.values():
                    if buffer.is_floating_point():
                        buffer.fill_(torch.nan)
                self._hf_init(module)
                fill_unset(type(shallow_copy(module)), buffers, clean_fqn(prefix))
        self.init_parameters(seed)

    @torch.no_grad()
    def init_parameters(self, seed: int, fqns: Collection[str] | None = None) -> None:
        """Initialise the parameters named by ``fqns`` (all: None); parameters still on
        meta are skipped. Parameters whose module carries its own rule (``param_init_fns``:
        LoRA adapters) use it; the others transformers' ``_init_weights``."""
        for prefix, module in self.named_modules():
            own = {
                name: param
                for name, param in module.named_parameters(recurse=False)
                if not param.is_meta
                and (fqns is None or clean_fqn(f"{prefix}.{name}".lstrip(".")) in fqns)
            }
            if not own:
                continue
            rules = getattr(module, "param_init_fns", {})
            for name in [n for n in own if n in rules]:
                fqn = clean_fqn(f"{prefix}.{name}".lstrip("."))
                init_param_(own.pop(name), fqn, seed, rules[name])
            if own:
                self._init_like_transformers(module, clean_fqn(prefix), own, seed)

    def _init_like_transformers(
        self, module: nn.Module, fqn: str, params: dict[str, torch.Tensor], seed: int
    ) -> None:
        """``params`` of ``module`` as transformers' ``_init_weights`` draws them on a
        full-size fp32 CPU copy of the module, seeded by the module's FQN (what it leaves
        unset: ``fill_unset``)."""
        twin = shallow_copy(module)
        twin._modules = {}
        twin._parameters = {
            name: None if param is None else nn.Parameter(torch.full(param.shape, torch.nan))
            for name, param in module._parameters.items()
        }
        twin._buffers = {
            name: None if buffer is None else torch.empty(buffer.shape, dtype=buffer.dtype)
            for name, buffer in module._buffers.items()
        }
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(param_seed(seed, fqn))
            self._hf_init(twin)
        drawn = {name: twin._parameters[name].data for name in params}
        fill_unset(type(twin), drawn, fqn)
        for name, param in params.items():
            assign_full_(param, drawn[name].to(param.device))
