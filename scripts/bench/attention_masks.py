"""Speed and peak memory of one attention layer under the mask types of ``model.attn_type``.

    python scripts/bench/attention_masks.py --seq-lens 2048,8192 \\
        --output benchmarks/attention_masks_cpu.md

Rows, each at every sequence length (one sequence of packed documents whose lengths are
drawn from a geometric distribution of mean ``--mean-doc-len``):

- ``sdpa causal``: the fused SDPA kernel, causal (``attn_type sdpa``);
- ``flex block_causal`` (training): forward + backward of ``FlexAttention`` with the
  documents' mask, the path the trainer takes on this device (compiled FlexAttention on
  CUDA; block by block where FlexAttention has no backward, i.e. the CPU);
- ``flex block_causal`` (forward, no grad): the compiled FlexAttention kernel, as in
  validation and generation;
- ``sdpa dense mask``: SDPA given the same mask as a ``[seq, seq]`` bool tensor, what a
  kernel without block sparsity costs.

Peak memory is what the step allocates beyond its inputs: ``torch.cuda.max_memory_allocated``
on CUDA, ``torch.distributed._tools.mem_tracker.MemTracker`` on the CPU (timed in a separate
run, without the tracker; it cannot see inside a compiled kernel, so the compiled forward row
shows none on the CPU). Tokens/s counts query tokens per second of the median step.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime

import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

from torchtitan.layers.attention import FlexAttention, MaskSpec, ScaledDotProductAttention
from torchtitan.layers.blockwise_attention import visible

MiB = 2**20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", default="2048,8192")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--mean-doc-len", type=int, default=512)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument(
        "--skip-dense-above",
        type=int,
        default=4096,
        help="no dense-mask row above this length (its mask alone is seq^2 bytes)",
    )
    parser.add_argument("--output", default=None, help="also write the table to this markdown file")
    return parser.parse_args()


def document_ids(seq_len: int, mean_len: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seq_len)
    starts = torch.rand(seq_len, generator=gen) < 1 / mean_len
    starts[0] = False
    return starts.cumsum(0).unsqueeze(0).to(device)


Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def cases(docs: torch.Tensor, seq_len: int, skip_dense_above: int) -> dict[str, tuple[Step, bool]]:
    """name -> (step on q, k, v, whether it runs backward)."""
    sdpa, flex = ScaledDotProductAttention(), FlexAttention(MaskSpec(block_causal=True))

    def train(kernel):
        def step(q, k, v):
            kernel(q, k, v, mask=kernel.prepare(docs, q.device)).sum().backward()

        return step

    def forward_only(q, k, v):
        with torch.no_grad():
            flex(q, k, v, mask=flex.prepare(docs, q.device))

    def dense(q, k, v):
        pos = torch.arange(seq_len, device=q.device)
        mask = visible(pos[:, None], pos[None, :], docs[:, :, None], docs[:, None, :], None)
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1)).sum().backward()

    rows = {
        "sdpa causal": (train(sdpa), True),
        "flex block_causal (training)": (train(flex), True),
        "flex block_causal (forward, no grad)": (forward_only, False),
    }
    if seq_len <= skip_dense_above:
        rows["sdpa dense mask"] = (dense, True)
    return rows


def inputs(
    seq_len: int, args, device: torch.device, dtype: torch.dtype, grad: bool
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shape = (1, args.heads, seq_len, args.head_dim)
    return [
        torch.randn(shape, generator=gen).to(device, dtype).requires_grad_(grad) for _ in range(3)
    ]


def median_seconds(
    step: Step, tensors: list[torch.Tensor], iters: int, device: torch.device
) -> float:
    step(*tensors)  # warm-up (compilation)
    times = []
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        step(*tensors)
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_mib(
    step: Step, tensors: list[torch.Tensor], device: torch.device, compiled: bool
) -> float | None:
    """None where it cannot be measured: MemTracker does not see inside a compiled kernel."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(*tensors)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / MiB
    if compiled:
        return None
    tracker = MemTracker()
    tracker.track_external(*tensors)
    with tracker:
        step(*tensors)
    peak = sum(tracker.get_tracker_snapshot("peak")[device].values())
    return peak / MiB - sum(t.numel() * t.element_size() for t in tensors) / MiB


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lines = [
        f"# Attention masks: {device.type}, {args.heads} heads x {args.head_dim}, batch 1, {dtype}",
        "",
        f"- command: `python scripts/bench/attention_masks.py {' '.join(sys.argv[1:])}`",
        f"- torch {torch.__version__}, Python {platform.python_version()}, "
        f"{torch.get_num_threads()} threads",
        f"- date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; "
        f"documents of mean length {args.mean_doc_len}",
        "",
        "| seq | kernel | documents | tokens/s | median step (ms) "
        "| peak memory beyond inputs (MiB) | [seq, seq] fp32 would be (MiB) |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for seq_len in (int(s) for s in args.seq_lens.split(",")):
        docs = document_ids(seq_len, args.mean_doc_len, device)
        full = seq_len * seq_len * 4 * args.heads / MiB
        for name, (step, grad) in cases(docs, seq_len, args.skip_dense_above).items():
            seconds = median_seconds(
                step, inputs(seq_len, args, device, dtype, grad), args.iters, device
            )
            compiled = not grad or (device.type == "cuda" and name.startswith("flex"))
            peak = peak_mib(step, inputs(seq_len, args, device, dtype, grad), device, compiled)
            shown = "n/a (compiled kernel)" if peak is None else f"{peak:,.1f}"
            lines.append(
                f"| {seq_len} | {name} | {int(docs.max()) + 1} | {seq_len / seconds:,.0f} | "
                f"{1000 * seconds:.1f} | {shown} | {full:,.0f} |"
            )
            print(lines[-1], flush=True)
    table = "\n".join(lines) + "\n"
    print(table)
    if args.output:
        with open(args.output, "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
