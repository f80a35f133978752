"""Which causal LMs of the installed transformers the hf backend (``model.name = "hf"``)
trains: every architecture of transformers' causal-LM registry on a tiny random config
(hidden 64, 2 layers, 4 heads of 16, 2 KV heads; MoE: 4 experts, top 2; multi-head latent
attention: ranks 32, rotary and value heads of 16), each column one check::

    python scripts/hf_compat.py --output benchmarks/hf_compat.md

- logits: our model's logits (fp32) equal transformers' own (eager attention, our weights
  loaded into it) within 1e-5 on 2 x 40 random tokens, and so does every parameter's gradient
  of their next-token cross-entropy (1e-5 absolute, 1e-4 relative);
- fsdp2 / tp2 / cp2 / pp2 / ep2: 6 training steps under FSDP 2, TP 2, CP 2, PP 2 and (MoE)
  EP 2 x FSDP 2 (torchrun, gloo) give the per-step loss and grad norm of 1 process within
  1e-4 (relative);
- compile: the decoder layers compiled one by one (as ``compile.enable`` does; backend
  ``--compile-backend``, default inductor) give the eager model's logits (1e-5) and
  gradients (1e-4);
- lora: LoRA adapters on every linear of the decoder layers and on an untied lm_head (B
  drawn non-zero), exported as a PEFT adapter, give our logits when PEFT loads them onto
  transformers' model (1e-5). For the MoE model types whose adapters PEFT converts from
  transformers 4's layout, the names it maps to the stacked experts (``gate_proj``,
  ``up_proj``, ``down_proj``) are left out: PEFT would load a shared expert's adapter onto
  the experts.

A cell says ``pass``, ``FAIL`` or ``refused`` (with the first line of the error or of our
one-line refusal below the table), ``-`` (not run: the logits failed) or ``n/a`` (ep2 of a
dense model). Architectures whose config does not shrink to under 20M parameters with these
fields (other field names) or does not build at all are left out.

``--update`` reruns the named ``--columns`` (and ``--only`` architectures) inside an
existing table and keeps its other cells.
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
MLA = {
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "num_key_value_heads": 4,
}
"""Multi-head latent attention's fields (configs with ``kv_lora_rank``): its rotary part is
``head_dim`` wide and it keeps one key/value head per query head."""
STEPS = 6
RTOL = 1e-4


def write_folder(root: Path, model_type: str, **overrides: Any) -> Path:
    """``root/model_type``: the tiny config (``overrides`` on top) and the test tokenizer."""
    from transformers import AutoConfig

    folder = root / model_type
    latent = "kv_lora_rank" in AutoConfig.for_model(model_type).to_dict()
    fields = {**TINY, **(MLA if latent else {}), **overrides}
    AutoConfig.for_model(model_type, **fields).save_pretrained(folder)
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


TOKENS = torch.randint(3, 2000, (2, 40), generator=torch.Generator().manual_seed(0))


def logits_check(folder: Path) -> None:
    """Our logits and every parameter's gradient equal transformers' (same weights)."""
    model = build_model(folder)
    reference = transformers_model(folder, model)
    ours, our_grads = logits_and_gradients(model)
    theirs, their_grads = logits_and_gradients(reference, lambda out: out.logits)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    assert our_grads.keys() == their_grads.keys(), "the gradients differ in names"
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def logits_and_gradients(
    model: torch.nn.Module, logits_of: Callable[[Any], torch.Tensor] = lambda out: out
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The logits of ``TOKENS`` and the gradients of their next-token cross-entropy."""
    logits = logits_of(model(TOKENS))
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), TOKENS[:, 1:].flatten())
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def compile_check(folder: Path, backend: str) -> None:
    from torchtitan.tools.compile import compile_blocks

    torch._dynamo.reset()  # the previous architectures' graphs would count as recompiles
    eager, compiled = build_model(folder), build_model(folder)
    compile_blocks(compiled.layers, backend, prefix=f"{compiled.base_prefix}.layers")
    (logits, grads), (compiled_logits, compiled_grads) = map(
        logits_and_gradients, (eager, compiled)
    )
    torch.testing.assert_close(compiled_logits, logits, rtol=0, atol=1e-5)
    assert compiled_grads.keys() == grads.keys(), "the compiled model's gradients differ in names"
    for name, grad in grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def peft_expert_names(model_type: str) -> set[str]:
    """The target names PEFT reads as the stacked experts' for this model type (its
    conversion of adapters saved under transformers 4), whatever linear they name: an adapter
    on a shared expert's ``down_proj`` would load onto the experts instead."""
    from peft.utils import transformers_weight_conversion as conversion

    base = conversion._MODEL_TO_CONVERSION_PATTERN.get(model_type)
    return set(conversion._MOE_TARGET_MODULE_MAPPING.get(base, {}))


def lora_check(folder: Path, root: Path) -> None:
    from peft import PeftModel

    from torchtitan.components.adapters.lora import LoRAConverter
    from torchtitan.components.checkpointing.peft import save_peft_adapter
    from torchtitan.config import LoRAConfig
    from torchtitan.models.hf.state_dict_adapter import HFStateDictAdapter

    base = build_model(folder)
    linears = {
        name.rsplit(".", 1)[-1]
        for name, module in base.layers.named_modules()
        if type(module) is torch.nn.Linear
    } - peft_expert_names(base.model_args.hf_config.model_type)
    output = [] if base.tied else ["lm_head"]
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=sorted(linears) + output)
    ours = build_model(folder, convert=LoRAConverter(lora, None).convert)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if name.endswith("lora_b"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    adapter = root / f"{folder.name}_adapter"
    save_peft_adapter([ours], adapter, HFStateDictAdapter(ours.model_args), lora)
    theirs = PeftModel.from_pretrained(transformers_model(folder, base), adapter).eval()
    with torch.no_grad():
        logits = theirs(TOKENS).logits
        torch.testing.assert_close(ours(TOKENS), logits, rtol=0, atol=1e-5)
        assert (base(TOKENS) - logits).abs().max() > 1e-3, "the adapters change nothing"


class Refused(Exception):
    """A run stopped by our one-line refusal (``error: ...``)."""


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
        ours = [line for line in output if line.startswith("error: ")]
        if ours:
            raise Refused(ours[-1].removeprefix("error: "))
        lines = [line for line in output if "Error" in line]
        raise RuntimeError(lines[-1] if lines else f"exit {run.returncode}")
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def same(reference: list[dict], other: list[dict]) -> None:
    for ref, run in zip(reference, other, strict=True):
        for key in ("loss", "grad_norm"):
            if abs(run[key] - ref[key]) > RTOL * abs(ref[key]):
                raise AssertionError(f"step {ref['step']}: {key} {run[key]} vs {ref[key]}")


def check(name: str, fn: Callable[[], Any], errors: dict[str, str]) -> str:
    """``pass``, ``refused`` (our one-line refusal) or ``FAIL``; the first line of what
    stopped it goes to ``errors[name]``."""
    from torchtitan.config.errors import ConfigError

    errors.pop(name, None)
    try:
        fn()
        return "pass"
    except Exception as e:  # a table of what fails is the point: record the first line
        errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:240] if str(e) else ''}"
        return "refused" if isinstance(e, (Refused, ConfigError)) else "FAIL"


MAX_PARAMETERS = 20_000_000
"""A config whose size fields have other names than the tiny ones keeps its default size
(billions of parameters): such an architecture is left out rather than built."""

COLUMNS = ("logits", "fsdp2", "tp2", "cp2", "pp2", "ep2", "compile", "lora")
LAYOUTS = {
    "fsdp2": (2, []),
    "tp2": (1, ["--parallelism.tensor_parallel_degree", "2"]),
    "cp2": (1, ["--parallelism.context_parallel_degree", "2"]),
    "pp2": (1, ["--parallelism.pipeline_parallel_degree", "2"]),
    "ep2": (2, ["--parallelism.expert_parallel_degree", "2"]),
}
"""The trained columns: (data-parallel degree, flags) of each 2-process run."""


def tiny_parameters(folder: Path) -> int:
    """transformers' model of ``folder`` built on the meta device: its parameter count."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**json.loads((folder / "config.json").read_text()))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def architecture_cells(
    model_type: str,
    root: Path,
    args: argparse.Namespace,
    cells: dict[str, str],
    errors: dict[str, str],
) -> bool:
    """Run ``args.columns`` of one architecture into ``cells`` (False: no tiny config of this
    shape builds). A column other than logits runs only where the logits pass."""
    try:
        folder = write_folder(root, model_type)
        if tiny_parameters(folder) > MAX_PARAMETERS:
            return False
    except Exception:  # e.g. an encoder-decoder's config: not an architecture we claim
        return False
    moe = is_moe(model_type)
    cells["kind"] = "MoE" if moe else "dense"
    reference: list[dict] = []

    def trained(name: str) -> None:
        if not reference:
            reference.extend(train(folder, root / f"{model_type}_1", 1, 1, []))
        dp, extra = LAYOUTS[name]
        same(reference, train(folder, root / f"{model_type}_{name}", 2, dp, extra))

    for column in args.columns:
        errors.pop(f"{model_type} {column}", None)
        if column == "logits":
            cells[column] = check(f"{model_type} logits", lambda: logits_check(folder), errors)
        elif column == "ep2" and not moe:
            cells[column] = "n/a"
        elif cells.get("logits") != "pass":
            cells[column] = "-"
        elif column == "compile":
            cells[column] = check(
                f"{model_type} compile", lambda: compile_check(folder, args.compile_backend), errors
            )
        elif column == "lora":
            cells[column] = check(f"{model_type} lora", lambda: lora_check(folder, root), errors)
        else:
            cells[column] = check(
                f"{model_type} {column}", lambda column=column: trained(column), errors
            )
    return True


def row(model_type: str, cells: dict[str, str]) -> str:
    values = [model_type, cells["kind"], *(cells.get(column, "?") for column in COLUMNS)]
    return "| " + " | ".join(values) + " |"


def read_table(path: Path) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """An earlier table's cells per architecture and its errors (``--update``)."""
    lines = path.read_text().splitlines()
    header = next(line for line in lines if line.startswith("| model_type |"))
    names = [cell.strip() for cell in header.strip("|").split("|")]
    table = {}
    for line in lines[lines.index(header) + 2 :]:
        if not line.startswith("| "):
            break
        values = dict(
            zip(names, (cell.strip() for cell in line.strip("|").split("|")), strict=True)
        )
        table[values.pop("model_type")] = values
    errors = dict(
        line[2:].split(": ", 1)
        for line in lines[lines.index("## First error line of each failure") + 2 :]
        if line.startswith("- ")
    )
    return table, errors


def render(table: dict[str, dict[str, str]], errors: dict[str, str], update: bool) -> str:
    import transformers

    passing = [
        cells
        for cells in table.values()
        if all(cells.get(column) in ("pass", "n/a") for column in COLUMNS)
    ]
    dense = sum(cells["kind"] == "dense" for cells in passing)
    updated = (
        [f"- updated by `python scripts/hf_compat.py {' '.join(sys.argv[1:])}`"] if update else []
    )
    lines = [
        "# The hf backend's architectures",
        "",
        "- command: `python scripts/hf_compat.py --output benchmarks/hf_compat.md`",
        *updated,
        f"- transformers {transformers.__version__}, torch {torch.__version__}, Python "
        f"{platform.python_version()}, {os.cpu_count()} CPU cores, "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        f"- {len(table)} architectures build a tiny config; {len(passing)} pass every column "
        f"({dense} dense, {len(passing) - dense} MoE)",
        "",
        "| model_type | kind | " + " | ".join(COLUMNS) + " |",
        "| --- " * (len(COLUMNS) + 2) + "|",
        *(row(model_type, table[model_type]) for model_type in sorted(table)),
        "",
        "## First error line of each failure",
        "",
        *(f"- {name}: {errors[name]}" for name in sorted(errors)),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, help="write the markdown table here")
    parser.add_argument("--only", nargs="*", help="these model types (default: every causal LM)")
    parser.add_argument("--columns", nargs="*", choices=COLUMNS, default=list(COLUMNS))
    parser.add_argument("--compile-backend", default="inductor", help="the compile column's")
    parser.add_argument(
        "--update", action="store_true", help="rerun the columns inside the --output table"
    )
    args = parser.parse_args()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    table, errors = read_table(args.output) if args.update else ({}, {})
    model_types = args.only or (sorted(table) if args.update else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    with tempfile.TemporaryDirectory(prefix="hf_compat_") as tmp:
        for model_type in sorted(model_types):
            cells = table.get(model_type, {})
            if architecture_cells(model_type, Path(tmp), args, cells, errors):
                table[model_type] = cells
                print(row(model_type, cells), flush=True)
    text = render(table, errors, args.update)
    if args.output:
        args.output.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
