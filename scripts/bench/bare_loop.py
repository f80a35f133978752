"""The bare PyTorch training loop the trainer is measured against: one process, the same
model class and flavor, the same batches, AdamW with the same settings and learning-rate
schedule (a LambdaLR of the same factors), autocast to the same dtype, the same blocks under
torch's activation checkpointing, clip_grad_norm_ and one host sync per step (the loss) --
and nothing else. Same inputs, same numbers: its losses
follow the trainer's step by step.

    python scripts/bench/bare_loop.py --job.config_file F.toml --training.steps 40 [--trace T.json]

Every option but ``--trace`` is a job-config option (read with the trainer's ConfigManager
only to pick the same model, data, optimizer and schedule). Prints one JSON object with the
time of every step; with ``--trace`` the last step is profiled (the three before it run
under the profiler's warm-up and should be left out of timings).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from torchtitan.components.optimizers.lr_schedule import configured_lr_factor  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.data.loader import build_dataloader  # noqa: E402
from torchtitan.distributed.activation_checkpoint import apply_ac, keeps_attention_output  # noqa: E402
from torchtitan.distributed.parallel_dims import default_device_type  # noqa: E402
from torchtitan.protocols import get_train_spec  # noqa: E402
from torchtitan.recipe import model_args_from_config, resolve_for_device  # noqa: E402
from torchtitan.tools.cpu_allocator import maybe_keep_freed_cpu_memory  # noqa: E402
from torchtitan.tools.dtypes import TORCH_DTYPES  # noqa: E402
from torchtitan.tools.peaks import peak_flops, peak_memory_gib  # noqa: E402

PROFILER_WARMUP = 3


def build(job_config, device: torch.device):
    """(model, optimizer, LR schedule, tokenizer, flops per token) as configured, built
    without the trainer."""
    spec = get_train_spec(job_config.model.name)
    tokenizer = spec.build_tokenizer_fn(job_config.model)
    model_args = model_args_from_config(spec, job_config, tokenizer)
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    _, flops_per_token = model_args.get_nparams_and_flops(model, job_config.training.seq_len)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(seed=job_config.debug.seed or 0)
    ac = job_config.activation_checkpoint
    apply_ac(
        model.layers,
        ac.mode,
        ac.selective_ac_option,
        ac.preserve_rng_state,
        keeps_attention_output(ac, ring_cp=False),
    )  # one process: no context parallel
    cfg = job_config.optimizer
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=cfg.implementation == "fused",
        foreach=cfg.implementation == "foreach",
    )
    return model, optimizer, _lr_schedule(optimizer, job_config), tokenizer, flops_per_token


def _lr_schedule(optimizer: torch.optim.Optimizer, job_config) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, configured_lr_factor(job_config.lr_scheduler, job_config.training.steps)
    )


def prefetch(
    job_config, tokenizer, steps: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``steps`` batches of the trainer's data loader (one process), on device."""
    batches = []
    for _, (input_dict, labels) in zip(
        range(steps), build_dataloader(job_config.training, None, tokenizer)
    ):
        batches.append((input_dict["input"].to(device), labels.to(device)))
    return batches


def train(job_config, trace: Path | None) -> dict:
    torch.manual_seed(job_config.debug.seed or 0)
    device = torch.device(default_device_type())
    # as the trainer: loops compared, not malloc or a different precision
    maybe_keep_freed_cpu_memory(job_config.training.cpu_keep_freed_memory, device)
    resolve_for_device(job_config, device.type)
    dtype = TORCH_DTYPES[job_config.training.mixed_precision_param]
    steps = job_config.training.steps
    model, optimizer, lr_schedule, tokenizer, flops_per_token = build(job_config, device)
    batches = prefetch(job_config, tokenizer, steps, device)
    autocast = (
        contextlib.nullcontext()
        if dtype == torch.float32
        else torch.autocast(device.type, dtype=dtype)
    )
    max_norm = job_config.training.max_norm
    step_times, losses = [], []
    with _profiler(steps, trace) as profiler:
        for inputs, labels in batches:
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            with autocast:
                pred = model(inputs)
                loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
            del pred
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
            optimizer.step()
            lr_schedule.step()
            losses.append(loss.item())
            step_times.append(time.perf_counter() - start)
            if profiler is not None:
                profiler.step()
    return {
        "step_times": step_times,
        "losses": losses,
        "tokens_per_step": batches[0][1].numel(),
        "flops_per_token": flops_per_token,
        "peak_flops": peak_flops(device, dtype).flops,
        "memory_gib": peak_memory_gib(device),
        "threads": torch.get_num_threads(),
    }


@contextlib.contextmanager
def _profiler(steps: int, trace: Path | None):
    """Profile the last step (the trainer's profiling schedule with profile_freq = steps)."""
    if trace is None:
        yield None
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(
        wait=steps - PROFILER_WARMUP - 1, warmup=PROFILER_WARMUP, active=1
    )
    trace.parent.mkdir(parents=True, exist_ok=True)
    with torch.profiler.profile(
        activities=activities,
        schedule=schedule,
        record_shapes=True,
        on_trace_ready=lambda prof: prof.export_chrome_trace(str(trace)),
    ) as prof:
        yield prof


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=None, help="chrome trace of the last step")
    args, config_args = parser.parse_known_args(argv)
    job_config = ConfigManager().parse_args(config_args)
    if args.trace is not None and job_config.training.steps < PROFILER_WARMUP + 2:
        parser.error(f"training.steps must be >= {PROFILER_WARMUP + 2} with --trace")
    print(json.dumps(train(job_config, args.trace)))


if __name__ == "__main__":
    main()
