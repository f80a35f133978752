"""Hugging Face safetensors in and out through a model's StateDictAdapter.

Loading reads one tensor at a time with the ``safetensors`` library and keeps only this
rank's piece (``distribute_tensor(..., src_data_rank=None)`` slices locally), so no rank
materialises the full model. Saving gathers one parameter at a time; the first rank of each
pipeline stage writes that stage's file, rank 0 writes the index and ``config.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtitan.models.init import clean_fqn
from torchtitan.protocols.state_dict_adapter import StateDictAdapter
from torchtitan.tools.logging import logger

INDEX_FILE = "model.safetensors.index.json"


class HFCheckpointError(ValueError):
    pass


def _named_params(model_parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    return {clean_fqn(n): p for part in model_parts for n, p in part.named_parameters()}


def _safetensors_index(folder: Path, field: str) -> dict[str, Path]:
    """Hugging Face key -> file holding it."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise HFCheckpointError(f"{field}: no *.safetensors files in {folder}")
    index = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                index[key] = path
    return index


def _check_config(folder: Path, adapter: StateDictAdapter, field: str) -> None:
    config_path = folder / "config.json"
    if not config_path.exists():
        logger.warning(f"{field}: {folder} has no config.json; shapes are checked per tensor only")
        return
    try:
        adapter.check_hf_config(json.loads(config_path.read_text()))
    except ValueError as e:
        raise HFCheckpointError(f"{field}: {e}") from None


def _hf_key_of(adapter: StateDictAdapter, fqn: str, shape: torch.Size) -> str:
    (hf_key,) = adapter.to_hf({fqn: torch.empty(shape, device="meta")}).keys()
    return hf_key


def _check_no_unexpected(index: dict[str, Path], adapter: StateDictAdapter, field: str) -> None:
    for hf_key, path in index.items():
        with safe_open(path, framework="pt") as f:
            shape = f.get_slice(hf_key).get_shape()
        try:
            adapter.from_hf({hf_key: torch.empty(shape, device="meta")})
        except ValueError as e:
            raise HFCheckpointError(f"{field}: unexpected key in {path.name}: {e}") from None


@torch.no_grad()
def load_hf_weights(
    model_parts: list[nn.Module], folder: str | os.PathLike, adapter: StateDictAdapter,
    field: str = "checkpoint.initial_load_path",
) -> None:
    """Fill every parameter of ``model_parts`` (any parallel layout) from a folder of
    Hugging Face safetensors (+ config.json)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise HFCheckpointError(f"{field}: {folder} is not a folder of Hugging Face safetensors")
    _check_config(folder, adapter, field)
    index = _safetensors_index(folder, field)
    _check_no_unexpected(index, adapter, field)
    for fqn, param in _named_params(model_parts).items():
        full_shape = param.shape  # a DTensor's shape is the global one
        hf_key = _hf_key_of(adapter, fqn, full_shape)
        if hf_key not in index:
            raise HFCheckpointError(f"{field}: missing key {hf_key!r} (for {fqn}) in {folder}")
        with safe_open(index[hf_key], framework="pt", device="cpu") as f:
            value = adapter.from_hf({hf_key: f.get_tensor(hf_key)})[fqn]
        if value.shape != full_shape:
            raise HFCheckpointError(
                f"{field}: {hf_key!r} has shape {tuple(value.shape)}, the model expects "
                f"{tuple(full_shape)} (vocabulary or flavor mismatch?)"
            )
        _copy_full_into(param, value)
    logger.info(f"loaded Hugging Face weights from {folder}")


def _copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    if isinstance(param, DTensor):
        local = distribute_tensor(
            full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


@torch.no_grad()
def save_hf_weights(
    model_parts: list[nn.Module], folder: str | os.PathLike, adapter: StateDictAdapter,
    export_dtype: torch.dtype, parallel_dims: Any,
) -> None:
    """Write consolidated Hugging Face safetensors + config.json into ``folder``."""
    folder = Path(folder)
    pp_rank, pp_size = 0, 1
    if parallel_dims is not None and parallel_dims.pp_enabled:
        pp_mesh = parallel_dims.world_mesh["pp"]
        pp_rank, pp_size = pp_mesh.get_local_rank(), pp_mesh.size()
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    writer = rank % (world // pp_size) == 0  # first rank of this pipeline stage
    tensors = {}
    for fqn, param in _named_params(model_parts).items():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        if writer:
            tensors.update(adapter.to_hf({fqn: full.detach().to("cpu", export_dtype)}))
    filename = "model.safetensors" if pp_size == 1 else f"model-{pp_rank + 1:05d}-of-{pp_size:05d}.safetensors"
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    if writer:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / filename),
                  metadata={"format": "pt"})
    keys = {k: filename for k in tensors}
    if pp_size > 1:
        gathered: list[dict[str, str]] = [{} for _ in range(world)]
        dist.all_gather_object(gathered, keys)
        keys = {k: v for part in gathered for k, v in part.items()}
    if rank == 0:
        _write_index_and_config(folder, keys, adapter, export_dtype, pp_size > 1)
    if dist.is_initialized():
        dist.barrier()
    logger.info(f"saved Hugging Face weights ({export_dtype}) to {folder}")


def _write_index_and_config(folder: Path, keys: dict[str, str], adapter: StateDictAdapter,
                            export_dtype: torch.dtype, sharded: bool) -> None:
    config = adapter.hf_config()
    config["torch_dtype"] = str(export_dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if sharded:
        index = {"metadata": {}, "weight_map": dict(sorted(keys.items()))}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2))
