"""What context parallel costs Gated DeltaNet's delta rule: forward + backward time of one
layer's rule (``DeltaRule`` on one process vs ``ContextParallelDeltaRule`` on cp processes,
headtail), the ideal ``time / cp`` beside it, the bubble (measured minus ideal) and the bytes
each rank sends per layer (state hand-offs, both directions).

    python scripts/bench/cp_delta_rule.py --seq 4096 --heads 8 --cps 1 2

The chain is sequential (the module docstring of ``distributed/context_parallel/delta_rule.py``):
expect no speed-up for the rule itself; what CP buys for these layers is memory (each rank
holds 1 / cp of the activations). Each cp runs in its own torchrun launch, one thread per
process (2 processes on a 2-core machine run side by side)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=64, help="the rule's chunk size")
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def rule_inputs(args: argparse.Namespace) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shape = (1, args.heads, args.seq, args.head_dim)
    q, k = (torch.nn.functional.normalize(torch.randn(*shape, generator=gen), dim=-1) for _ in "qk")
    v = torch.randn(*shape, generator=gen)
    g = -torch.rand(1, args.heads, args.seq, generator=gen) * 0.1
    beta = torch.rand(1, args.heads, args.seq, generator=gen)
    return [q * args.head_dim**-0.5, k, v, g, beta]


def worker(args: argparse.Namespace) -> None:
    """One launch: time the rule on this rank's shard; rank 0 prints one JSON line."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan.distributed.context_parallel.delta_rule import (
        ContextParallelDeltaRule,
    )
    from torchtitan.distributed.context_parallel.layout import cp_shard
    from torchtitan.distributed.process import exit_skipping_static_destructors, leave_together
    from torchtitan.layers.gated_deltanet import DeltaRule, RecurrentSpec

    cp = int(os.environ.get("WORLD_SIZE", "1"))
    tensors = rule_inputs(args)
    if cp == 1:
        rule = DeltaRule(args.chunk)
    else:
        mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
        rule = ContextParallelDeltaRule(mesh, "headtail", args.chunk, RecurrentSpec())
        tensors = [cp_shard(t, 2, mesh, "headtail") for t in tensors]
    tensors = [t.contiguous().requires_grad_() for t in tensors]
    times = []
    for i in range(args.repeats + 1):
        if cp > 1:
            dist.barrier()
        start = time.perf_counter()
        rule(*tensors).sum().backward()
        if cp > 1:
            dist.barrier()
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - start)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"cp": cp, "seconds": statistics.median(times)}), flush=True)
    leave_together()
    exit_skipping_static_destructors(0)


def sent_bytes_per_rank(args: argparse.Namespace, cp: int) -> int:
    """Under headtail the chain crosses ranks 2 * cp - 2 times, each a [heads, k, v] fp32
    state, forward and backward: at most 2 sends per rank per direction."""
    if cp == 1:
        return 0
    return 2 * 2 * args.heads * args.head_dim * args.head_dim * 4


def launch(args: argparse.Namespace, cp: int) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cp}"]
    cmd += [__file__, "--worker", "--seq", str(args.seq), "--heads", str(args.heads)]
    cmd += ["--head-dim", str(args.head_dim), "--chunk", str(args.chunk)]
    cmd += ["--repeats", str(args.repeats)]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["seconds"]


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    seconds = {cp: launch(args, cp) for cp in args.cps}
    base = seconds[min(args.cps)] * min(args.cps)
    print(
        f"delta rule forward + backward, seq {args.seq}, {args.heads} heads of "
        f"{args.head_dim}, chunk {args.chunk}, fp32, median of {args.repeats}"
    )
    print("| cp | seconds | ideal (1-process / cp) | bubble | sent per rank per layer |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for cp, s in seconds.items():
        ideal = base / cp
        sent = sent_bytes_per_rank(args, cp) / 2**10
        print(f"| {cp} | {s:.3f} | {ideal:.3f} | {s - ideal:+.3f} | {sent:.0f} KiB |")


if __name__ == "__main__":
    main()
