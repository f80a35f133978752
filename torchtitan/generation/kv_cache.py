"""The generation caches: a KV cache that plugs into the attention seam
(``torchtitan/layers/attention.py``) and a recurrent state cache that plugs into Gated
DeltaNet's kernel seam (``torchtitan/layers/gated_deltanet.py``).

``kv_cache(model, max_len)`` swaps every local attention kernel of the model (SDPA or
FlexAttention) for a ``KVCacheAttention`` and every Gated DeltaNet kernel (exactly
``DeltaRule``, a mixer's ``inner_rule``) for a ``RecurrentStateCache``, and restores them on
exit. A prompt is one document: the KV cache applies the causal mask and the model's sliding
window, if any. The recurrent state cache keeps what a linear-attention layer needs to go on
from where the last call stopped: the convolution's last inputs and the delta rule's state, a
memory constant in the sequence length (where the KV cache grows with it, up to ``max_len``
or the window). The model's own forward runs unchanged (so tensor-parallel hooks and RoPE
apply as in training); the caller passes each call's absolute ``positions`` so that RoPE
rotates the new tokens at their place in the sequence.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.layers.attention import LOCAL_KERNELS, AttentionKernel, own_mask
from torchtitan.layers.blockwise_attention import visible
from torchtitan.layers.gated_deltanet import (
    DeltaRule,
    RecurrentSpec,
    causal_depthwise_conv,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)


class KVCacheAttention(AttentionKernel):
    """Causal attention over the keys/values seen since the cache was installed.

    Each call appends its ``k``/``v`` (``[batch, heads, seq, head_dim]``, heads already
    expanded from the KV heads by the model) and attends its queries to the cached positions
    up to their own. Without a sliding window the cache holds every position (buffers of
    ``max_len`` allocated on the first call, when the local head count, dtype and device are
    known); with a window ``w`` it keeps only the last ``w - 1`` positions, all a later query
    can see, so its memory is bounded by the window rather than the sequence.
    """

    def __init__(self, max_len: int, sliding_window: int | None = None) -> None:
        super().__init__()
        self.max_len = max_len
        self.sliding_window = sliding_window
        self.length = 0
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: Any = None,
        scale: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        start, end = self.length, self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(
                f"KV cache holds {self.max_len} positions; position {end - 1} does not fit"
            )
        keys, values = self._append(k, v, start, end)
        self.length = end
        first = end - keys.shape[2]  # the position of the first key held
        if sinks is not None:
            return _attention_with_sinks(
                q, keys, values, self._visible(start, end, first, q), scale, sinks
            )
        if q.shape[2] == 1 and (self.sliding_window is None or end <= self.sliding_window):
            return F.scaled_dot_product_attention(
                q, keys, values, scale=scale
            )  # sees every cached key
        visible_keys = self._visible(start, end, first, q)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible_keys, scale=scale)

    def _append(
        self, k: torch.Tensor, v: torch.Tensor, start: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys/values; return every key/value this call attends over."""
        if self.sliding_window is not None:
            keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
            values = v if self.values is None else torch.cat([self.values, v], dim=2)
            held = min(self.sliding_window - 1, keys.shape[2])
            self.keys = keys[:, :, keys.shape[2] - held :].clone()
            self.values = values[:, :, values.shape[2] - held :].clone()
            return keys, values
        if self.keys is None:
            batch, heads, _, head_dim = k.shape
            self.keys = k.new_empty(batch, heads, self.max_len, head_dim)
            self.values = v.new_empty(batch, heads, self.max_len, v.shape[-1])
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        return self.keys[:, :, :end], self.values[:, :, :end]

    def _visible(self, start: int, end: int, first: int, q: torch.Tensor) -> torch.Tensor:
        """``[new, held]``: which held keys (positions ``first .. end - 1``) each new query
        sees."""
        q_pos = torch.arange(start, end, device=q.device)[:, None]
        k_pos = torch.arange(first, end, device=q.device)[None, :]
        return visible(q_pos, k_pos, None, None, self.sliding_window)


def _attention_with_sinks(q, keys, values, seen, scale, sinks) -> torch.Tensor:
    """Softmax over the visible cached keys and one sink logit per head (whose value is
    zero). Few queries per call, so the ``[new, cached]`` scores are small."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q.float() @ keys.float().transpose(-2, -1) * scale).masked_fill(~seen, float("-inf"))
    sink = sinks.float()[None, :, None, None].expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return (probs @ values.float()).to(q.dtype)


class RecurrentStateCache(DeltaRule):
    """Gated DeltaNet's convolution and delta rule continued across calls: each call's tokens
    follow those of the calls before it, as if the whole sequence had run at once.

    Between calls it keeps the convolution's tail (the last ``K - 1`` inputs ``[batch, K - 1,
    channels]`` of the ``K``-tap convolution, zeros before the first call, as the training
    convolution pads) and the delta rule's state (``[batch, heads, k_dim, v_dim]``, fp32, none
    before the first call). Both have fixed shapes, so the memory is constant in the sequence
    length: the recurrent counterpart of the KV cache, which grows with it. A call of several
    tokens (the prompt) runs the chunked rule from the stored state; a single token runs the
    recurrent form (one state update), both in pure PyTorch on every device (not through
    fla's kernel, which ``DeltaRule`` uses on CUDA where installed). A prompt is one document:
    document ids are refused.
    """

    def __init__(self, chunk_size: int, spec: RecurrentSpec) -> None:
        super().__init__(chunk_size, spec)
        self.length = 0  # tokens seen
        self.conv_tail: torch.Tensor | None = None
        self.state: torch.Tensor | None = None

    def conv(self, x: torch.Tensor, weight: torch.Tensor, mask: Any = None) -> torch.Tensor:
        """The causal convolution of ``x`` ``[batch, seq, channels]`` preceded by the stored
        tail; keeps the last ``K - 1`` inputs as the next call's tail."""
        self._check_one_document(mask)
        width = weight.shape[-1] - 1
        tail = self.conv_tail
        if tail is None:
            tail = x.new_zeros(x.shape[0], width, x.shape[2])
        extended = torch.cat([tail, x], dim=1)
        self.conv_tail = extended[:, extended.shape[1] - width :].clone()
        return causal_depthwise_conv(extended, weight)[:, width:]

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        *,
        mask: Any = None,
    ) -> torch.Tensor:
        """The rule's output (fp32) for the new tokens ``[batch, heads, seq, ...]``, from the
        stored state; stores the state after them."""
        self._check_one_document(mask)
        if q.shape[2] == 1:
            out, state = recurrent_gated_delta_rule(q, k, v, g, beta, self.state)
        else:
            out, state = chunk_gated_delta_rule(
                q, k, v, g, beta, self.chunk_size, initial_state=self.state
            )
        self.state = state.float()
        self.length += q.shape[2]
        return out

    def _check_one_document(self, mask: Any) -> None:
        if own_mask(mask, self.spec) is not None:
            raise ValueError(
                "the recurrent state cache continues one document per row: generate "
                "without document_ids"
            )

    def extra_repr(self) -> str:
        return f"length={self.length}, {super().extra_repr()}"


Cache = KVCacheAttention | RecurrentStateCache


@contextmanager
def kv_cache(model: nn.Module, max_len: int) -> Iterator[list[Cache]]:
    """For the duration of the block, install a fresh ``KVCacheAttention`` of ``max_len``
    positions in place of every local attention kernel of ``model`` and a fresh
    ``RecurrentStateCache`` (constant memory, whatever ``max_len``) in place of every Gated
    DeltaNet ``DeltaRule``; yields the caches (the attention ones, then the recurrent ones,
    each in module order) and restores the original kernels on exit."""
    attention_sites = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, LOCAL_KERNELS)
    ]
    # exactly DeltaRule: a subclass (context parallel's, or a cache already installed) stays
    rule_sites = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is DeltaRule
    ]
    if not attention_sites and not rule_sites:
        raise ValueError(
            f"{type(model).__name__} has no local attention kernel or delta rule: the KV "
            "cache plugs into the attention seam of torchtitan/layers/attention.py and the "
            "recurrent state cache into Gated DeltaNet's DeltaRule"
        )
    caches: list[Cache] = [
        KVCacheAttention(max_len, child.spec.sliding_window) for _, _, child in attention_sites
    ]
    caches += [RecurrentStateCache(child.chunk_size, child.spec) for _, _, child in rule_sites]
    sites = attention_sites + rule_sites
    for (parent, name, _), cache in zip(sites, caches):
        setattr(parent, name, cache)
    try:
        yield caches
    finally:
        for parent, name, original in sites:
            setattr(parent, name, original)
