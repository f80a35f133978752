"""Which causal LMs of the installed transformers the hf backend (``model.name = "hf"``)
trains: every architecture of transformers' causal-LM registry on a tiny random config
(hidden 64, 2 layers, 4 heads of 16, 2 KV heads; MoE: 4 experts, top 2), each column one
check::

    python scripts/hf_compat.py --output benchmarks/hf_compat.md

- logits: our model's logits (fp32) equal transformers' own (eager attention, our weights
  loaded into it) within 1e-5 on 2 x 40 random tokens;
- fsdp2 / tp2 / ep2: 6 training steps under FSDP 2, TP 2 and (MoE) EP 2 x FSDP 2 (torchrun,
  gloo) give the per-step loss and grad norm of 1 process within 1e-4 (relative); only for
  architectures whose logits pass.

A cell says ``pass``, ``FAIL`` (with the first line of the error below the table), ``-`` (not
run: the logits failed) or ``n/a`` (ep2 of a dense model). Architectures whose config does not
shrink to under 20M parameters with these fields (other field names) or does not build at all
are left out. Context and pipeline parallel (and PP 2 x EP 2) are checked on Gemma 3 and
Mixtral by the tests only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "scripts" / "bench" / "upstream_test_tokenizer"
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 2048,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    # MoE fields under the names the configs use (ignored by dense ones)
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}
STEPS = 6
RTOL = 1e-4


def write_folder(root: Path, model_type: str, **overrides: Any) -> Path:
    """``root/model_type``: the tiny config (``overrides`` on top) and the test tokenizer."""
    from transformers import AutoConfig

    folder = root / model_type
    AutoConfig.for_model(model_type, **{**TINY, **overrides}).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, folder / name)
    return folder


def is_moe(model_type: str) -> bool:
    """Whether the architecture's default config has routed experts."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type).get_text_config()
    return any(
        getattr(config, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts")
    )


def build_model(
    folder: Path,
    *flags: str,
    seed: int = 0,
    convert: Callable[[torch.nn.Module], None] | None = None,
) -> torch.nn.Module:
    """The hf backend's model of ``folder`` on the CPU, initialised from ``seed``, in eval
    mode; ``flags``: more trainer flags (the attention kernel and mask); ``convert``: applied
    to the model on meta before it is initialised (a converter, e.g. LoRA)."""
    from torchtitan.config import ConfigManager
    from torchtitan.protocols.train_spec import get_train_spec

    config = ConfigManager().parse_args(
        ["--model.name", "hf", "--model.flavor", "full", "--model.hf_assets_path", str(folder)]
        + list(flags)
    )
    spec = get_train_spec("hf")
    args = spec.flavor_args("full")
    args.update_from_config(config.model, max_seq_len=64)
    with torch.device("meta"):
        model = spec.model_cls(args)
    if convert is not None:
        convert(model)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model.eval()


def transformers_model(folder: Path, model: torch.nn.Module) -> torch.nn.Module:
    """transformers' own model of ``folder`` (eager attention) holding ``model``'s weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**json.loads((folder / "config.json").read_text()))
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    result = reference.load_state_dict(model.state_dict(), strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise AssertionError(f"state dicts differ: {result}")
    return reference


def logits_check(folder: Path) -> None:
    model = build_model(folder)
    tokens = torch.randint(3, 2000, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens), transformers_model(folder, model)(tokens).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def train(folder: Path, dump: Path, nproc: int, dp: int, extra: list[str]) -> list[dict]:
    cmd = [
        sys.executable,
        *("-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"),
        *("-m", "torchtitan.train"),
        *("--model.name", "hf", "--model.flavor", "full", "--model.hf_assets_path", str(folder)),
        *("--training.seq_len", "64", "--training.global_batch_size", "8"),
        *("--training.local_batch_size", str(8 // dp), "--training.steps", str(STEPS)),
        *("--training.mixed_precision_param", "float32", "--training.data_shards", "8"),
        *("--optimizer.lr", "3e-3", "--metrics.log_freq", "1", "--debug.seed", "7"),
        *("--job.dump_folder", str(dump), *extra),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        output = (run.stdout + run.stderr).splitlines()
        ours = [line for line in output if line.startswith("error: ")]  # a one-line refusal
        lines = ours or [line for line in output if "Error" in line]
        raise RuntimeError(lines[-1] if lines else f"exit {run.returncode}")
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def same(reference: list[dict], other: list[dict]) -> None:
    for ref, run in zip(reference, other, strict=True):
        for key in ("loss", "grad_norm"):
            if abs(run[key] - ref[key]) > RTOL * abs(ref[key]):
                raise AssertionError(f"step {ref['step']}: {key} {run[key]} vs {ref[key]}")


def check(name: str, fn, errors: dict[str, str]) -> str:
    try:
        fn()
        return "pass"
    except Exception as e:  # a table of what fails is the point: record the first line
        errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:240] if str(e) else ''}"
        return "FAIL"


MAX_PARAMETERS = 20_000_000
"""A config whose size fields have other names than the tiny ones keeps its default size
(billions of parameters): such an architecture is left out rather than built."""


def tiny_parameters(folder: Path) -> int:
    """transformers' model of ``folder`` built on the meta device: its parameter count."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**json.loads((folder / "config.json").read_text()))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def architecture_row(model_type: str, root: Path, errors: dict[str, str]) -> str | None:
    """The table row of one architecture (None: no tiny config of this shape builds)."""
    try:
        folder = write_folder(root, model_type)
        if tiny_parameters(folder) > MAX_PARAMETERS:
            return None
    except Exception:  # e.g. an encoder-decoder's config: not an architecture we claim
        return None
    logits = check(f"{model_type} logits", lambda: logits_check(folder), errors)
    moe = is_moe(model_type)
    cells = ["-", "-", "-" if moe else "n/a"]
    reference: list[dict] = []
    if (
        logits == "pass"
        and check(
            f"{model_type} 1 process",
            lambda: reference.extend(train(folder, root / f"{model_type}_1", 1, 1, [])),
            errors,
        )
        == "pass"
    ):
        layouts = {"fsdp2": (2, []), "tp2": (1, ["--parallelism.tensor_parallel_degree", "2"])}
        if moe:
            layouts["ep2"] = (2, ["--parallelism.expert_parallel_degree", "2"])
        cells = [
            check(
                f"{model_type} {name}",
                lambda name=name, dp=dp, extra=extra: same(
                    reference, train(folder, root / f"{model_type}_{name}", 2, dp, extra)
                ),
                errors,
            )
            for name, (dp, extra) in layouts.items()
        ] + ([] if moe else ["n/a"])
    kind = "MoE" if moe else "dense"
    return f"| {model_type} | {kind} | {logits} | " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", help="write the markdown table here")
    parser.add_argument("--only", nargs="*", help="these model types (default: every causal LM)")
    args = parser.parse_args()
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    rows, errors = [], {}
    with tempfile.TemporaryDirectory(prefix="hf_compat_") as tmp:
        for model_type in args.only or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
            row = architecture_row(model_type, Path(tmp), errors)
            if row is not None:
                rows.append(row)
                print(row, flush=True)
    passing = [r for r in rows if "FAIL" not in r and "| - |" not in r]
    dense = sum("| dense |" in r for r in passing)
    lines = [
        "# The hf backend's architectures",
        "",
        f"- command: `python scripts/hf_compat.py {' '.join(sys.argv[1:])}`",
        f"- transformers {transformers.__version__}, torch {torch.__version__}, Python "
        f"{platform.python_version()}, {os.cpu_count()} CPU cores, "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        f"- {len(rows)} architectures build a tiny config; {len(passing)} pass every column "
        f"({dense} dense, {len(passing) - dense} MoE)",
        "",
        "| model_type | kind | logits | fsdp2 | tp2 | ep2 |",
        "| --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
        "## First error line of each failure",
        "",
        *(f"- {name}: {error}" for name, error in errors.items()),
    ]
    text = "\n".join(lines) + "\n"
    if args.output:
        Path(args.output).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
