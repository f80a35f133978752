"""Peak memory per activation-checkpointing mode for one training step of a Llama 3 flavor,
measured at tensor-allocation level with torch's MemTracker (not process RSS).

    python scripts/bench/activation_memory.py [--flavor debugmodel] [--seq_len 256] [--batch 8]
"""

from __future__ import annotations

import argparse

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.layers.loss import cross_entropy_loss
from torchtitan.protocols import get_train_spec

MODES = [("none", "2"), ("full", "2"), ("selective", "2"), ("selective", "op")]
MIB = 2**20


def peak_of_one_step(
    flavor: str, seq_len: int, batch: int, mode: str, option: str
) -> dict[str, float]:
    spec = get_train_spec("llama3")
    args = spec.flavor_args(flavor)
    args.vocab_size, args.max_seq_len = 264, seq_len
    model = spec.model_cls(args)
    model.init_weights(seed=0)
    apply_ac(model.layers, mode, option)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    tokens = torch.randint(0, args.vocab_size, (batch, seq_len + 1))

    def step() -> None:
        loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # allocates the optimizer states; the tracked step is a steady-state one
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step()
    snapshot = tracker.get_tracker_snapshot("peak")
    per_category = next(iter(snapshot.values()))
    return {str(k).split(".")[-1].lower(): v / MIB for k, v in per_category.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    a = parser.parse_args()
    print(
        f"Llama 3 {a.flavor}, batch {a.batch} x seq {a.seq_len}, fp32, CPU, MemTracker peak (MiB)\n"
    )
    print("| AC mode | activations | temporaries | total peak |")
    print("| --- | ---: | ---: | ---: |")
    for mode, option in MODES:
        peak = peak_of_one_step(a.flavor, a.seq_len, a.batch, mode, option)
        label = mode if mode != "selective" else f"selective {option}"
        print(
            f"| {label} | {peak.get('act', 0):.1f} | {peak.get('temp', 0):.1f} | "
            f"{peak.get('total', 0):.1f} |"
        )


if __name__ == "__main__":
    main()
