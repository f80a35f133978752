"""Run under torchrun: build our MODEL (llama3 by default, or deepseek_v3) from a Hugging Face
folder's config.json, parallelize it with the layout given on the command line, load the
safetensors through the state-dict adapter, write the logits of fixed tokens (rank 0) and,
with SAVE_DIR set, export the weights back to Hugging Face format."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan.components.checkpointing.huggingface import load_hf_weights, save_hf_weights
from torchtitan.config import ConfigManager
from torchtitan.distributed.parallel_dims import parallel_dims_from_config
from torchtitan.distributed.process import exit_skipping_static_destructors, leave_together
from torchtitan.models.deepseek_v3.state_dict_adapter import from_hf_config as deepseek_v3_args
from torchtitan.models.llama3.state_dict_adapter import from_hf_config as llama3_args
from torchtitan.protocols import get_train_spec
from torchtitan.recipe import parallelize_settings

ARGS_FROM_HF_CONFIG = {"llama3": llama3_args, "deepseek_v3": deepseek_v3_args}


def main() -> None:
    hf_dir, out_dir = os.environ["HF_DIR"], os.environ["OUT_DIR"]
    name = os.environ.get("MODEL", "llama3")
    config = ConfigManager().parse_args(
        sys.argv[1:] + ["--model.name", name, "--training.mixed_precision_param", "float32"]
    )
    dist.init_process_group("gloo")
    parallel_dims = parallel_dims_from_config(
        config.parallelism, config.fault_tolerance, dist.get_world_size()
    )
    spec = get_train_spec(name)
    hf_config = json.load(open(os.path.join(hf_dir, "config.json")))
    args = ARGS_FROM_HF_CONFIG[name](hf_config)
    args.max_seq_len = hf_config["max_position_embeddings"]
    with torch.device("meta"):
        model = spec.model_cls(args)
    model = spec.parallelize_fn(model, parallel_dims, **parallelize_settings(config))
    model.to_empty(device="cpu")
    model.init_weights(seed=0)  # overwritten by the load; also computes the RoPE table
    model.eval()
    adapter = spec.state_dict_adapter(args, None)
    load_hf_weights([model], hf_dir, adapter)
    tokens = torch.load(os.path.join(hf_dir, "tokens.pt"))
    with torch.no_grad():
        logits = model(tokens)
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    if dist.get_rank() == 0:
        torch.save(logits, os.path.join(out_dir, "logits.pt"))
    if os.environ.get("SAVE_DIR"):
        save_hf_weights([model], os.environ["SAVE_DIR"], adapter, torch.float32, parallel_dims)
    leave_together()


if __name__ == "__main__":
    main()
    exit_skipping_static_destructors(0)
