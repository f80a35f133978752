"""LoRA adapters in and out in Hugging Face PEFT's folder format (``adapter_config.json`` +
``adapter_model.safetensors``), which PEFT's ``PeftModel`` loads onto the transformers
model. The adapter tensors are read through ``safe_loading`` (safetensors only).

PEFT names an adapter after the Hugging Face module it adapts
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), so the names come from
the model's state-dict adapter. A's columns are the layer's inputs and B's rows its outputs:
the q/k RoPE row permutation of the state-dict adapter applies to B (as to the weight) and
never to A. Written by hand: PEFT itself maps only transformers modules.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.components.adapters.lora_linear import adapted_linears
from torchtitan.components.checkpointing.huggingface import copy_full_into
from torchtitan.components.checkpointing.safe_loading import LoadError, open_safetensors
from torchtitan.config.errors import ConfigError
from torchtitan.tools.logging import logger
from torchtitan.tools.storage import storage_path, writing_into

if TYPE_CHECKING:
    from torchtitan.config import LoRAConfig
    from torchtitan.protocols import StateDictAdapter

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
FIELD = "lora.peft_adapter_path"


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().to("cpu", torch.float32)


def _hf_module(adapter: StateDictAdapter, fqn: str, b: torch.Tensor) -> tuple[str, torch.Tensor]:
    """(PEFT's module path, B in Hugging Face's row order) for our linear ``fqn``."""
    ((hf_key, b_hf),) = adapter.to_hf({f"{fqn}.weight": b}).items()
    return PEFT_PREFIX + hf_key.removesuffix(".weight"), b_hf


def peft_tensors(
    linears: dict[str, nn.Module], adapter: StateDictAdapter
) -> dict[str, torch.Tensor]:
    """PEFT's ``lora_A`` / ``lora_B`` tensors (fp32, CPU) of ``linears`` (collective over
    sharded adapters: every rank calls it)."""
    out = {}
    for fqn, linear in linears.items():
        a, b = _full(linear.lora_a), _full(linear.lora_b)
        module, b_hf = _hf_module(adapter, fqn, b)
        out[f"{module}.lora_A.weight"] = a
        out[f"{module}.lora_B.weight"] = b_hf.contiguous()
    return out


def peft_config(lora: LoRAConfig, modules: list[str]) -> dict[str, Any]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "base_model_name_or_path": None,
    }


def save_peft_adapter(
    model_parts: list[nn.Module], folder: str | Path, adapter: StateDictAdapter, lora: LoRAConfig
) -> None:
    """Write this run's adapters as a PEFT folder, local or on an object store (rank 0
    writes; every rank calls)."""
    tensors = peft_tensors(adapted_linears(model_parts), adapter)
    if dist.is_initialized() and dist.get_world_size() > 1:  # pipeline stages hold parts
        gathered: list[dict[str, torch.Tensor]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, tensors)
        tensors = {k: v for part in gathered for k, v in part.items()}
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    folder = storage_path(folder, "checkpoint.last_save_in_hf")
    modules = sorted({k.removesuffix(".lora_A.weight") for k in tensors if "lora_A" in k})
    with writing_into(folder) as local:
        local.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(local / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (local / ADAPTER_CONFIG).write_text(json.dumps(peft_config(lora, modules), indent=2))
    logger.info(f"saved the LoRA adapters ({len(modules)} linears) as a PEFT folder: {folder}")


def _read_peft_config(folder: Path, lora: LoRAConfig) -> dict[str, Any]:
    path = folder / ADAPTER_CONFIG
    if not path.is_file():
        raise ConfigError(f"{FIELD}: {folder} has no {ADAPTER_CONFIG}; give a PEFT adapter folder")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{FIELD}: {path} is not JSON ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise ConfigError(f"{FIELD}: {path} is not a LoRA adapter (peft_type must be LORA)")
    for theirs, ours, name in (
        ("r", lora.rank, "lora.rank"),
        ("lora_alpha", lora.alpha, "lora.alpha"),
    ):
        if config.get(theirs) != ours:
            raise ConfigError(
                f"{FIELD}: the adapter has {theirs}={config.get(theirs)!r}, this run "
                f"{name}={ours!r}; set {name} to match it"
            )
    if config.get("use_rslora") or config.get("fan_in_fan_out"):
        raise ConfigError(f"{FIELD}: {path}: use_rslora and fan_in_fan_out are not supported")
    return config


@torch.no_grad()
def load_peft_adapter(
    model_parts: list[nn.Module], folder: str | Path, adapter: StateDictAdapter, lora: LoRAConfig
) -> None:
    """Fill this run's adapters from a PEFT folder; ConfigError (one line) when its rank,
    alpha, adapted modules or shapes differ from this run's."""
    folder = Path(folder)
    _read_peft_config(folder, lora)
    try:
        with open_safetensors(folder / ADAPTER_WEIGHTS) as f:
            stored = {k: f.tensor(k) for k in f.keys()}
    except LoadError as e:
        raise ConfigError(f"{FIELD}: {e}") from None
    linears = adapted_linears(model_parts)
    wanted = set()
    for fqn, linear in linears.items():
        meta_b = torch.empty(linear.lora_b.shape, device="meta")
        module, _ = _hf_module(adapter, fqn, meta_b)
        keys = (f"{module}.lora_A.weight", f"{module}.lora_B.weight")
        wanted.update(keys)
        missing = [k for k in keys if k not in stored]
        if missing:
            raise ConfigError(
                f"{FIELD}: {folder} has no {missing[0]} (for {fqn}); the adapter was trained "
                "on other modules: set lora.target_modules to the ones it adapts"
            )
        hf_weight = f"{module.removeprefix(PEFT_PREFIX)}.weight"
        (b,) = adapter.from_hf({hf_weight: stored[keys[1]]}).values()
        for name, value in (("lora_a", stored[keys[0]]), ("lora_b", b)):
            param = getattr(linear, name)
            if tuple(value.shape) != tuple(param.shape):
                raise ConfigError(
                    f"{FIELD}: {name} of {fqn} is {tuple(value.shape)} in {folder}, this model "
                    f"needs {tuple(param.shape)}: the adapter is for another base model"
                )
            copy_full_into(param, value)
    _check_no_extra(stored, wanted, folder)
    logger.info(f"loaded LoRA adapters of {len(linears)} linears from the PEFT folder {folder}")


def _check_no_extra(stored: dict[str, torch.Tensor], wanted: set[str], folder: Path) -> None:
    """Every adapter of the folder is used (under pipeline parallel by some stage: only
    one process checks it)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        return
    lora_keys = {k for k in stored if ".lora_A." in k or ".lora_B." in k}
    others = sorted(set(stored) - lora_keys)
    if others:  # PEFT saves targeted output/embedding layers' base weights alongside
        logger.warning(
            f"{FIELD}: ignoring {len(others)} tensors that are not LoRA adapters ({others[0]}"
            f"{', ...' if len(others) > 1 else ''}); the base comes from the base checkpoint"
        )
    extra = sorted(lora_keys - wanted)
    if extra:
        raise ConfigError(
            f"{FIELD}: {folder} adapts {extra[0]} (+{len(extra) - 1} more), which "
            "lora.target_modules does not select; set lora.target_modules to match the adapter"
        )
