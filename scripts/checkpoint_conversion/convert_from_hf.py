"""Convert Hugging Face safetensors (+ config.json) into a DCP checkpoint folder that a run
loads with ``--checkpoint.initial_load_path OUT_DIR`` (model weights, plain FQNs).

    python scripts/checkpoint_conversion/convert_from_hf.py HF_DIR OUT_DIR \\
        --job.config_file train_configs/llama3_8b.toml [config overrides]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch.distributed.checkpoint as dcp

from torchtitan.components.checkpointing.huggingface import HFCheckpointError, load_hf_weights
from torchtitan.config import ConfigError
from torchtitan.config.entry import config_errors_exit

sys.path.insert(0, str(Path(__file__).parent))
from common import build_cpu_model  # noqa: E402


@config_errors_exit
def convert_from_hf(hf_dir: str, out: str, config_args: list[str]) -> None:
    model, spec, args = build_cpu_model(config_args)
    try:
        load_hf_weights([model], hf_dir, spec.state_dict_adapter(args), field="HF_DIR")
    except HFCheckpointError as e:
        raise ConfigError(str(e)) from None
    dcp.save(model.state_dict(), storage_writer=dcp.FileSystemWriter(out), no_dist=True)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hf_dir")
    parser.add_argument("out")
    known, config_args = parser.parse_known_args(argv)
    convert_from_hf(known.hf_dir, known.out, config_args)


if __name__ == "__main__":
    main()
