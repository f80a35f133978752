"""Peak attention memory per rank and forward+backward time of context-parallel attention.

    torchrun --nproc_per_node 4 scripts/bench/context_parallel_memory.py --seq-len 4096

Runs every rotate method at cp = 1, 2, 4 (each cp <= world size; the world is split into
world/cp independent cp groups doing the same work) plus plain causal SDPA on the full
sequence, and prints a markdown table from rank 0: the maximum over ranks of the peak memory
the attention step allocates beyond its inputs (q, k, v, grad_out), and the median step time.

Memory is measured at tensor-allocation level: ``torch.cuda.max_memory_allocated`` on CUDA,
``torch.distributed._tools.mem_tracker.MemTracker`` on CPU (timed separately, without the
tracker). Every rank runs one thread; on CPU the ranks share the machine's cores, so times are
only comparable with each other.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh

from torchtitan.distributed.context_parallel.attention import ContextParallelAttention
from torchtitan.distributed.context_parallel.layout import cp_shard
from torchtitan.layers.attention import ScaledDotProductAttention

METHODS = ("allgather", "alltoall", "ulysses")
MiB = 2**20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--load-balancer", default="headtail", choices=("headtail", "none"))
    parser.add_argument("--cp", default="1,2,4", help="comma-separated cp degrees")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, else float32")
    return parser.parse_args()


def init() -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    return device


def step_fn(attn: nn.Module, inputs: list[torch.Tensor], dout: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        for t in inputs:
            t.grad = None
        attn(*inputs).backward(dout)

    return step


def peak_mib(step: Callable[[], None], inputs: list[torch.Tensor], dout: torch.Tensor) -> float:
    """Peak bytes the step allocates beyond its (already allocated) inputs."""
    device = dout.device
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / MiB
    tracker = MemTracker()
    tracker.track_external(*inputs, dout)
    with tracker:
        base = tracker.get_tracker_snapshot("current")[device]["Total"]
        step()
    return (tracker.get_tracker_snapshot("peak")[device]["Total"] - base) / MiB


def median_seconds(step: Callable[[], None], iters: int, device: torch.device) -> float:
    step()  # warm-up
    times = []
    for _ in range(iters):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def measure(
    attn: nn.Module, full: list[torch.Tensor], shard: Callable, args: argparse.Namespace
) -> tuple[float, float]:
    inputs = [shard(t).requires_grad_() for t in full[:3]]
    dout = shard(full[3])
    step = step_fn(attn, inputs, dout)
    seconds = median_seconds(step, args.iters, dout.device)
    mib = peak_mib(step, inputs, dout)
    return max_over_ranks(mib, dout.device), max_over_ranks(seconds, dout.device)


def main() -> None:
    args = parse_args()
    device = init()
    world = dist.get_world_size()
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype
        else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )
    shape = (args.batch, args.heads, args.seq_len, args.head_dim)
    gen = torch.Generator(device).manual_seed(0)
    full = [torch.randn(shape, generator=gen, device=device, dtype=dtype) for _ in range(4)]

    rows = [("sdpa (no CP)", 1, *measure(ScaledDotProductAttention(), full, lambda t: t, args))]
    for cp in (int(c) for c in args.cp.split(",")):
        if world % cp != 0:
            continue
        cp_mesh = init_device_mesh(device.type, (world // cp, cp), mesh_dim_names=("dp", "cp"))[
            "cp"
        ]
        for method in METHODS:
            if method == "ulysses" and args.heads % cp != 0:
                continue
            attn = ContextParallelAttention(cp_mesh, method, args.load_balancer)
            shard = functools.partial(
                cp_shard, seq_dim=2, cp_mesh=cp_mesh, load_balancer=args.load_balancer
            )
            rows.append((method, cp, *measure(attn, full, shard, args)))

    if dist.get_rank() == 0:
        print(
            f"\nseq_len {args.seq_len}, batch {args.batch}, heads {args.heads}, head_dim "
            f"{args.head_dim}, {dtype}, {device.type}, load_balancer {args.load_balancer}, "
            f"world {world}\n"
        )
        print("| method | cp | peak attention memory / rank (MiB) | fwd+bwd time (ms) |")
        print("| --- | ---: | ---: | ---: |")
        for method, cp, mib, seconds in rows:
            print(f"| {method} | {cp} | {mib:.1f} | {seconds * 1e3:.1f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
