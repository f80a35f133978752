"""Download a model's tokenizer, config and/or safetensors weights from the HuggingFace Hub.

    python scripts/download_hf_assets.py --repo_id meta-llama/Llama-3.1-8B \
        --assets tokenizer config \
        [--local_dir assets/hf/Llama-3.1-8B] [--hf_token hf_...]

The resulting directory can be passed as ``model.hf_assets_path``.
"""

from __future__ import annotations

import argparse
import sys

ASSET_PATTERNS = {
    "tokenizer": [
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "tokenizer.model",
    ],
    "config": ["config.json", "generation_config.json"],
    "safetensors": ["*.safetensors", "model.safetensors.index.json"],
}


def allow_patterns(assets: list[str]) -> list[str]:
    return [pattern for asset in assets for pattern in ASSET_PATTERNS[asset]]


def default_local_dir(repo_id: str) -> str:
    return f"assets/hf/{repo_id.rstrip('/').split('/')[-1]}"


def download(
    repo_id: str, assets: list[str], local_dir: str | None = None, hf_token: str | None = None
) -> str:
    """Download the assets into ``local_dir`` (default ``assets/hf/<repo name>``); returns the
    directory."""
    from huggingface_hub import snapshot_download

    return snapshot_download(
        repo_id,
        allow_patterns=allow_patterns(assets),
        local_dir=local_dir or default_local_dir(repo_id),
        token=hf_token,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repo_id", required=True, help="e.g. meta-llama/Llama-3.1-8B")
    parser.add_argument("--assets", nargs="+", required=True, choices=sorted(ASSET_PATTERNS))
    parser.add_argument("--local_dir", default=None, help="default: assets/hf/<repo name>")
    parser.add_argument(
        "--hf_token", default=None, help="for gated repositories (default: the cached login)"
    )
    args = parser.parse_args(argv)
    try:
        path = download(args.repo_id, args.assets, args.local_dir, args.hf_token)
    except Exception as e:  # network, auth, missing repo: one line, no traceback
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        message = (
            f"error: cannot download {args.assets} from {args.repo_id!r}: "
            f"{type(e).__name__}: {first_line}"
        )
        print(message, file=sys.stderr)
        return 1
    print(f"downloaded {', '.join(args.assets)} of {args.repo_id} to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
