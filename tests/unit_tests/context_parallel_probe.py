"""Run by test_context_parallel.py under torchrun (4 ranks, gloo). Compares every CP attention
configuration (cp 2 and 4) with unsharded SDPA (causal, and document / window masks as a
dense bool mask), and a small Llama 3 with ``apply_cp`` (alone, and after TP 2 x CP 2; causal
and block-causal) with the same model unsharded; writes the errors to
``{OUT_DIR}/rank{r}.json``."""

from __future__ import annotations

import copy
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from torchtitan.distributed.context_parallel.attention import ContextParallelAttention, apply_cp
from torchtitan.distributed.context_parallel.layout import (
    cp_shard,
    shard_batch_for_cp,
    to_global_order,
)
from torchtitan.distributed.process import exit_skipping_static_destructors, leave_together
from torchtitan.layers.attention import MaskSpec
from torchtitan.layers.blockwise_attention import visible
from torchtitan.layers.loss import cross_entropy_loss
from torchtitan.models.common.parallelize import apply_tp
from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.models.llama3.model import Transformer

METHODS = ("allgather", "alltoall", "ulysses")
BALANCERS = ("headtail", "none")


def cp_unshard(
    local: torch.Tensor, seq_dim: int, cp_mesh: DeviceMesh, load_balancer: str = "headtail"
) -> torch.Tensor:
    """Inverse of :func:`cp_shard` (no autograd): the full tensor on every cp rank."""
    shards = [torch.empty_like(local) for _ in range(cp_mesh.size())]
    dist.all_gather(shards, local.contiguous(), group=cp_mesh.get_group())
    return to_global_order(shards, seq_dim, load_balancer)


def shapes_for(method: str) -> list[tuple[tuple[int, int, int, int], float | None]]:
    """([B, H, S, D], softmax scale); S = 24 and 40 give odd chunk sizes (3 and 5) at cp 4
    headtail."""
    if method == "ulysses":  # heads divisible by cp
        return [((2, 4, 24, 8), None), ((1, 8, 40, 5), 0.3)]
    return [((2, 3, 24, 8), None), ((1, 5, 40, 5), 0.3)]


def attention_errors(
    cp_mesh: DeviceMesh,
    method: str,
    shard_balancer: str,
    attn_balancer: str,
    shape: tuple[int, ...],
    scale: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, float]:
    """Max |CP - reference| of the output and dq, dk, dv on this rank's shard."""
    gen = torch.Generator().manual_seed(sum(shape))
    q, k, v, dout = (torch.randn(shape, generator=gen).to(dtype) for _ in range(4))
    ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref_out = F.scaled_dot_product_attention(*ref, is_causal=True, scale=scale)
    ref_out.backward(dout.float())

    def shard(t: torch.Tensor) -> torch.Tensor:
        return cp_shard(t, 2, cp_mesh, shard_balancer)

    local = [shard(t).requires_grad_() for t in (q, k, v)]
    out = ContextParallelAttention(cp_mesh, method, attn_balancer)(*local, scale=scale)
    out.backward(shard(dout))
    assert all(type(t.grad) is torch.Tensor for t in local), "grads must be plain tensors"
    full_out = cp_unshard(out.detach(), 2, cp_mesh, shard_balancer)
    pairs = {"out": (out, ref_out), "unshard": (full_out, ref_out)}
    pairs.update({f"d{n}": (t.grad, r.grad) for n, t, r in zip("qkv", local, ref)})
    return {
        name: (a.float() - (b if name == "unshard" else shard(b))).abs().max().item()
        for name, (a, b) in pairs.items()
    }


def attention_cases(meshes: dict[int, DeviceMesh]) -> list[dict]:
    results = []
    for cp, mesh in meshes.items():
        for method in METHODS:
            for balancer in BALANCERS:
                for shape, scale in shapes_for(method):
                    errs = attention_errors(mesh, method, balancer, balancer, shape, scale)
                    results.append(
                        dict(
                            kind="attention",
                            cp=cp,
                            method=method,
                            balancer=balancer,
                            shape=shape,
                            errors=errs,
                        )
                    )
            # bf16 inputs (fp32 block math inside, bf16 in and out), loose tolerance.
            errs = attention_errors(
                mesh, method, "headtail", "headtail", (2, 4, 24, 8), dtype=torch.bfloat16
            )
            results.append(
                dict(kind="attention_bf16", cp=cp, method=method, balancer="headtail", errors=errs)
            )
            # Negative control: attention told the wrong layout must not match.
            errs = attention_errors(mesh, method, "headtail", "none", (2, 4, 24, 8))
            results.append(dict(kind="attention_wrong_layout", cp=cp, method=method, errors=errs))
    return results


# Document ids of the masked cases: three documents in the first sequence (boundaries inside
# CP chunks and on one), one in the second.
DOCUMENTS = torch.tensor([[0] * 5 + [1] * 7 + [2] * 12, [0] * 24])
MASKS = {
    "block_causal": MaskSpec(block_causal=True),
    "window": MaskSpec(sliding_window=7),
    "block_causal_window": MaskSpec(block_causal=True, sliding_window=7),
}


def masked_attention_errors(
    cp_mesh: DeviceMesh, method: str, balancer: str, spec: MaskSpec, plant_shift: bool = False
) -> dict[str, float]:
    """As :func:`attention_errors` for a document / window mask against SDPA with the dense
    mask; ``plant_shift`` gives the CP kernel document ids one token late."""
    shape = (2, 4, 24, 8)
    gen = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(shape, generator=gen) for _ in range(4))
    docs = DOCUMENTS if spec.block_causal else None
    pos = torch.arange(24)
    dense = visible(
        pos[:, None],
        pos[None, :],
        None if docs is None else docs[:, :, None],
        None if docs is None else docs[:, None, :],
        spec.sliding_window,
    )
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref_out = F.scaled_dot_product_attention(
        *ref, attn_mask=dense.unsqueeze(1) if dense.dim() == 3 else dense
    )
    ref_out.backward(dout)

    def shard(t: torch.Tensor) -> torch.Tensor:
        return cp_shard(t, 2, cp_mesh, balancer)

    kernel = ContextParallelAttention(cp_mesh, method, balancer, spec)
    given = DOCUMENTS if not plant_shift else torch.cat([DOCUMENTS[:, :1], DOCUMENTS[:, :-1]], 1)
    mask = kernel.prepare(given, q.device)
    local = [shard(t).requires_grad_() for t in (q, k, v)]
    out = kernel(*local, mask=mask)
    out.backward(shard(dout))
    pairs = {"out": (out, ref_out)}
    pairs.update({f"d{n}": (t.grad, r.grad) for n, t, r in zip("qkv", local, ref)})
    return {name: (a - shard(b)).abs().max().item() for name, (a, b) in pairs.items()}


def masked_cases(meshes: dict[int, DeviceMesh]) -> list[dict]:
    results = []
    for cp, mesh in meshes.items():
        for method in METHODS:
            for balancer in BALANCERS:
                for name, spec in MASKS.items():
                    results.append(
                        dict(
                            kind="masked_attention",
                            cp=cp,
                            method=method,
                            balancer=balancer,
                            mask=name,
                            errors=masked_attention_errors(mesh, method, balancer, spec),
                        )
                    )
            results.append(
                dict(
                    kind="masked_attention_shifted",
                    cp=cp,
                    method=method,
                    errors=masked_attention_errors(
                        mesh, method, "headtail", MASKS["block_causal"], plant_shift=True
                    ),
                )
            )
    return results


def tiny_llama(seq_len: int, spec: MaskSpec = MaskSpec()) -> Transformer:
    args = TransformerModelArgs(
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=64,
        multiple_of=16,
        max_seq_len=seq_len,
        attn_type="flex" if not spec.causal_only else "sdpa",
        attn_mask_type="block_causal" if spec.block_causal else "causal",
        sliding_window=spec.sliding_window,
    )
    model = Transformer(args)
    model.init_weights(seed=0)
    with torch.no_grad():  # sharpen attention, so that positions and masks matter
        for layer in model.layers.values():
            layer.attention.wq.weight.mul_(15)
            layer.attention.wk.weight.mul_(15)
    return model


def model_errors(
    cp_mesh: DeviceMesh,
    method: str,
    balancer: str,
    pass_positions: bool = True,
    tp_mesh: DeviceMesh | None = None,
    spec: MaskSpec = MaskSpec(),
) -> dict[str, float]:
    """A CP model's loss and gradients, averaged over cp ranks as the trainer (loss over
    dp_cp) and FSDP (gradients over dp_shard_cp) do, against the unsharded model's. With
    ``tp_mesh``, tensor + sequence parallel is applied first (CP goes after TP)."""
    seq_len = 32
    tokens = torch.randint(0, 64, (2, seq_len + 1), generator=torch.Generator().manual_seed(1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    documents = (
        torch.tensor([[0] * 7 + [1] * 13 + [2] * 12, [0] * 32]) if spec.block_causal else None
    )
    ref = tiny_llama(seq_len, spec)
    ref_loss = cross_entropy_loss(ref(inputs, document_ids=documents), labels)
    ref_loss.backward()

    model = copy.deepcopy(ref)
    model.zero_grad()
    if tp_mesh is not None:
        apply_tp(model, tp_mesh, loss_parallel=False)
    apply_cp(model, cp_mesh, method, balancer)
    x, y, positions = shard_batch_for_cp(inputs, labels, cp_mesh, balancer)
    loss = cross_entropy_loss(
        model(x, positions=positions if pass_positions else None, document_ids=documents), y
    )
    loss.backward()

    group, cp = cp_mesh.get_group(), cp_mesh.size()
    loss = loss.detach()
    dist.all_reduce(loss, group=group)
    grad_err = 0.0
    for p, p_ref in zip(model.parameters(), ref.parameters()):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        dist.all_reduce(grad, group=group)
        grad_err = max(grad_err, (grad / cp - p_ref.grad).abs().max().item())
    return {"loss": (loss / cp - ref_loss).abs().item(), "grads": grad_err}


def model_cases(meshes: dict[int, DeviceMesh], cp_tp: DeviceMesh) -> list[dict]:
    results = []
    for method in METHODS:
        errors = model_errors(cp_tp["cp"], method, "headtail", tp_mesh=cp_tp["tp"])
        results.append(
            dict(
                kind="model_tp",
                cp=cp_tp["cp"].size(),
                method=method,
                balancer="headtail",
                errors=errors,
            )
        )
    for method in METHODS:
        errors = model_errors(
            cp_tp["cp"], method, "headtail", tp_mesh=cp_tp["tp"], spec=MASKS["block_causal"]
        )
        results.append(dict(kind="model_tp_block_causal", method=method, errors=errors))
    for cp, mesh in meshes.items():
        for method in METHODS:
            for balancer in BALANCERS:
                results.append(
                    dict(
                        kind="model",
                        cp=cp,
                        method=method,
                        balancer=balancer,
                        errors=model_errors(mesh, method, balancer),
                    )
                )
            results.append(
                dict(
                    kind="model_block_causal",
                    cp=cp,
                    method=method,
                    errors=model_errors(
                        mesh, method, "headtail", spec=MASKS["block_causal_window"]
                    ),
                )
            )
        # Negative control: local positions (0..S_local-1) for RoPE must change the loss.
        results.append(
            dict(
                kind="model_no_positions",
                cp=cp,
                method="allgather",
                errors=model_errors(mesh, "allgather", "headtail", False),
            )
        )
    return results


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    world = dist.get_world_size()
    meshes = {
        world // 2: init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "cp"))["cp"],
        world: init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)),
    }
    timings = {}
    start = time.perf_counter()
    results = attention_cases(meshes) + masked_cases(meshes)
    timings["attention_s"] = time.perf_counter() - start
    start = time.perf_counter()
    cp_tp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("cp", "tp"))
    results += model_cases(meshes, cp_tp)
    timings["model_s"] = time.perf_counter() - start
    path = os.path.join(os.environ["OUT_DIR"], f"rank{dist.get_rank()}.json")
    with open(path, "w") as f:
        json.dump({"results": results, "timings": timings}, f)
    leave_together()


if __name__ == "__main__":
    main()
    exit_skipping_static_destructors(0)
