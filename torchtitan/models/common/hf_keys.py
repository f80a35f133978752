"""Hugging Face interop shared by the models' state-dict adapters.

:class:`DecoderStateDictAdapter` renames keys of decoders built on ``layers/decoder.py``:
``tok_embeddings``/``norm``/``output`` at the top, ``layers.N.<ours>`` <->
``model.layers.N.<theirs>`` by a per-model table, and routed experts held fused
(``moe.experts.w1`` ``[E, hidden, dim]``) <-> one tensor per expert
(``mlp.experts.{e}.gate_proj.weight``, the layout of published safetensors files and of
``save_pretrained``). ``from_hf`` also reads transformers' in-memory fused layout
(``mlp.experts.gate_up_proj`` ``[E, 2 * hidden, dim]``, ``mlp.experts.down_proj``). Adapters
work on partial state dicts (one pipeline stage's, one parameter's); tensors are full, not
sharded DTensors.

Also: the q/k row permutation between our interleaved RoPE layout and Hugging Face's
rotate-half one, the two spellings of RoPE settings in ``config.json``, and the field-by-field
comparison of a ``config.json`` with the model's flavor.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch

from torchtitan.protocols.state_dict_adapter import StateDictAdapter

TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
DENSE_BLOCK = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
GQA = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
ROUTER = {"moe.router.gate.weight": "mlp.gate.weight"}
_EXPERTS = {
    "moe.experts.w1": "gate_proj",
    "moe.experts.w2": "down_proj",
    "moe.experts.w3": "up_proj",
}
_TO_OURS_EXPERT = {hf: ours for ours, hf in _EXPERTS.items()}
_OURS_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_EXPERT_KEY = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


class DecoderStateDictAdapter(StateDictAdapter):
    """``to_hf``/``from_hf`` by key tables. Subclasses set ``family`` (for error messages)
    and ``per_layer`` (our key under ``layers.N.`` -> theirs under ``model.layers.N.``), and
    may name the tensors to permute for RoPE (:meth:`rope_heads`) or skip Hugging Face layers
    (:meth:`skips_hf_layer`). A key with no counterpart raises ``ValueError``, and so
    does an incomplete set of per-expert tensors."""

    family: str
    per_layer: dict[str, str]

    def rope_heads(self, key: str) -> int | None:
        """How many heads of ``model_args.head_dim`` channels the RoPE layout permutation
        reorders in block key ``key`` (after ``layers.N.``), or None: models whose Hugging Face
        counterpart rotates "half" channels (Llama, Qwen3) permute their q/k weights."""
        return None

    def value_to_hf(self, key: str, value: torch.Tensor) -> torch.Tensor:
        """Our tensor of block key ``key`` as Hugging Face stores it."""
        n_heads = self.rope_heads(key)
        if n_heads is None:
            return value
        check_rows(key, value, n_heads, self.model_args.head_dim)
        return interleaved_to_rotate_half(value, n_heads, self.model_args.head_dim)

    def value_from_hf(self, key: str, value: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`value_to_hf`."""
        n_heads = self.rope_heads(key)
        if n_heads is None:
            return value
        check_rows(key, value, n_heads, self.model_args.head_dim)
        return rotate_half_to_interleaved(value, n_heads, self.model_args.head_dim)

    def skips_hf_layer(self, layer: int) -> bool:
        """Whether a Hugging Face layer has no counterpart here and is ignored."""
        return False

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for key, value in state_dict.items():
            if key in TOP_LEVEL:
                out[TOP_LEVEL[key]] = value
                continue
            match = _OURS_LAYER_KEY.fullmatch(key)
            rest = match.group(2) if match else None
            if rest in _EXPERTS:
                prefix = f"model.layers.{match.group(1)}.mlp.experts"
                out.update(
                    {
                        f"{prefix}.{e}.{_EXPERTS[rest]}.weight": expert
                        for e, expert in enumerate(value.unbind(0))
                    }
                )
            elif rest in self.per_layer:
                out[f"model.layers.{match.group(1)}.{self.per_layer[rest]}"] = self.value_to_hf(
                    rest, value
                )
            else:
                raise ValueError(f"no Hugging Face counterpart for key {key!r}")
        return out

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        to_ours_top = {hf: ours for ours, hf in TOP_LEVEL.items()}
        to_ours_layer = {hf: ours for ours, hf in self.per_layer.items()}
        out = {}
        experts: dict[tuple[str, str], dict[int, torch.Tensor]] = defaultdict(dict)
        for hf_key, value in hf_state_dict.items():
            if hf_key in to_ours_top:
                out[to_ours_top[hf_key]] = value
                continue
            match = _HF_LAYER_KEY.fullmatch(hf_key)
            if match is None:
                raise ValueError(f"unknown Hugging Face {self.family} key {hf_key!r}")
            layer, rest = match.group(1), match.group(2)
            if self.skips_hf_layer(int(layer)):
                continue
            prefix = f"layers.{layer}."
            if expert := _HF_EXPERT_KEY.fullmatch(rest):
                experts[(layer, _TO_OURS_EXPERT[expert.group(2)])][int(expert.group(1))] = value
            elif rest == "mlp.experts.gate_up_proj":
                out[prefix + "moe.experts.w1"], out[prefix + "moe.experts.w3"] = value.chunk(
                    2, dim=1
                )
            elif rest == "mlp.experts.down_proj":
                out[prefix + "moe.experts.w2"] = value
            elif rest in to_ours_layer:
                ours = to_ours_layer[rest]
                out[prefix + ours] = self.value_from_hf(ours, value)
            else:
                raise ValueError(f"unknown Hugging Face {self.family} key {hf_key!r}")
        out.update(self._stack_experts(experts))
        return out

    def _stack_experts(
        self, experts: dict[tuple[str, str], dict[int, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        out = {}
        n = self.model_args.moe.num_experts if experts else 0
        for (layer, name), by_index in experts.items():
            if sorted(by_index) != list(range(n)):
                raise ValueError(
                    f"layer {layer}: expected experts 0..{n - 1} for {name}, got {sorted(by_index)}"
                )
            out[f"layers.{layer}.{name}"] = torch.stack([by_index[e] for e in range(n)])
        return out


# ---------------------------------------------------------------------------- RoPE layout
def interleaved_to_rotate_half(w: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Reorder each head's rows (or, for a 1-D per-channel weight of one head, entries)
    ``(0, 1, 2, 3, ...)`` -> ``(0, 2, 4, ..., 1, 3, 5, ...)``: our RoPE pairs ``(2i, 2i + 1)``
    become Hugging Face's ``(i, i + head_dim / 2)``. Pure re-indexing, so bit-exact."""
    return w.reshape(n_heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def rotate_half_to_interleaved(w: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Exact inverse of :func:`interleaved_to_rotate_half`."""
    return w.reshape(n_heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(w.shape)


def check_rows(key: str, value: torch.Tensor, n_heads: int, head_dim: int) -> None:
    expected = n_heads * head_dim
    if value.shape[0] != expected:
        raise ValueError(
            f"{key!r} has {value.shape[0]} rows, expected {n_heads} heads x {head_dim} = {expected}"
        )


# ---------------------------------------------------------------------------- config.json
def rope_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """Merge transformers 5.x ``rope_parameters`` and 4.x (and many published checkpoints')
    ``rope_theta``/``rope_scaling`` forms into one dict with ``rope_type``."""
    settings: dict[str, Any] = {"rope_theta": config.get("rope_theta", 10000.0)}
    settings.update(config.get("rope_scaling") or {})
    settings.update(config.get("rope_parameters") or {})
    settings.setdefault("rope_type", settings.get("type", "default"))
    return settings


def require(config: Mapping[str, Any], key: str) -> Any:
    """``config[key]``; a missing (or null) key is a ValueError naming it."""
    if config.get(key) is None:
        raise ValueError(f"config.json lacks {key!r}")
    return config[key]


def check_same_fields(theirs: Mapping[str, Any], ours: Mapping[str, Any]) -> None:
    """Raise ValueError listing every field of ``ours`` that ``theirs`` (from config.json)
    gives differently."""
    mismatches = [
        f"{name} = {theirs[name]} but model.flavor gives {ours[name]}"
        for name in ours
        if name in theirs and theirs[name] != ours[name]
    ]
    if mismatches:
        raise ValueError(
            f"config.json has {', '.join(mismatches)}; "
            "choose the flavor (or tokenizer) that matches"
        )
