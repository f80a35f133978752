"""Run under torchrun: parallelize the tiny Llama 3 with the layout given on the command
line, initialise it, and check that every parameter's full value equals the 1-process
init. Writes {OUT_DIR}/rank{r}.txt with "ok" or the first mismatching FQN."""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan.config import ConfigManager
from torchtitan.distributed.parallel_dims import parallel_dims_from_config
from torchtitan.distributed.process import exit_skipping_static_destructors, leave_together
from torchtitan.layers.init import clean_fqn
from torchtitan.protocols import get_train_spec
from torchtitan.recipe import parallelize_settings


def main() -> None:
    config = ConfigManager().parse_args(
        sys.argv[1:]
        + ["--model.flavor", "debugmodel_tiny", "--training.mixed_precision_param", "float32"]
    )
    dist.init_process_group("gloo")
    parallel_dims = parallel_dims_from_config(
        config.parallelism, config.fault_tolerance, dist.get_world_size()
    )
    spec = get_train_spec("llama3")
    args = spec.flavor_args("debugmodel_tiny")

    reference = spec.model_cls(args)
    reference.init_weights(seed=3)
    expected = dict(reference.named_parameters())

    with torch.device("meta"):
        model = spec.model_cls(args)
    if parallel_dims.pp_enabled:
        settings = parallelize_settings(config)
        parts = spec.pipelining_fn(
            model,
            parallel_dims,
            config.parallelism,
            config.training.local_batch_size,
            torch.device("cpu"),
            lambda stage: spec.parallelize_fn(stage, parallel_dims, **settings),
            None,
        ).model_parts
    else:
        parts = [spec.parallelize_fn(model, parallel_dims, **parallelize_settings(config))]
    result, sharded, count = "ok", 0, 0
    for part in parts:
        part.to_empty(device="cpu")
        with torch.no_grad():
            part.init_weights(seed=3)
        for name, param in part.named_parameters():
            full = param.full_tensor() if isinstance(param, DTensor) else param
            sharded += isinstance(param, DTensor)
            count += 1
            if not torch.equal(full.detach(), expected[clean_fqn(name)].detach()):
                result = f"mismatch {name}"
    if result == "ok" and sharded == 0 and not parallel_dims.pp_enabled:
        result = "no parameter was sharded"
    if result == "ok" and parallel_dims.pp_enabled and count >= len(expected):
        result = "a pipeline stage holds the whole model"
    with open(os.path.join(os.environ["OUT_DIR"], f"rank{dist.get_rank()}.txt"), "w") as f:
        f.write(result)
    leave_together()


if __name__ == "__main__":
    main()
    exit_skipping_static_destructors(0)
