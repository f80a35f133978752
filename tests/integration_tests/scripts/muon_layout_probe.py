"""Run by test_parity_muon under torchrun with 4 processes: Muon on DTensors of awkward
layouts (uneven and empty shards, a partial round, two cuts of one matrix, FSDP's strided
shard over a TP shard, expert stacks cut by expert and by tensor parallel) against Muon on
the same whole tensors in every process. Writes the largest difference to OUT_DIR."""

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from torchtitan.components.optimizers.muon import Muon
from torchtitan.distributed.process import exit_skipping_static_destructors, leave_together

SETTINGS = dict(
    lr=0.02,
    weight_decay=0.1,
    momentum=0.95,
    nesterov=True,
    ns_coefficients=(3.4445, -4.775, 2.0315),
    ns_steps=5,
    eps=1e-7,
    adjust_lr="original",
    ns_dtype="float32",
)


def layouts(flat, square):
    """(shape, mesh, placements): 4-way cuts of 5 rows (2, 2, 1, 0) and 7 columns, 2 x 2
    cuts, FSDP's strided shard, experts split by EP and cut by TP, a replicated matrix."""
    return [
        ((5, 3), flat, [Shard(0)]),
        ((6, 7), flat, [Shard(1)]),
        ((9, 4), flat, [Shard(0)]),
        ((4, 4), flat, [Shard(0)]),
        ((3, 8), flat, [Shard(0)]),
        ((10, 6), square, [Shard(0), Shard(1)]),
        ((12, 5), square, [_StridedShard(0, split_factor=2), Shard(0)]),
        ((4, 6, 5), square, [Shard(0), Shard(2)]),
        ((4, 5, 6), square, [Shard(0), Shard(1)]),
        ((3, 5, 6), flat, [Shard(1)]),
        ((6, 5), square, [Replicate(), Shard(1)]),
        ((5, 5), square, [Replicate(), Replicate()]),
    ]


def main() -> None:
    dist.init_process_group("gloo")
    flat = init_device_mesh("cpu", (4,))
    square = init_device_mesh("cpu", (2, 2))
    generator = torch.Generator().manual_seed(0)
    cases = layouts(flat, square)
    whole = [torch.randn(shape, generator=generator) for shape, _, _ in cases]
    grads = [[torch.randn(w.shape, generator=generator) for w in whole] for _ in range(3)]
    plain = [torch.nn.Parameter(w.clone()) for w in whole]
    sharded = [
        torch.nn.Parameter(distribute_tensor(w.clone(), mesh, placements))
        for w, (_, mesh, placements) in zip(whole, cases)
    ]
    reference, distributed = Muon(plain, **SETTINGS), Muon(sharded, **SETTINGS)
    for step in grads:
        for p, q, g, (_, mesh, placements) in zip(plain, sharded, step, cases):
            p.grad = g.clone()
            q.grad = distribute_tensor(g.clone(), mesh, placements)
        reference.step()
        distributed.step()
    worst = max((q.full_tensor() - p.detach()).abs().max().item() for p, q in zip(plain, sharded))
    moved = max((p.detach() - w).abs().max().item() for p, w in zip(plain, whole))
    Path(os.environ["OUT_DIR"], f"rank{dist.get_rank()}.json").write_text(
        json.dumps({"worst": worst, "moved": moved})
    )
    leave_together()


if __name__ == "__main__":
    main()
    exit_skipping_static_destructors(0)
