"""Context parallelism for the Gated DeltaNet mixer (linear attention): the convolution's
tails and the delta rule's state travel between the ranks of the ``cp`` mesh.

Layout. Exactly that of the attention, :mod:`torchtitan.distributed.context_parallel.layout`
(:func:`chunk_ids`): a sequence of length ``S`` is cut into ``n`` chunks of ``L = S / n``
tokens, ``n = 2 * cp`` under ``"headtail"`` (rank ``r`` holds chunks ``r`` and ``2 * cp - 1 -
r``, in that order) and ``n = cp`` under ``"none"`` (rank ``r`` holds chunk ``r``). The kernel's
mask is the document ids of the whole sequences ``[batch, S]`` (the model passes them unsharded;
None without ``block_causal``); the tensors are the rank's shard (``S_local = S / cp``).

:class:`ContextParallelDeltaRule` replaces :class:`~torchtitan.layers.gated_deltanet.DeltaRule`
and computes exactly what it computes on the whole sequence (forward and backward):

- ``conv``: a chunk's causal convolution (kernel ``K``) reads the last ``K - 1`` inputs before
  the chunk, which another rank holds. Every rank all-gathers the last ``min(K - 1, L)`` rows
  of each of its chunks (:class:`AllGather`; its backward reduce-scatters the tails'
  gradients), then convolves ``cat(context, chunk)`` per chunk and drops the context's
  outputs. Positions before the sequence are zero; under document ids, earlier positions of
  another document are masked as on one device (global ids of the positions involved).
- ``forward``: the chunked gated delta rule carries a ``[batch, heads, k_dim, v_dim]`` fp32
  state from chunk to chunk, so the chunks form one chain ``0, 1, ..., n - 1``; under
  ``"headtail"`` it runs V-shaped over the ranks: ``0 -> 1 -> ... -> cp - 1`` (first chunks),
  then ``cp - 1 -> cp - 2 -> ... -> 0`` (second chunks; rank ``cp - 1`` hands over to itself).
  Each rank runs its chunks in chain order, each starting from the state received from the
  owner of the previous chunk (zeroed per sequence whose chunk starts a new document), and
  sends its final state point to point to the owner of the next chunk. The backward (one
  :class:`torch.autograd.Function`) walks the chain in reverse: per chunk it recomputes the
  forward from the saved received state, takes the gradients of (output, final state) given
  (the output's gradient, the final state's gradient received from the next chunk's owner)
  and sends the received state's gradient back to the previous chunk's owner. Only the
  received states (one per chunk) are kept between forward and backward, besides the inputs.

Communication per layer and step (``B`` batch, ``H`` value heads of this rank, ``C`` conv
channels of this rank, ``K`` conv kernel, ``b`` bytes per activation element, ``c`` chunks
per rank: 2 headtail, 1 none):

- the state hand-off, fp32: ``n - 1`` hops (``2 * cp - 1`` headtail, ``cp - 1`` none) of
  ``B * H * k_dim * v_dim * 4`` bytes in the forward and as many (its gradient) in the
  backward; the headtail hop ``cp - 1 -> cp`` stays on rank ``cp - 1``, so ``2 * cp - 2``
  messages cross ranks. With 32 value heads of ``k_dim = v_dim = 128`` a hop is 2 MiB per
  sequence.
- the convolution tails: one all-gather in which every rank contributes
  ``c * B * min(K - 1, L) * C * b`` bytes and receives ``cp - 1`` times that, and a
  reduce-scatter of the same size in the backward (with ``K = 4``, ``C = 8192`` and bf16:
  96 KiB per sequence and rank under headtail).

The conv weight's gradient is each rank's share, summed with the other weights' gradients by
the data-parallel reduction over the cp ranks.

The pipeline bubble. The chain is sequential: a chunk cannot start before the previous
chunk's state arrives, so at any moment one rank computes the delta rule and the others
wait. Under ``"headtail"`` each rank computes 2 of the ``2 * cp`` chunks, one after another
along the chain, and the whole chain takes ``2 * cp`` chunk-times: the delta rule runs about
``cp`` times slower than a perfectly parallel split would (the same wall time as one device
running the whole sequence, with ``1 / cp`` of its activation memory), in the forward and
again in the backward, which also recomputes each chunk's forward. Under ``"none"``
likewise: ``cp`` chunk-times for one chunk of work per rank (the delta rule costs the same
per token everywhere, so headtail balances nothing here; it only doubles the hops, and is
kept because the attention layers of the same model need it). The convolution and every
other part of the layer (projections, norms, gates) stay perfectly parallel. (Removing the
bubble would use the rule's linearity in the initial state: each chunk from a zero state
plus a ``[k_dim, k_dim]`` transition per chunk, a short scan over the states, and a
correction of every output; not done here.)

Every message is a ``dist.send`` / ``dist.recv`` on ``cp_mesh.get_group()`` (global ranks
through :func:`dist.get_global_rank`), written for gloo (CPU, tested) and NCCL (CUDA). Each
rank's sends and receives follow the chain's order (the reverse order in the backward), so
no rank waits on one that waits on it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.distributed.context_parallel.collectives import AllGather
from torchtitan.distributed.context_parallel.layout import chunk_ids, chunk_length, num_chunks
from torchtitan.layers.attention import own_mask
from torchtitan.layers.gated_deltanet import (
    DeltaRule,
    RecurrentSpec,
    causal_depthwise_conv,
    chunk_gated_delta_rule,
)


def _owners(cp: int, load_balancer: str) -> list[int]:
    """The cp rank holding each global chunk, by chunk id."""
    owners = [0] * num_chunks(cp, load_balancer)
    for rank in range(cp):
        for chunk in chunk_ids(cp, rank, load_balancer):
            owners[chunk] = rank
    return owners


def _check_docs(docs: torch.Tensor | None, local_len: int, cp: int) -> None:
    if docs is not None and docs.shape[1] != local_len * cp:
        raise ValueError(
            f"context-parallel delta rule needs the document ids of the whole sequences "
            f"([batch, {local_len * cp}] for {local_len} local tokens on cp {cp}); got "
            f"{tuple(docs.shape)}"
        )


class _Chain:
    """The chunks of one rank along the delta rule's chain, and its point-to-point hops."""

    def __init__(self, group: dist.ProcessGroup, load_balancer: str, local_len: int) -> None:
        self.group = group
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.load_balancer = load_balancer
        self.ids = chunk_ids(self.cp, self.rank, load_balancer)
        self.owners = _owners(self.cp, load_balancer)
        self.n = len(self.owners)
        self.size = chunk_length(local_len * self.cp, self.cp, load_balancer)

    def local_slice(self, chunk: int) -> slice:
        i = self.ids.index(chunk)
        return slice(i * self.size, (i + 1) * self.size)

    def global_slice(self, chunk: int) -> slice:
        return slice(chunk * self.size, (chunk + 1) * self.size)

    def send(self, x: torch.Tensor, chunk: int) -> None:
        dst = dist.get_global_rank(self.group, self.owners[chunk])
        dist.send(x.contiguous(), dst=dst, group=self.group)

    def recv(self, like: torch.Tensor, chunk: int) -> torch.Tensor:
        out = torch.empty_like(like, memory_format=torch.contiguous_format)
        dist.recv(out, src=dist.get_global_rank(self.group, self.owners[chunk]), group=self.group)
        return out


def _starts_document(docs: torch.Tensor | None, chain: _Chain, chunk: int) -> torch.Tensor | None:
    """``[batch, 1, 1, 1]`` fp32: 0 where the chunk's first token starts a new document (the
    received state must not reach it), 1 elsewhere; None without document ids."""
    if docs is None or chunk == 0:
        return None
    start = chunk * chain.size
    keep = (docs[:, start] == docs[:, start - 1]).float()
    return keep[:, None, None, None]


def _run_chunk(inputs, state, keep, docs, chain: _Chain, chunk: int, rule_chunk: int):
    """(output, final state) of one chunk from the received ``state``."""
    initial = state if keep is None else state * keep
    chunk_docs = None if docs is None else docs[:, chain.global_slice(chunk)]
    return chunk_gated_delta_rule(
        *inputs, rule_chunk, document_ids=chunk_docs, initial_state=initial
    )


class _DeltaRuleChain(torch.autograd.Function):
    """The gated delta rule over cp-sharded sequences (see the module docstring): the state
    is handed from chunk to chunk along the chain, its gradient back along it."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, docs, group, load_balancer, rule_chunk):
        chain = _Chain(group, load_balancer, q.shape[2])
        batch, heads, _, k_dim = k.shape
        zero = q.new_zeros(batch, heads, k_dim, v.shape[-1], dtype=torch.float32)
        received: dict[int, torch.Tensor] = {}
        outs: dict[int, torch.Tensor] = {}
        carried = zero
        for chunk in sorted(chain.ids):  # chain order
            if chunk == 0:
                state = zero
            elif chain.owners[chunk - 1] == chain.rank:
                state = carried
            else:
                state = chain.recv(zero, chunk - 1)
            received[chunk] = state
            sl = chain.local_slice(chunk)
            inputs = [t[:, :, sl] for t in (q, k, v, g, beta)]
            keep = _starts_document(docs, chain, chunk)
            outs[chunk], final = _run_chunk(inputs, state, keep, docs, chain, chunk, rule_chunk)
            if chunk + 1 < chain.n:
                if chain.owners[chunk + 1] == chain.rank:
                    carried = final
                else:
                    chain.send(final, chunk + 1)
        ctx.save_for_backward(q, k, v, g, beta, docs, *(received[c] for c in chain.ids))
        ctx.layout = group, load_balancer, rule_chunk
        device = q.device.type
        ctx.autocast = (
            device,
            torch.is_autocast_enabled(device),
            torch.get_autocast_dtype(device),
        )
        return torch.cat([outs[c] for c in chain.ids], dim=2)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, g, beta, docs, *states = ctx.saved_tensors
        group, load_balancer, rule_chunk = ctx.layout
        chain = _Chain(group, load_balancer, q.shape[2])
        received = dict(zip(chain.ids, states))
        zero = states[0].new_zeros(states[0].shape)
        grads: dict[int, list[torch.Tensor | None]] = {}
        carried = zero
        device, autocast_on, autocast_dtype = ctx.autocast
        for chunk in sorted(chain.ids, reverse=True):  # the chain backwards
            if chunk == chain.n - 1:
                d_final = zero
            elif chain.owners[chunk + 1] == chain.rank:
                d_final = carried
            else:
                d_final = chain.recv(zero, chunk + 1)
            sl = chain.local_slice(chunk)
            inputs = [t[:, :, sl].detach().requires_grad_() for t in (q, k, v, g, beta)]
            state = received[chunk].detach().requires_grad_(chunk > 0)
            keep = _starts_document(docs, chain, chunk)
            with (
                torch.enable_grad(),
                torch.autocast(device, dtype=autocast_dtype, enabled=autocast_on),
            ):
                out, final = _run_chunk(inputs, state, keep, docs, chain, chunk, rule_chunk)
            wrt = inputs + ([state] if chunk > 0 else [])
            got = torch.autograd.grad(
                (out, final), wrt, (grad_out[:, :, sl], d_final), allow_unused=True
            )
            grads[chunk] = [torch.zeros_like(x) if d is None else d for x, d in zip(wrt, got)]
            if chunk > 0:
                d_state = grads[chunk].pop()
                if chain.owners[chunk - 1] == chain.rank:
                    carried = d_state
                else:
                    chain.send(d_state, chunk - 1)
        full = [torch.cat([grads[c][i] for c in chain.ids], dim=2) for i in range(5)]
        needed = ctx.needs_input_grad
        return (*(d if needed[i] else None for i, d in enumerate(full)), None, None, None, None)


def _conv_contexts(x: torch.Tensor, kernel: int, chain: _Chain) -> dict[int, torch.Tensor]:
    """Per local chunk, the ``kernel - 1`` conv inputs before it (``[batch, kernel - 1,
    channels]``, zeros before the sequence), from every rank's chunk tails."""
    width = kernel - 1
    rows = min(width, chain.size)  # the tail kept of every chunk
    local = torch.cat([x[:, chain.local_slice(c)][:, chain.size - rows :] for c in chain.ids], 1)
    gathered = AllGather.apply(local, chain.group)  # [cp, batch, chunks per rank * rows, C]
    pieces = {}
    for rank in range(chain.cp):
        for i, chunk in enumerate(chunk_ids(chain.cp, rank, chain.load_balancer)):
            pieces[chunk] = gathered[rank, :, i * rows : (i + 1) * rows]
    stream = torch.cat([pieces[c] for c in range(chain.n)], dim=1)  # tails in global order
    contexts = {}
    for chunk in chain.ids:
        start = chunk * chain.size
        positions = [p for p in range(start - width, start) if p >= 0]
        # a tail row's place in the stream: its chunk's tail, then its offset in that tail
        index = [(p // chain.size) * rows + p % chain.size - (chain.size - rows) for p in positions]
        context = stream[:, index]
        contexts[chunk] = F.pad(context, (0, 0, width - len(positions), 0))
    return contexts


class ContextParallelDeltaRule(DeltaRule):
    """:class:`DeltaRule` over sequences sharded across ``cp_mesh`` (see the module
    docstring): ``conv`` and ``forward`` take this rank's shard (cut by
    :func:`~torchtitan.distributed.context_parallel.attention.cp_shard` with the same
    ``load_balancer``) and return this rank's shard of the result; the mask is the document
    ids of the whole sequences (None without ``block_causal``)."""

    def __init__(
        self,
        cp_mesh: DeviceMesh,
        load_balancer: str,
        chunk_size: int,
        spec: RecurrentSpec,
    ) -> None:
        super().__init__(chunk_size, spec)
        num_chunks(cp_mesh.size(), load_balancer)  # validates the name
        self.cp_mesh = cp_mesh
        self.load_balancer = load_balancer

    def conv(self, x: torch.Tensor, weight: torch.Tensor, mask: Any = None) -> torch.Tensor:
        docs = own_mask(mask, self.spec)
        _check_docs(docs, x.shape[1], self.cp_mesh.size())
        chain = _Chain(self.cp_mesh.get_group(), self.load_balancer, x.shape[1])
        kernel = weight.shape[-1]
        if kernel == 1:
            return causal_depthwise_conv(x, weight)
        width = kernel - 1
        contexts = _conv_contexts(x, kernel, chain)
        outs = []
        for chunk in chain.ids:
            extended = torch.cat([contexts[chunk], x[:, chain.local_slice(chunk)]], dim=1)
            ext_docs = None
            if docs is not None:
                start = chunk * chain.size
                positions = torch.arange(start - width, start + chain.size, device=docs.device)
                # positions before the sequence hold zeros: any document id will do
                ext_docs = docs[:, positions.clamp(min=0)]
            outs.append(causal_depthwise_conv(extended, weight, ext_docs)[:, width:])
        return torch.cat(outs, dim=1)

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
        docs = own_mask(mask, self.spec)
        _check_docs(docs, q.shape[2], self.cp_mesh.size())
        return _DeltaRuleChain.apply(
            q, k, v, g, beta, docs, self.cp_mesh.get_group(), self.load_balancer, self.chunk_size
        )

    def extra_repr(self) -> str:
        return (
            f"cp={self.cp_mesh.size()}, load_balancer={self.load_balancer!r}, "
            f"{super().extra_repr()}"
        )


def apply_cp_to_delta_rules(model: nn.Module, cp_mesh: DeviceMesh, load_balancer: str) -> int:
    """Replace every ``inner_rule`` :class:`DeltaRule` in ``model`` (exactly that class: one
    already context parallel stays) with a :class:`ContextParallelDeltaRule` of the same
    chunk size and mask; returns how many were replaced. The attention layers are
    :func:`~torchtitan.distributed.context_parallel.attention.apply_cp`'s."""
    owners = [m for m in model.modules() if type(getattr(m, "inner_rule", None)) is DeltaRule]
    for owner in owners:
        rule = owner.inner_rule
        owner.inner_rule = ContextParallelDeltaRule(
            cp_mesh, load_balancer, rule.chunk_size, rule.spec
        )
    return len(owners)
