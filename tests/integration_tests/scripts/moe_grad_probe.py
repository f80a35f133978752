"""Run under torchrun (gloo): for each layout in $LAYOUTS (";"-separated CLI override
lists), parallelize the DeepSeek-V3 debug model like the trainer does, run one fp32
forward/backward of a fixed batch split over the data-parallel ranks, and compare every
parameter's full gradient (and the clipped-norm total) with a 1-process model on the whole
batch. Loss parity alone cannot catch a wrong gradient scale on the experts (Adam is
scale-invariant and the dense gradients dominate the norm); this can. Writes
{OUT_DIR}/rank{r}.txt: one line per layout, "ok" or the first mismatch."""

import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from torchtitan.config import ConfigManager
from torchtitan.distributed.parallel_dims import parallel_dims_from_config
from torchtitan.distributed.process import (
    clip_grad_norm_,
    exit_skipping_static_destructors,
    leave_together,
)
from torchtitan.layers.init import clean_fqn
from torchtitan.protocols import get_train_spec
from torchtitan.recipe import model_args_from_config, parallelize_settings

BASE = [
    "--model.name",
    "deepseek_v3",
    "--model.flavor",
    "debugmodel",
    "--training.seq_len",
    "32",
    "--training.mixed_precision_param",
    "float32",
]
BATCH, SEED, RTOL = 8, 3, 1e-5


def build(overrides: list[str]):
    config = ConfigManager().parse_args(BASE + overrides)
    spec = get_train_spec("deepseek_v3")
    args = model_args_from_config(spec, config, None)
    return config, spec, args


def reference_grads(overrides: list[str], tokens: torch.Tensor) -> tuple[dict, float]:
    _, spec, args = build(overrides)
    model = spec.model_cls(args)
    model.init_weights(seed=SEED)
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return grads, torch.nn.utils.get_total_norm(list(grads.values())).item()


def parallel_grads(overrides: list[str], tokens: torch.Tensor) -> tuple[dict, float]:
    config, spec, args = build(overrides)
    dims = parallel_dims_from_config(
        config.parallelism, config.fault_tolerance, dist.get_world_size()
    )
    with torch.device("meta"):
        model = spec.model_cls(args)
    model = spec.parallelize_fn(model, dims, **parallelize_settings(config))
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(seed=SEED)
    dp = dims.world_mesh["dp"] if dims.dp_enabled else None
    rank, size = (dp.get_local_rank(), dp.size()) if dp is not None else (0, 1)
    mine = tokens[rank * BATCH // size : (rank + 1) * BATCH // size]
    with loss_parallel() if dims.tp_enabled else contextlib.nullcontext():
        F.cross_entropy(model(mine[:, :-1]).flatten(0, 1), mine[:, 1:].flatten()).backward()
    grads = {}
    for name, p in model.named_parameters():
        grads[clean_fqn(name)] = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
    norm = clip_grad_norm_(list(model.parameters()), max_norm=1e9).item()
    return grads, norm


def compare(overrides: list[str], tokens: torch.Tensor) -> str:
    expected, expected_norm = reference_grads(overrides, tokens)
    got, norm = parallel_grads(overrides, tokens)
    for name, grad in expected.items():
        error = ((got[name] - grad).norm() / grad.norm()).item()
        if not error < RTOL:
            return f"{' '.join(overrides)}: {name} gradient off by {error:.2e} (relative)"
    if abs(norm - expected_norm) > RTOL * expected_norm:
        return f"{' '.join(overrides)}: total grad norm {norm} vs {expected_norm}"
    return "ok"


def main() -> None:
    dist.init_process_group("gloo")
    tokens = torch.randint(0, 264, (BATCH, 33), generator=torch.Generator().manual_seed(1))
    results = [compare(layout.split(), tokens) for layout in os.environ["LAYOUTS"].split(";")]
    with open(os.path.join(os.environ["OUT_DIR"], f"rank{dist.get_rank()}.txt"), "w") as f:
        f.write("\n".join(results))
    leave_together()


if __name__ == "__main__":
    main()
    exit_skipping_static_destructors(0)
