"""Autoregressive sampling: greedy (temperature 0) or temperature / top-k sampling from a
seeded generator, with or without a KV cache (both give the same tokens; the cache context
also carries Gated DeltaNet layers' recurrent state, ``kv_cache.RecurrentStateCache``)."""

from __future__ import annotations

import torch
from torch import nn

from torchtitan.generation.kv_cache import kv_cache


def sample_next_token(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator
) -> torch.Tensor:
    """``[batch, vocab]`` logits -> ``[batch]`` token ids."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
    eos_id: int | None = None,
    use_kv_cache: bool = True,
) -> torch.Tensor:
    """Extend ``prompt`` (``[batch, seq]`` token ids) by up to ``max_new_tokens`` tokens.

    Returns ``[batch, seq + n]``; generation stops early once every row has produced
    ``eos_id`` (rows that finished earlier are padded with it). Without a KV cache each step
    re-runs the whole sequence through the model's training forward.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    generator = torch.Generator(device=prompt.device).manual_seed(seed)
    if not use_kv_cache:
        return _decode(
            model, prompt, max_new_tokens, temperature, top_k, generator, eos_id, cached=False
        )
    with kv_cache(model, max_len=prompt.shape[1] + max_new_tokens):
        return _decode(
            model, prompt, max_new_tokens, temperature, top_k, generator, eos_id, cached=True
        )


def _decode(
    model: nn.Module,
    tokens: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator,
    eos_id: int | None,
    cached: bool,
) -> torch.Tensor:
    finished = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    cached_len = 0
    for _ in range(max_new_tokens):
        if cached:
            positions = torch.arange(cached_len, tokens.shape[1], device=tokens.device)
            logits = model(tokens[:, cached_len:], positions=positions)[:, -1]
            cached_len = tokens.shape[1]
        else:
            logits = model(tokens)[:, -1]
        next_token = sample_next_token(logits, temperature, top_k, generator)
        if eos_id is not None:
            next_token = next_token.masked_fill(finished, eos_id)
            finished |= next_token == eos_id
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        if finished.all():
            break
    return tokens
