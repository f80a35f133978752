"""Convert a DCP checkpoint folder (step-N) into Hugging Face safetensors + config.json.

    python scripts/checkpoint_conversion/convert_to_hf.py CHECKPOINT_DIR OUT_DIR \\
        --job.config_file train_configs/debug_model.toml [--dtype bfloat16] [config overrides]

The model (name, flavor, tokenizer) comes from the job config that trained it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from torchtitan.components.checkpointing.huggingface import HFCheckpointError, save_hf_weights
from torchtitan.components.checkpointing.safe_loading import METADATA_FILE, LoadError, load_dcp
from torchtitan.config import ConfigError
from torchtitan.config.entry import config_errors_exit

sys.path.insert(0, str(Path(__file__).parent))
from common import build_cpu_model  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@config_errors_exit
def convert_to_hf(checkpoint: str, out: str, dtype: str, config_args: list[str]) -> None:
    if not (Path(checkpoint) / METADATA_FILE).is_file():
        raise ConfigError(
            f"CHECKPOINT_DIR: {checkpoint} is not a DCP checkpoint folder (no .metadata)"
        )
    model, spec, args = build_cpu_model(config_args)
    try:
        load_dcp(
            model.state_dict(),
            checkpoint,
            hint="; pass the job config (model.flavor, tokenizer) that trained it",
        )
    except LoadError as e:
        raise ConfigError(f"CHECKPOINT_DIR: {e}") from None
    try:
        save_hf_weights(
            [model], out, spec.state_dict_adapter(args), DTYPES[dtype], None, field="model.flavor"
        )
    except HFCheckpointError as e:
        raise ConfigError(str(e)) from None
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    known, config_args = parser.parse_known_args(argv)
    convert_to_hf(known.checkpoint, known.out, known.dtype, config_args)


if __name__ == "__main__":
    main()
