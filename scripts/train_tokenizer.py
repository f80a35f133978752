"""Train a byte-level BPE ``tokenizer.json`` on a registered dataset.

    python scripts/train_tokenizer.py [--out assets/tokenizer] [--vocab_size 4096]

writes ``<out>/tokenizer.json`` (special tokens ``<|begin_of_text|>``, ``<|end_of_text|>``,
``<|pad|>`` take ids 0, 1, 2) and ``<out>/tokenizer_config.json`` naming them as
bos/eos/pad, the layout ``model.tokenizer_path`` / ``HuggingFaceTokenizer`` reads: from the
repository root, ``./run_train.sh --model.tokenizer_path assets/tokenizer`` trains with it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from torchtitan.data import load_documents

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
SPECIAL_TOKENS = [BOS, EOS, PAD]
_MIN_VOCAB = len(SPECIAL_TOKENS) + 256  # specials + the byte alphabet
DEFAULT_OUT = "assets/tokenizer"  # the folder train_configs/debug_model.toml's comment names


def _texts(dataset: str, dataset_path: str | None, max_docs: int | None) -> Iterator[str]:
    config, documents = load_documents(dataset, dataset_path)
    for document in itertools.islice(documents, max_docs):
        yield config.text_processor(document)


def train_tokenizer(
    out: str | Path,
    vocab_size: int,
    dataset: str = "python_stdlib",
    dataset_path: str | None = None,
    max_docs: int | None = None,
) -> Path:
    """Train on the first ``max_docs`` documents (all if None) and save into ``out``; returns
    ``out``."""
    if vocab_size < _MIN_VOCAB:
        raise ValueError(
            f"--vocab_size must be at least {_MIN_VOCAB} (3 special tokens + 256 bytes), "
            f"got {vocab_size}"
        )
    if max_docs is not None and max_docs < 1:
        raise ValueError(f"--max_docs must be positive, got {max_docs}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_texts(dataset, dataset_path, max_docs), trainer=trainer)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    (out / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2) + "\n", encoding="utf-8"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", default=DEFAULT_OUT, help="output directory (default: %(default)s)"
    )
    parser.add_argument("--vocab_size", type=int, default=4096)
    parser.add_argument("--dataset", default="python_stdlib", help="a registered dataset name")
    parser.add_argument(
        "--dataset_path", default=None, help="for the file datasets json, jsonl, parquet, txt"
    )
    parser.add_argument(
        "--max_docs", type=int, default=None, help="train on the first N documents only"
    )
    args = parser.parse_args(argv)
    try:
        out = train_tokenizer(
            args.out, args.vocab_size, args.dataset, args.dataset_path, args.max_docs
        )
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out / 'tokenizer.json'} and {out / 'tokenizer_config.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
