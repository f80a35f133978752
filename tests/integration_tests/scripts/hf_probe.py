"""Run under torchrun: build our Llama 3 from a Hugging Face folder's config.json, parallelize
it with the layout given on the command line, load the safetensors through the state-dict
adapter, write the logits of fixed tokens (rank 0) and, with SAVE_DIR set, export the weights
back to Hugging Face format."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan.components.hf_checkpoint import load_hf_weights, save_hf_weights
from torchtitan.config import ConfigManager
from torchtitan.distributed.parallel_dims import parallel_dims_from_config
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter, from_hf_config
from torchtitan.protocols import get_train_spec


def main() -> None:
    hf_dir, out_dir = os.environ["HF_DIR"], os.environ["OUT_DIR"]
    config = ConfigManager().parse_args(sys.argv[1:] + ["--training.mixed_precision_param", "float32"])
    dist.init_process_group("gloo")
    parallel_dims = parallel_dims_from_config(config, dist.get_world_size())
    spec = get_train_spec("llama3")
    args = from_hf_config(json.load(open(os.path.join(hf_dir, "config.json"))))
    with torch.device("meta"):
        model = spec.model_cls(args)
    model = spec.parallelize_fn(model, parallel_dims, config)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)  # overwritten by the load; also computes the RoPE table
    adapter = Llama3StateDictAdapter(args)
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
    dist.barrier()  # leave together (see torchtitan/train.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
