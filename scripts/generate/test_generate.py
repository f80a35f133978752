"""Generate text from a DCP checkpoint of a model trained with torchtitan.

    python scripts/generate/test_generate.py --config train_configs/debug_model.toml \
        --checkpoint outputs/checkpoint/step-200 --prompt "def main(" --max_new_tokens 64

The model (train spec, flavor, tokenizer) comes from the job config; options this script
does not know (``--model.flavor debugmodel_tiny``, ...) override the config. Under torchrun
with N processes the model is tensor-parallel over N ranks
(``scripts/generate/run_llama_generate.sh``; Llama 3 only). ``--temperature 0`` is greedy
decoding; the same ``--seed`` gives the same text. ``--out F.json`` also writes the result as
JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.config.entry import config_errors_exit, exit_on_user_error  # noqa: E402
from torchtitan.distributed.data_parallel import TORCH_DTYPES  # noqa: E402
from torchtitan.distributed.parallel_dims import default_device_type  # noqa: E402
from torchtitan.distributed.process import init_distributed, run_worker_entry_point  # noqa: E402
from torchtitan.generation import CheckpointError, generate, load_model_weights  # noqa: E402
from torchtitan.generation.tensor_parallel import apply_tp_minus_sp  # noqa: E402
from torchtitan.preflight import preflight  # noqa: E402
from torchtitan.protocols import get_train_spec  # noqa: E402
from torchtitan.recipe import model_args_from_config  # noqa: E402
from torchtitan.tools.logging import init_logger, logger  # noqa: E402


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", required=True, help="job config TOML the model was trained with"
    )
    parser.add_argument(
        "--checkpoint", required=True, help="DCP checkpoint folder (or a folder of step-<N> ones)"
    )
    parser.add_argument("--prompt", default="", help="text to continue (BOS is prepended)")
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top_k", type=int, default=None)
    parser.add_argument(
        "--top_p",
        type=float,
        default=1.0,
        help="nucleus sampling: the smallest set of tokens "
        "whose probability reaches top_p (1: all)",
    )
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--batch_size", type=int, default=1, help="samples of the same prompt")
    parser.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="float32")
    parser.add_argument(
        "--no_kv_cache", action="store_true", help="re-run the whole sequence every token"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="also write the result to this JSON file"
    )
    args, config_overrides = parser.parse_known_args(argv)
    if args.max_new_tokens < 1:
        parser.error("--max_new_tokens must be >= 1")
    if args.batch_size < 1:
        parser.error("--batch_size must be >= 1")
    return args, config_overrides


def load_job_config(args: argparse.Namespace, overrides: list[str], world_size: int):
    """The training config, with tensor parallel over every process (the config refuses
    tensor_parallel_degree > 1 where TP is not supported)."""
    argv = ["--job.config_file", args.config, *overrides]
    if world_size > 1:
        argv += [
            "--parallelism.tensor_parallel_degree",
            str(world_size),
            "--parallelism.data_parallel_shard_degree",
            "1",
            "--parallelism.data_parallel_replicate_degree",
            "1",
        ]
    return ConfigManager().parse_args(argv)


def build_model(
    job_config, tokenizer, max_len: int, dtype: torch.dtype, device: torch.device, world_size: int
) -> torch.nn.Module:
    """The model with parameters in ``dtype``; ``init_weights`` recomputes the RoPE table in
    fp32, as in training (DCP converts the checkpoint's weights to ``dtype`` on load)."""
    spec = get_train_spec(job_config.model.name)
    model_args = model_args_from_config(spec, job_config, tokenizer)
    model_args.max_seq_len = max(model_args.max_seq_len, max_len)
    with torch.device("meta"):
        model = spec.model_cls(model_args).to(dtype)
    if world_size > 1:
        parallel_dims = preflight(job_config, world_size, device.type)
        apply_tp_minus_sp(model, parallel_dims.world_mesh["tp"])
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(seed=0)  # RoPE tables and buffers; the weights come from the checkpoint
    return model.eval()


def run(args: argparse.Namespace, overrides: list[str]) -> dict:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    job_config = load_job_config(args, overrides, world_size)
    device = (
        init_distributed(job_config.comm, job_config.job.dump_folder)
        if world_size > 1
        else torch.device(default_device_type())
    )
    spec = get_train_spec(job_config.model.name)
    tokenizer = spec.build_tokenizer_fn(job_config.model)
    prompt_ids = tokenizer.encode(args.prompt, add_bos=True, add_eos=False)
    model = build_model(
        job_config,
        tokenizer,
        len(prompt_ids) + args.max_new_tokens,
        TORCH_DTYPES[args.dtype],
        device,
        world_size,
    )
    folder = load_model_weights(model, args.checkpoint)
    logger.info(f"loaded {job_config.model.name} {job_config.model.flavor} from {folder}")

    prompt = torch.tensor([prompt_ids] * args.batch_size, dtype=torch.long, device=device)
    start = time.perf_counter()
    tokens = generate(
        model,
        prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_ids=() if tokenizer.eos_id is None else (tokenizer.eos_id,),
        use_kv_cache=not args.no_kv_cache,
    )
    seconds = time.perf_counter() - start
    samples = [_sample(row[len(prompt_ids) :].tolist(), tokenizer) for row in tokens]
    return {
        "checkpoint": str(folder),
        "prompt": args.prompt,
        "seed": args.seed,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "max_new_tokens": args.max_new_tokens,
        "kv_cache": not args.no_kv_cache,
        "samples": samples,
        "seconds": seconds,
        "tokens_per_second": sum(len(s["tokens"]) for s in samples) / seconds,
    }


def _sample(new_tokens: list[int], tokenizer) -> dict:
    """The generated tokens up to (without) the first EOS, and their text."""
    if tokenizer.eos_id in new_tokens:
        new_tokens = new_tokens[: new_tokens.index(tokenizer.eos_id)]
    return {"tokens": new_tokens, "text": tokenizer.decode(new_tokens)}


@config_errors_exit
def main(argv: list[str] | None = None) -> None:
    init_logger()
    args, overrides = parse_args(argv)
    try:
        result = run(args, overrides)
    except CheckpointError as e:
        exit_on_user_error(str(e))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) != 0:
        return
    for i, sample in enumerate(result["samples"]):
        print(f"--- sample {i} ({len(sample['tokens'])} tokens)\n{args.prompt}{sample['text']}")
    logger.info(f"{result['tokens_per_second']:.1f} tokens/s")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    run_worker_entry_point(main)
