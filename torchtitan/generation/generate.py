"""Autoregressive sampling: greedy (temperature 0) or temperature / top-k / top-p sampling
from a seeded generator, with or without a KV cache (both give the same tokens; the cache
context also carries Gated DeltaNet layers' recurrent state, ``kv_cache.RecurrentStateCache``).
The filters follow transformers' logits warpers, in their order: temperature, top-k, top-p."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.generation.kv_cache import kv_cache


def sample_next_token(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator,
    top_p: float = 1.0,
) -> torch.Tensor:
    """``[batch, vocab]`` logits -> ``[batch]`` token ids."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(filtered_logits(logits, temperature, top_k, top_p), dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def filtered_logits(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float
) -> torch.Tensor:
    """``logits`` (fp32) divided by ``temperature``, then -inf outside the ``top_k`` largest
    and outside the smallest set of tokens whose probability reaches ``top_p`` (the most
    likely token always stays)."""
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = logits.sort(dim=-1)
        below = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        below[:, -1] = False
        logits = logits.masked_fill(below.scatter(1, order, below), float("-inf"))
    return logits


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    seed: int = 0,
    stop_ids: Collection[int] = (),
    use_kv_cache: bool = True,
    stop_early: bool = True,
    length_multiple: int = 1,
) -> torch.Tensor:
    """Extend ``prompt`` (``[batch, seq]`` token ids) by up to ``max_new_tokens`` tokens.

    Returns ``[batch, seq + n]``; a row stops at the first of ``stop_ids`` it produces (EOS,
    an end-of-turn token; the rest of the row repeats it) and generation ends once every row
    has (unless ``stop_early`` is False: ranks whose forwards are collectives, FSDP's, must
    all run the same number). Without a KV cache each step re-runs the whole sequence through
    the model's training forward, right-padded to a multiple of ``length_multiple`` (sequence
    parallel splits the sequence over the tensor-parallel ranks; causal attention keeps the
    padding out of the positions read).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    generator = torch.Generator(device=prompt.device).manual_seed(seed)
    sampling = Sampling(
        temperature, top_k, top_p, generator, tuple(stop_ids), stop_early, length_multiple
    )
    if not use_kv_cache:
        return _decode(model, prompt, max_new_tokens, sampling, cached=False)
    with kv_cache(model, max_len=prompt.shape[1] + max_new_tokens):
        return _decode(model, prompt, max_new_tokens, sampling, cached=True)


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_k: int | None
    top_p: float
    generator: torch.Generator
    stop_ids: tuple[int, ...]
    stop_early: bool
    length_multiple: int


def _decode(
    model: nn.Module,
    tokens: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling,
    cached: bool,
) -> torch.Tensor:
    stops = torch.tensor(sampling.stop_ids, dtype=tokens.dtype, device=tokens.device)
    finished = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    repeat = torch.zeros_like(tokens[:, 0])
    cached_len = 0
    for _ in range(max_new_tokens):
        if cached:
            positions = torch.arange(cached_len, tokens.shape[1], device=tokens.device)
            logits = model(tokens[:, cached_len:], positions=positions)[:, -1]
            cached_len = tokens.shape[1]
        else:
            logits = _next_token_logits(model, tokens, sampling.length_multiple)
        next_token = sample_next_token(
            logits, sampling.temperature, sampling.top_k, sampling.generator, sampling.top_p
        )
        if sampling.stop_ids:
            next_token = torch.where(finished, repeat, next_token)
            stopped = torch.isin(next_token, stops) & ~finished
            repeat = torch.where(stopped, next_token, repeat)
            finished |= stopped
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        if sampling.stop_early and finished.all():
            break
    return tokens


def _next_token_logits(model: nn.Module, tokens: torch.Tensor, multiple: int) -> torch.Tensor:
    """The last position's logits from a forward of the whole (padded) sequence; gathered
    whole where tensor parallel leaves them sharded over the vocabulary (loss parallel)."""
    length = tokens.shape[1]
    logits = model(F.pad(tokens, (0, -length % multiple)))[:, length - 1]
    return logits.full_tensor() if isinstance(logits, DTensor) else logits
