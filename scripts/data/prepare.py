"""Tokenize a corpus once into a token store that training memory-maps
(``--training.dataset tokens --training.dataset_path STORE``)::

    python scripts/data/prepare.py --input 'corpus/*.jsonl.zst' --out stores/web \\
        --tokenizer assets/tokenizer --workers 8
    python scripts/data/prepare.py --dataset python_stdlib --out stores/stdlib

Inputs, resumption and the store's layout: ``torchtitan/data/prepare.py`` and
``torchtitan/data/token_store.py``. Bad input is one ``error:`` line and exit code 2.
"""

from __future__ import annotations

import functools
import sys

from torchtitan.config import ConfigError, ModelConfig
from torchtitan.config.entry import config_errors_exit
from torchtitan.data.prepare import parse_args, prepare
from torchtitan.data.tokenizers import build_tokenizer
from torchtitan.protocols.tokenizer import BaseTokenizer


def make_tokenizer(path: str) -> BaseTokenizer:
    """The tokenizer a run with ``model.tokenizer_path = path`` uses (``byte``: the built-in)."""
    try:
        return build_tokenizer(ModelConfig(tokenizer_path=path))
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e).replace("model.tokenizer_path", "--tokenizer")) from None


@config_errors_exit
def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    manifest = prepare(args, functools.partial(make_tokenizer, args.tokenizer))
    print(
        f"token store {args.out}: {manifest.documents:,} documents, {manifest.tokens:,} tokens "
        f"in {len(manifest.shards)} shard(s) of {manifest.dtype}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
