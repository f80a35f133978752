"""Write a tiny Hugging Face model folder as users bring one: ``config.json``, weights in
``model.safetensors`` (bf16, as published folders are) saved by transformers'
``save_pretrained`` from a seeded random model, and the tokenizer files.

``tests/assets/hf_debug`` (what ``train_configs/hf_debug.toml`` fine-tunes) was written by

    python scripts/hf_debug_folder.py tests/assets/hf_debug

and the same command rewrites it identically.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "scripts" / "bench" / "upstream_test_tokenizer"
MISTRAL = {
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 2048,  # the tokenizer's
    "max_position_embeddings": 2048,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "bos_token_id": 1998,  # the tokenizer's <|begin_of_text|>
    "eos_token_id": 1999,  # and <|end_of_text|>
}


def write_debug_folder(out: Path, seed: int = 0) -> Path:
    """``out``: a random tiny Mistral saved by transformers, with the test tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("mistral", **MISTRAL)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, out / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder to write")
    parser.add_argument("--seed", type=int, default=0, help="the random weights' seed")
    args = parser.parse_args()
    print(f"wrote {write_debug_folder(args.out, args.seed)}")


if __name__ == "__main__":
    main()
