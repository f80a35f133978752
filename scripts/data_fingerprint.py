"""Print the sha1 of the first global batch of the embedded corpus under several dp degrees.

    python scripts/data_fingerprint.py [--dp 1 4] [--seq_len 256] [--global_batch 8]

One line per dp degree; the hashes are equal when the data order is independent of the
data-parallel layout. Ranks are simulated in one process, each with its own loader.
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import torch

from torchtitan.data import corpus_fingerprint
from torchtitan.data.loader import build_text_dataloader
from torchtitan.data.tokenizers import ByteTokenizer


def first_global_batch(dp: int, seq_len: int, global_batch: int, data_shards: int) -> torch.Tensor:
    """Inputs of global batch 0 in position order, assembled from ``dp`` simulated ranks."""
    per_rank = []
    for rank in range(dp):
        loader = build_text_dataloader(
            dataset="python_stdlib",
            dataset_path=None,
            tokenizer=ByteTokenizer(),
            seq_len=seq_len,
            local_batch_size=global_batch // dp,
            dp_rank=rank,
            dp_degree=dp,
            data_shards=data_shards,
        )
        inputs, _ = next(iter(loader))
        per_rank.append(inputs["input"])
    # rank r's i-th sequence is global position r + dp * i
    return torch.stack([per_rank[p % dp][p // dp] for p in range(global_batch)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--global_batch", type=int, default=8)
    parser.add_argument("--data_shards", type=int, default=64)
    args = parser.parse_args(argv)
    for dp in args.dp:
        if args.global_batch % dp:
            print(
                f"error: --global_batch {args.global_batch} is not divisible by dp {dp}",
                file=sys.stderr,
            )
            return 1
        batch = first_global_batch(dp, args.seq_len, args.global_batch, args.data_shards)
        digest = hashlib.sha1(batch.numpy().tobytes()).hexdigest()
        print(
            f"dp={dp} dataset=python_stdlib corpus={corpus_fingerprint('train')} "
            f"seq_len={args.seq_len} global_batch={args.global_batch} "
            f"data_shards={args.data_shards} first_batch_sha1={digest}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
