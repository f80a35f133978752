"""Hugging Face safetensors in and out through a model's StateDictAdapter.

Every parameter and persistent buffer of the model (its state-dict entries) is converted on
its own: ``adapter.to_hf`` on a meta tensor names the Hugging Face keys it comes from (one,
or several: DeepSeek-V3's fused ``[E, ...]`` experts are stored one tensor per expert), and
``adapter.from_hf`` on exactly those tensors gives it back. Loading reads one such group at
a time with the ``safetensors`` library and keeps only this rank's piece
(``distribute_tensor(..., src_data_rank=None)`` slices locally), so no rank materialises the
full model. Saving gathers one parameter at a time; the first rank of each pipeline stage
writes that stage's file, rank 0 writes the index and ``config.json``. Parameters are
exported in ``export_dtype``; buffers (DeepSeek-V3's expert bias) keep their own dtype.
Tensors stored as MXFP4 blocks and scales (gpt-oss's released experts) load dequantised
(``components/checkpointing/mxfp4.py``); exports are never quantised.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtitan.components.adapters.lora_linear import adapted_linears, is_lora_param, merged_weight
from torchtitan.components.checkpointing import mxfp4
from torchtitan.components.checkpointing.safe_loading import (
    LoadError,
    open_safetensors,
    read_hf_config,
    safetensors_files,
)
from torchtitan.config.errors import UserInputError
from torchtitan.layers.init import clean_fqn
from torchtitan.protocols.state_dict_adapter import StateDictAdapter
from torchtitan.tools.logging import logger
from torchtitan.tools.storage import storage_path, writing_into

INDEX_FILE = "model.safetensors.index.json"


class HFCheckpointError(UserInputError):
    """Hugging Face weights that cannot load into (or be written from) this model."""


def _model_tensors(model_parts: list[nn.Module]) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The state-dict entries of ``model_parts`` (parameters, possibly DTensors, and
    persistent buffers) by unwrapped FQN, and the FQNs of the buffers."""
    tensors: dict[str, torch.Tensor] = {}
    buffers: set[str] = set()
    for part in model_parts:
        for name, param in part.named_parameters():
            if not is_lora_param(name):  # adapters: merged on export, never in a base
                tensors[clean_fqn(name)] = param
        for prefix, module in part.named_modules():
            for name, buffer in module.named_buffers(recurse=False):
                if buffer is None or name in module._non_persistent_buffers_set:
                    continue
                fqn = clean_fqn(f"{prefix}.{name}" if prefix else name)
                tensors[fqn] = buffer
                buffers.add(fqn)
    return tensors, buffers


def _scan(folder: Path) -> tuple[dict[str, Path], dict[str, list[int]]]:
    """Hugging Face key -> file holding it, and key -> shape."""
    index, shapes = {}, {}
    for path in safetensors_files(folder):
        with open_safetensors(path) as f:
            for key in f.keys():
                index[key] = path
                shapes[key] = f.shape(key)
    return index, shapes


def _check_config(folder: Path, adapter: StateDictAdapter, field: str) -> None:
    config = read_hf_config(folder, adapter.check_hf_config)
    if config is None:
        logger.warning(f"{field}: {folder} has no config.json; shapes are checked per tensor only")
        return
    try:
        adapter.check_hf_config(config)
    except ValueError as e:
        raise HFCheckpointError(f"{field}: {e}") from None


def _check_keys(
    shapes: dict[str, list[int]], adapter: StateDictAdapter, folder: Path, field: str
) -> None:
    """The adapter must understand the whole checkpoint at once (unknown keys, incomplete
    expert sets). Only conversion is checked, not that this rank holds the result: under
    pipeline parallel the other stages' keys belong to other ranks."""
    meta = {k: torch.empty(shape, device="meta") for k, shape in shapes.items()}
    for key, (blocks, scales) in mxfp4.packed_keys(set(shapes)).items():
        del meta[blocks], meta[scales]
        meta[key] = torch.empty(mxfp4.dense_shape(shapes[blocks]), device="meta")
    try:
        adapter.from_hf(meta)
    except (ValueError, RuntimeError) as e:
        raise HFCheckpointError(f"{field}: {folder} does not convert to this model: {e}") from None


def _hf_keys_of(adapter: StateDictAdapter, fqn: str, tensor: torch.Tensor, field: str) -> list[str]:
    try:
        return list(
            adapter.to_hf({fqn: torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")})
        )
    except ValueError as e:
        raise HFCheckpointError(f"{field}: {e}") from None


def _read(
    index: dict[str, Path], keys: list[str], packed: dict[str, tuple[str, str]]
) -> dict[str, torch.Tensor]:
    """The tensors of ``keys``; a key stored as MXFP4 blocks and scales (``packed``) is
    dequantised."""
    stored = [part for key in keys for part in (packed[key] if key in packed else (key,))]
    by_file: dict[Path, list[str]] = defaultdict(list)
    for key in stored:
        by_file[index[key]].append(key)
    out = {}
    for path, file_keys in by_file.items():
        with open_safetensors(path) as f:
            for key in file_keys:
                out[key] = f.tensor(key)
    for key in keys:
        if key in packed:
            blocks, scales = packed[key]
            out[key] = mxfp4.dequantize(out.pop(blocks), out.pop(scales))
    return out


def _describe(keys: list[str]) -> str:
    return repr(keys[0]) if len(keys) == 1 else f"{keys[0]!r} (+{len(keys) - 1} more keys)"


@torch.no_grad()
def load_hf_weights(
    model_parts: list[nn.Module],
    folder: str | os.PathLike,
    adapter: StateDictAdapter,
    field: str = "checkpoint.initial_load_path",
) -> HFWeights:
    """Fill every parameter and persistent buffer of ``model_parts`` (any parallel layout)
    from a folder of Hugging Face safetensors (+ config.json). Parameters still on meta
    (QLoRA's pending base) are left; the returned source fills them later."""
    weights = HFWeights(folder, adapter, field)
    tensors, _ = _model_tensors(model_parts)
    weights.load_into({fqn: t for fqn, t in tensors.items() if not t.is_meta})
    logger.info(f"loaded Hugging Face weights from {folder}")
    return weights


class HFWeights:
    """A checked folder of Hugging Face safetensors: its config agrees with the adapter and
    every key converts; ``load_into`` then fills model tensors by FQN."""

    def __init__(self, folder: str | os.PathLike, adapter: StateDictAdapter, field: str):
        self.folder, self.adapter, self.field = Path(folder), adapter, field
        if not self.folder.is_dir():
            raise HFCheckpointError(
                f"{field}: {self.folder} is not a folder of Hugging Face safetensors"
            )
        with self._load_errors():
            _check_config(self.folder, adapter, field)
            self.index, shapes = _scan(self.folder)
            self.packed = mxfp4.packed_keys(set(self.index))
            _check_keys(shapes, adapter, self.folder, field)

    @torch.no_grad()
    def load_into(self, tensors: dict[str, torch.Tensor]) -> None:
        """Fill each tensor (possibly a DTensor: this rank's piece) with its converted value."""
        with self._load_errors():
            for fqn, tensor in tensors.items():
                copy_full_into(tensor, self._value(fqn, tensor))

    @contextlib.contextmanager
    def _load_errors(self) -> Iterator[None]:
        try:
            yield
        except LoadError as e:
            raise HFCheckpointError(f"{self.field}: {e}") from None

    def _value(self, fqn: str, tensor: torch.Tensor) -> torch.Tensor:
        field, folder = self.field, self.folder
        full_shape = tensor.shape  # a DTensor's shape is the global one
        hf_keys = _hf_keys_of(self.adapter, fqn, tensor, field)
        missing = [k for k in hf_keys if k not in self.index and k not in self.packed]
        if missing:
            raise HFCheckpointError(
                f"{field}: missing key {_describe(missing)} (for {fqn}) in {folder}"
            )
        try:
            value = self.adapter.from_hf(_read(self.index, hf_keys, self.packed)).get(fqn)
        except (ValueError, RuntimeError) as e:
            raise HFCheckpointError(f"{field}: {_describe(hf_keys)} (for {fqn}): {e}") from None
        if value is None:
            raise HFCheckpointError(f"{field}: {_describe(hf_keys)} do not give {fqn}")
        if value.shape != full_shape:
            raise HFCheckpointError(
                f"{field}: {_describe(hf_keys)} has shape {tuple(value.shape)} for {fqn}, the "
                f"model expects {tuple(full_shape)} (vocabulary or flavor mismatch?)"
            )
        if value.is_floating_point() != tensor.is_floating_point():
            raise HFCheckpointError(
                f"{field}: {_describe(hf_keys)} is {value.dtype} for {fqn}, "
                f"the model has {tensor.dtype}"
            )
        return value


def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    if isinstance(param, DTensor):
        local = distribute_tensor(
            full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous tensor that owns its whole storage (safetensors refuses
    tensors sharing memory, e.g. the per-expert views of one fused parameter)."""
    t = t.contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset():
        t = t.clone()
    return t


@torch.no_grad()
def save_hf_weights(
    model_parts: list[nn.Module],
    folder: str | os.PathLike,
    adapter: StateDictAdapter,
    export_dtype: torch.dtype,
    parallel_dims: Any,
    field: str = "checkpoint.last_save_in_hf",
) -> None:
    """Write consolidated Hugging Face safetensors + config.json into ``folder`` (a local
    path or an object store's, ``storage.writing_into``; LoRA adapters merged into their
    base weights); a model with no Hugging Face equivalent
    raises HFCheckpointError on every rank before any collective."""
    folder = storage_path(folder, field)
    try:
        config = adapter.hf_config()  # on every rank, before any collective
    except (ValueError, NotImplementedError) as e:
        raise HFCheckpointError(f"{field}: {e}") from None
    pp_rank, pp_size, writer = _stage_writer(parallel_dims)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    ours = {}
    model_tensors, buffers = _model_tensors(model_parts)
    adapted = {f"{fqn}.weight": m for fqn, m in adapted_linears(model_parts).items()}
    for fqn, tensor in model_tensors.items():
        full = _full(tensor)
        if fqn in adapted:
            a, b = _full(adapted[fqn].lora_a), _full(adapted[fqn].lora_b)
            full = merged_weight(full, a, b, adapted[fqn].lora_scaling)
        if writer:
            dtype = (
                tensor.dtype if fqn in buffers or not tensor.is_floating_point() else export_dtype
            )
            ours[fqn] = full.detach().to("cpu", dtype)
    # converted together: some Hugging Face tensors fuse several of ours (gpt-oss experts)
    tensors = adapter.to_hf(ours) if writer else {}
    filename = (
        "model.safetensors"
        if pp_size == 1
        else f"model-{pp_rank + 1:05d}-of-{pp_size:05d}.safetensors"
    )
    with writing_into(folder, last="config.json") as local:
        if rank == 0:
            local.mkdir(parents=True, exist_ok=True)
        if dist.is_initialized():
            dist.barrier()
        if writer:
            save_file(
                {k: _own_storage(v) for k, v in tensors.items()},
                str(local / filename),
                metadata={"format": "pt"},
            )
        keys = {k: filename for k in tensors}
        if pp_size > 1:
            gathered: list[dict[str, str]] = [{} for _ in range(world)]
            dist.all_gather_object(gathered, keys)
            keys = {k: v for part in gathered for k, v in part.items()}
        if rank == 0:
            _write_index_and_config(local, keys, config, export_dtype, pp_size > 1)
    if dist.is_initialized():
        dist.barrier()
    logger.info(f"saved Hugging Face weights ({export_dtype}) to {folder}")


def _stage_writer(parallel_dims: Any) -> tuple[int, int, bool]:
    """(pipeline rank, pipeline degree, whether this rank writes its stage's file): the
    writer is the stage's rank at coordinate 0 of every other mesh dimension."""
    if parallel_dims is None:
        return 0, 1, not dist.is_initialized() or dist.get_rank() == 0
    mesh = parallel_dims.world_mesh.root
    coordinate = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    writer = all(c == 0 for name, c in coordinate.items() if name != "pp")
    return coordinate.get("pp", 0), parallel_dims.pp, writer


def _write_index_and_config(
    folder: Path,
    keys: dict[str, str],
    config: dict[str, Any],
    export_dtype: torch.dtype,
    sharded: bool,
) -> None:
    # transformers 5 reads `dtype`, older releases `torch_dtype`: both name the export's
    dtype = str(export_dtype).removeprefix("torch.")
    config = dict(config, dtype=dtype, torch_dtype=dtype)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if sharded:
        index = {"metadata": {}, "weight_map": dict(sorted(keys.items()))}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2))
