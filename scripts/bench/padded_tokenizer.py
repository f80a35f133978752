"""Write a tokenizer folder whose vocabulary is padded to Llama 3's 128,256 entries.

    python scripts/bench/padded_tokenizer.py OUT_DIR [--vocab-size 128256]

The upstream test tokenizer (2,000 entries, ``scripts/bench/upstream_test_tokenizer/``) plus
reserved special tokens that no text produces, as Llama 3 reserves its last 256: the model
gets the full vocabulary (the output projection, the logits and the loss at full size) while
the data is tokenized exactly as with the small tokenizer. For benchmarks of the loss on a
machine that cannot download the Llama 3 tokenizer.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

SOURCE = Path(__file__).resolve().parent / "upstream_test_tokenizer"


def write_padded_tokenizer(folder: Path, vocab_size: int = 128256) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(SOURCE / "tokenizer_config.json", folder / "tokenizer_config.json")
    tokenizer = Tokenizer.from_file(str(SOURCE / "tokenizer.json"))
    missing = vocab_size - tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer.add_special_tokens(
        [AddedToken(f"<|reserved_padding_{i}|>", special=True) for i in range(missing)]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--vocab-size", type=int, default=128256)
    args = parser.parse_args()
    print(write_padded_tokenizer(args.folder, args.vocab_size))
