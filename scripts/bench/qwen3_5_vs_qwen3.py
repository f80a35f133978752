"""Qwen3.5 (Gated DeltaNet + gated full attention) vs a same-size Qwen3 (all full attention):
training-step throughput and activation memory per sequence length, batch 1, fp32.

    python scripts/bench/qwen3_5_vs_qwen3.py --seq-lens 2048,8192,32768

Models (one shape, only the token mixers differ; same dim, layers, FFN, vocabulary):

- ``Qwen3.5``: ``Qwen3_5Model`` with ``--layers - 1`` Gated DeltaNet layers and one gated
  full-attention layer last (the published 3:1 pattern for 4 layers);
- ``Qwen3.5 all linear``: the same with every layer Gated DeltaNet, which shows what the
  one full-attention layer costs;
- ``Qwen3``: ``Qwen3Model`` with full attention (no output gate) in every layer.

Full attention is the repo's default kernel (``attn_type`` sdpa, causal: the fused SDPA
kernel); Gated DeltaNet runs its chunked delta rule (``layers/gated_deltanet.py``), pure
PyTorch with a Python loop over chunks.

A step is forward + cross-entropy + backward in training mode (no optimizer step). Steps
of the models alternate within each repeat, so a load change on a shared machine hits all
of them; the table gives the median step (and the fastest, the least disturbed by other
work), and the median process CPU time of a step (with ``--threads 1``, what the step
costs whatever else the cores run). Tokens/s is ``seq / median step``; time per token growth
is (step / seq) at the longest length over (step / seq) at the shortest. Freed memory stays
with the process (:func:`keep_freed_memory`; ``--system-malloc`` to leave glibc's malloc
as it is).

Activation memory is the bytes of the tensors autograd saves for backward in one forward
(``torch.autograd.graph.saved_tensors_hooks``), each storage counted once, parameters and
buffers (the RoPE table) left out: what a sequence keeps alive between forward and
backward, measured on the first warm-up step (a storage is attributed to the block whose
forward saved it first). Per-layer times are the process CPU time between module hooks on
each block (forward, and ``register_full_backward_pre_hook`` / ``register_full_backward_hook``
for its backward); what the blocks do not cover is the embedding, final norm, output layer
and loss. The full-attention share is the full-attention blocks' CPU time over the step's.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import platform
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import torch
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from scripts.bench.benchmark import _git, machine  # noqa: E402
from torchtitan.layers.loss import cross_entropy_loss  # noqa: E402
from torchtitan.models.qwen3.args import Qwen3ModelArgs  # noqa: E402
from torchtitan.models.qwen3.model import Qwen3Model  # noqa: E402
from torchtitan.models.qwen3_5.args import DELTA_RULE, FULL, Qwen3_5ModelArgs  # noqa: E402
from torchtitan.models.qwen3_5.model import Qwen3_5Model  # noqa: E402

MiB = 2**20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", default="2048,8192,32768")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ffn-hidden-dim", type=int, default=768)
    parser.add_argument("--vocab-size", type=int, default=264, help="the byte tokenizer's")
    parser.add_argument("--heads", type=int, default=4, help="full-attention query heads")
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--linear-k-heads", type=int, default=2)
    parser.add_argument("--linear-v-heads", type=int, default=4)
    parser.add_argument("--linear-head-dim", type=int, default=64, help="key and value")
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument(
        "--long-seq", type=int, default=16384, help="from this length on, the long-* counts"
    )
    parser.add_argument("--long-warmup", type=int, default=1)
    parser.add_argument("--long-iters", type=int, default=3)
    parser.add_argument("--no-all-linear", action="store_true", help="skip that row")
    parser.add_argument(
        "--system-malloc",
        action="store_true",
        help="leave glibc's malloc as it is (default: keep freed memory, keep_freed_memory)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads (default: torch's, one per core); on a machine shared "
        "with other work, 1 avoids OpenMP threads waiting on a descheduled peer",
    )
    return parser.parse_args()


def build_models(a: argparse.Namespace, max_seq_len: int) -> dict[str, nn.Module]:
    common = dict(
        vocab_size=a.vocab_size,
        dim=a.dim,
        n_layers=a.layers,
        n_heads=a.heads,
        n_kv_heads=a.kv_heads,
        head_dim=a.head_dim,
        ffn_hidden_dim=a.ffn_hidden_dim,
        max_seq_len=max_seq_len,
    )
    delta_rule = dict(
        delta_rule_n_k_heads=a.linear_k_heads,
        delta_rule_n_v_heads=a.linear_v_heads,
        delta_rule_k_head_dim=a.linear_head_dim,
        delta_rule_v_head_dim=a.linear_head_dim,
        delta_rule_chunk_size=a.chunk_size,
    )
    hybrid = [DELTA_RULE] * (a.layers - 1) + [FULL]
    args = {
        "Qwen3.5": Qwen3_5ModelArgs(**common, **delta_rule, layer_types=hybrid),
        "Qwen3.5 all linear": Qwen3_5ModelArgs(
            **common, **delta_rule, layer_types=[DELTA_RULE] * a.layers
        ),
        "Qwen3": Qwen3ModelArgs(**common),
    }
    if a.no_all_linear:
        del args["Qwen3.5 all linear"]
    models = {}
    for name, model_args in args.items():
        model = (Qwen3_5Model if name.startswith("Qwen3.5") else Qwen3Model)(model_args)
        model.init_weights(seed=0)
        models[name] = model.train()
    return models


def layer_kinds(model: nn.Module) -> list[str]:
    types = getattr(model.model_args, "layer_types", None)
    return list(types) if types else [FULL] * len(model.layers)


def describe(model: nn.Module) -> str:
    total = sum(p.numel() for p in model.parameters())
    outer = sum(
        p.numel() for m in (model.tok_embeddings, model.output, model.norm) for p in m.parameters()
    )
    kinds = layer_kinds(model)
    mixers = ", ".join(f"{kinds.count(k)} {k}" for k in (DELTA_RULE, FULL) if k in kinds)
    return f"{total:,} parameters ({total - outer:,} in the blocks); {mixers}"


@dataclass
class Probe:
    """Per-block forward + backward process CPU seconds of one step (module hooks), and
    bytes saved for backward per block while ``saving`` (``outside``: embedding, norm,
    output, loss)."""

    model: nn.Module
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    saved: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    _start: dict[str, float] = field(default_factory=dict)
    _current: str = "outside"
    _storages: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        state = [*self.model.parameters(), *self.model.buffers()]
        self.params = {t.untyped_storage().data_ptr() for t in state}
        self.handles = []
        for name, block in self.model.layers.items():
            self.handles += [
                block.register_forward_pre_hook(self._enter(name)),
                block.register_forward_hook(self._leave(name)),
                block.register_full_backward_pre_hook(self._enter(name, backward=True)),
                block.register_full_backward_hook(self._leave(name, backward=True)),
            ]

    def _enter(self, name: str, backward: bool = False):
        def hook(*_):
            self._start[name] = time.process_time()
            if not backward:
                self._current = name

        return hook

    def _leave(self, name: str, backward: bool = False):
        def hook(*_):
            self.seconds[name] += time.process_time() - self._start[name]
            if not backward:
                self._current = "outside"

        return hook

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.params and ptr not in self._storages:
            self._storages.add(ptr)
            self.saved[self._current] += storage.nbytes()
        return t

    @contextmanager
    def saving(self):
        self.saved.clear()
        self._storages.clear()
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield

    def reset(self) -> None:
        self.seconds.clear()


def step(model: nn.Module, tokens: torch.Tensor) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of forward + loss + backward."""
    model.zero_grad(set_to_none=True)
    start, cpu = time.perf_counter(), time.process_time()
    loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    return time.perf_counter() - start, time.process_time() - cpu


def keep_freed_memory() -> bool:
    """Make glibc keep what the process frees (no ``mmap`` for large blocks, no trimming of
    the heap) so that a step reuses the previous step's pages instead of faulting in fresh
    ones. A step here allocates gigabytes; on the VM this was measured on, faulting them in
    cost up to ~2 s of system time per GiB and varied from step to step (several times the
    compute at seq 32768). False where the C library has no ``mallopt``."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        m_trim_threshold, m_mmap_max = -1, -4  # malloc.h
        return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, -1))
    except (AttributeError, OSError, TypeError):
        return False


@dataclass
class Result:
    steps: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # process CPU seconds per step
    full_share: list[float] = field(default_factory=list)  # full-attention blocks / step
    # per step: the mean block of each kind, each block, and what the blocks leave out
    block_seconds: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    layer_seconds: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    outside: list[float] = field(default_factory=list)
    saved: dict[str, int] = field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(self.steps)


def measure(models: dict[str, nn.Module], seq: int, warmup: int, iters: int) -> dict[str, Result]:
    gen = torch.Generator().manual_seed(seq)
    probes = {name: Probe(model) for name, model in models.items()}
    results = {name: Result() for name in models}
    try:
        for name, model in models.items():
            tokens = torch.randint(0, model.model_args.vocab_size, (1, seq + 1), generator=gen)
            for i in range(warmup):
                if i == 0:
                    with probes[name].saving():
                        step(model, tokens)
                    results[name].saved = dict(probes[name].saved)
                else:
                    step(model, tokens)
        for _ in range(iters):  # the models alternate within a repeat
            for name, model in models.items():
                tokens = torch.randint(0, model.model_args.vocab_size, (1, seq + 1), generator=gen)
                probe, result = probes[name], results[name]
                probe.reset()
                seconds, cpu = step(model, tokens)
                result.steps.append(seconds)
                result.cpu.append(cpu)
                kinds = layer_kinds(model)
                per_kind: dict[str, list[float]] = defaultdict(list)
                for layer, kind in zip(model.layers, kinds):
                    per_kind[kind].append(probe.seconds[layer])
                    result.layer_seconds[layer].append(probe.seconds[layer])
                for kind, values in per_kind.items():
                    result.block_seconds[kind].append(statistics.mean(values))
                result.full_share.append(sum(per_kind[FULL]) / cpu)
                result.outside.append(cpu - sum(map(sum, per_kind.values())))
    finally:
        for probe in probes.values():
            for handle in probe.handles:
                handle.remove()
    return results


def per_block(result: Result, kind: str) -> float | None:
    """Median over the steps of the mean block of ``kind`` (None: the model has none)."""
    values = result.block_seconds.get(kind)
    return statistics.median(values) if values else None


def saved_per_block(model: nn.Module, result: Result, kind: str) -> float | None:
    kinds = layer_kinds(model)
    values = [result.saved.get(layer, 0) for layer, k in zip(model.layers, kinds) if k == kind]
    return sum(values) / len(values) / MiB if values else None


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    a = parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    kept = not a.system_malloc and keep_freed_memory()
    seq_lens = [int(s) for s in a.seq_lens.split(",")]
    models = build_models(a, max(seq_lens))
    dirty = (
        " (uncommitted changes)" if _git("status", "--porcelain", "--untracked-files=no") else ""
    )
    print(
        f"torch {torch.__version__}, Python {platform.python_version()}, "
        f"{torch.get_num_threads()} threads, {machine()}, fp32, batch 1, "
        f"code {_git('rev-parse', '--short', 'HEAD')}{dirty}, "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; malloc: "
        f"{'freed memory kept (no mmap, no trim)' if kept else 'glibc defaults'}"
    )
    print(
        f"shape: dim {a.dim}, {a.layers} layers, FFN {a.ffn_hidden_dim}, vocab {a.vocab_size}; "
        f"full attention {a.heads} heads / {a.kv_heads} KV x {a.head_dim} (sdpa causal); "
        f"Gated DeltaNet {a.linear_k_heads} k / {a.linear_v_heads} v heads x "
        f"{a.linear_head_dim}, chunk {a.chunk_size}"
    )
    for name, model in models.items():
        print(f"- {name}: {describe(model)}")
    print(flush=True)

    main_rows = [
        "| seq | model | tokens/s | median step (ms) | min step (ms) | CPU time per step (ms) "
        "| ms per 1k tokens | steps timed | saved for backward (MiB) |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    layer_rows = [
        "| seq | model | full-attention block (ms) | Gated DeltaNet block (ms) "
        "| each layer (ms) | outside the blocks (ms) | full-attention share of step "
        "| saved per full block (MiB) | saved per Gated DeltaNet block (MiB) |",
        "| ---: | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    per_token: dict[str, dict[int, float]] = defaultdict(dict)
    per_token_cpu: dict[str, dict[int, float]] = defaultdict(dict)
    for seq in seq_lens:
        long = seq >= a.long_seq
        warmup, iters = (a.long_warmup, a.long_iters) if long else (a.warmup, a.iters)
        start = time.perf_counter()
        results = measure(models, seq, warmup, iters)
        for name, result in results.items():
            model, median = models[name], result.median
            per_token[name][seq] = median / seq
            per_token_cpu[name][seq] = statistics.median(result.cpu) / seq
            main_rows.append(
                f"| {seq} | {name} | {seq / median:,.0f} | {1e3 * median:,.1f} | "
                f"{1e3 * min(result.steps):,.1f} | {1e3 * statistics.median(result.cpu):,.1f} | "
                f"{1e6 * median / seq:,.2f} | {iters} | {sum(result.saved.values()) / MiB:,.1f} |"
            )
            full, delta_rule = per_block(result, FULL), per_block(result, DELTA_RULE)
            layers = " / ".join(
                f"{1e3 * statistics.median(v):,.0f}" for v in result.layer_seconds.values()
            )
            layer_rows.append(
                f"| {seq} | {name} | {_fmt(full and 1e3 * full, ',.1f')} | "
                f"{_fmt(delta_rule and 1e3 * delta_rule, ',.1f')} | {layers} | "
                f"{1e3 * statistics.median(result.outside):,.1f} | "
                f"{100 * statistics.median(result.full_share):.0f}% | "
                f"{_fmt(saved_per_block(model, result, FULL), ',.1f')} | "
                f"{_fmt(saved_per_block(model, result, DELTA_RULE), ',.1f')} |"
            )
            print(main_rows[-1], flush=True)
        print(f"(seq {seq}: {time.perf_counter() - start:.0f} s)", flush=True)

    first, last = seq_lens[0], seq_lens[-1]
    growth_rows = [
        f"| model | ms per 1k tokens at {first} | at {last} | growth ({last} / {first}) "
        f"| CPU ms per 1k tokens at {first} | at {last} | CPU growth |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, wall in per_token.items():
        cpu = per_token_cpu[name]
        growth_rows.append(
            f"| {name} | {1e6 * wall[first]:,.2f} | {1e6 * wall[last]:,.2f} | "
            f"{wall[last] / wall[first]:.2f}x | {1e6 * cpu[first]:,.2f} | {1e6 * cpu[last]:,.2f} | "
            f"{cpu[last] / cpu[first]:.2f}x |"
        )
    print("\n" + "\n".join(main_rows))
    print("\nPer block (forward + backward, process CPU time; medians over the timed steps):\n")
    print("\n".join(layer_rows))
    print("\nTime per token, shortest to longest sequence:\n")
    print("\n".join(growth_rows))


if __name__ == "__main__":
    main()
