"""Checkpoints and weights folders as an attacker (or a broken disk) would hand them to a
user: each function changes a copy of a valid folder in place. A payload, if anything ever
unpickles it, creates a marker file: the proof that code from the files ran."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from torchtitan.components.checkpointing.safe_loading import read_dcp_metadata

MANIFEST = "checkpoint.json"


class Payload:
    """Unpickling this touches ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = Path(marker)

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def payload_bytes(marker: Path) -> bytes:
    return pickle.dumps(Payload(marker))


def _data_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.distcp"))


def _write_metadata(folder: Path, metadata) -> None:
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def refresh_manifest(folder: Path) -> None:
    """What an attacker does after editing files: make checkpoint.json's sizes match again."""
    manifest_path = folder / MANIFEST
    if not manifest_path.exists():
        return
    manifest = json.loads(manifest_path.read_text())
    manifest["files"] = {
        f.name: f.stat().st_size for f in folder.iterdir() if f.is_file() and f.name != MANIFEST
    }
    manifest_path.write_text(json.dumps(manifest))


def model_key(folder: Path) -> str:
    """A model tensor stored in the folder (plain FQN)."""
    keys = read_dcp_metadata(folder).state_dict_metadata
    return next(k for k in keys if k.endswith("tok_embeddings.weight"))


# ---------------------------------------------------------------------- DCP folders
def metadata_is_payload(folder: Path, marker: Path) -> None:
    (folder / ".metadata").write_bytes(payload_bytes(marker))
    refresh_manifest(folder)


def payload_inside_metadata(folder: Path, marker: Path) -> None:
    metadata = read_dcp_metadata(folder)
    metadata.planner_data = {"extra": Payload(marker)}
    _write_metadata(folder, metadata)
    refresh_manifest(folder)


def key_relabelled_as_bytes(folder: Path, marker: Path, with_size: bool = False) -> None:
    """A model tensor described as bytes whose payload is a pickle (the default DCP planner
    unpickles bytes with weights_only=False)."""
    metadata = read_dcp_metadata(folder)
    key = model_key(folder)
    entry = BytesStorageMetadata()
    if with_size:  # satisfies a shape check that reads ``.size`` from the record
        entry.size = metadata.state_dict_metadata[key].size
    metadata.state_dict_metadata[key] = entry
    data_file = _data_files(folder)[0]
    offset = data_file.stat().st_size
    payload = payload_bytes(marker)
    with open(data_file, "ab") as f:
        f.write(payload)
    metadata.storage_data = {i: s for i, s in metadata.storage_data.items() if i.fqn != key}
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo(data_file.name, offset, len(payload))
    _write_metadata(folder, metadata)
    refresh_manifest(folder)


def generation_exploit(folder: Path, marker: Path) -> None:
    """The reported exploit of scripts/generate/test_generate.py: a key re-labelled as bytes
    whose record also carries the tensor's ``size``."""
    key_relabelled_as_bytes(folder, marker, with_size=True)


def pickle_in_tensor_data(folder: Path, marker: Path) -> None:
    """A pickle payload in place of a tensor's serialized bytes."""
    metadata = read_dcp_metadata(folder)
    key = model_key(folder)
    info = next(s for i, s in metadata.storage_data.items() if i.fqn == key)
    payload = payload_bytes(marker)
    assert len(payload) <= info.length
    with open(folder / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        f.write(payload)


def metadata_points_outside(folder: Path, marker: Path) -> None:
    """Records that send the reader to a pickle beside the checkpoint folder."""
    outside = folder.parent / f"{folder.name}-payload.distcp"
    outside.write_bytes(payload_bytes(marker))
    metadata = read_dcp_metadata(folder)
    key = model_key(folder)
    for index, info in metadata.storage_data.items():
        if index.fqn == key:
            info.relative_path = f"../{outside.name}"
    _write_metadata(folder, metadata)
    refresh_manifest(folder)


def truncated_shard(folder: Path, marker: Path) -> None:
    data_file = max(_data_files(folder), key=lambda f: f.stat().st_size)
    data = data_file.read_bytes()
    data_file.write_bytes(data[: len(data) // 2])


def missing_shard(folder: Path, marker: Path) -> None:
    _data_files(folder)[0].unlink()


def metadata_of_another_model(folder: Path, marker: Path) -> None:
    other = folder.parent / f"{folder.name}-other-model"
    dcp.save({"encoder.weight": torch.zeros(4, 4)}, checkpoint_id=str(other), no_dist=True)
    (folder / ".metadata").write_bytes((other / ".metadata").read_bytes())
    refresh_manifest(folder)


DCP_CASES = {
    f.__name__: f
    for f in (
        metadata_is_payload,
        payload_inside_metadata,
        key_relabelled_as_bytes,
        generation_exploit,
        pickle_in_tensor_data,
        metadata_points_outside,
        truncated_shard,
        missing_shard,
        metadata_of_another_model,
    )
}


# ---------------------------------------------------------------------- Hugging Face folders
def pickle_named_safetensors(folder: Path, marker: Path) -> None:
    for f in folder.glob("*.safetensors"):
        f.write_bytes(payload_bytes(marker))


def add_remote_code(folder: Path, marker: Path, architecture: str | None = None) -> None:
    """auto_map in config.json and a modelling file beside it that would touch ``marker``
    if imported (as official releases with custom code ship; ``architecture``: replace the
    config's own)."""
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    if architecture is not None:
        config["architectures"], config["model_type"] = [architecture], "evil"
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
    )


def config_asks_for_remote_code(folder: Path, marker: Path) -> None:
    """Remote code for an architecture torchtitan does not build."""
    add_remote_code(folder, marker, architecture="EvilForCausalLM")


def only_pickled_weights(folder: Path, marker: Path) -> None:
    for f in folder.glob("*.safetensors"):
        f.unlink()
    (folder / "pytorch_model.bin").write_bytes(payload_bytes(marker))


def truncated_safetensors(folder: Path, marker: Path) -> None:
    for f in folder.glob("*.safetensors"):
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2])


def safetensors_of_another_model(folder: Path, marker: Path) -> None:
    for f in folder.glob("*.safetensors"):
        save_file({"encoder.weight": torch.zeros(4, 4)}, str(f))


HF_CASES = {
    f.__name__: f
    for f in (
        pickle_named_safetensors,
        config_asks_for_remote_code,
        only_pickled_weights,
        truncated_safetensors,
        safetensors_of_another_model,
    )
}
