"""Weights & Biases logging, in wandb's offline mode (no network): the run folder holds the
same scalars as TensorBoard and the job config."""

import dataclasses
import importlib.util
import json
import struct
import time
from pathlib import Path

import pytest
import torch

from tests.layouts import single_process_dims
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.config import ConfigError, ConfigManager

pytest.importorskip("wandb")
from wandb.proto.wandb_internal_pb2 import Record  # noqa: E402

_BLOCK = (
    32768  # wandb's run file: blocks of records, each chunk behind a (crc32, length, type) header
)
_CHUNK_HEADER = struct.Struct("<IHB")
_FULL, _LAST = 1, 4


def _run_file_records(path: Path) -> list[Record]:
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, payload, pos = [], b"", 7
    while pos + _CHUNK_HEADER.size <= len(data):
        room = _BLOCK - pos % _BLOCK
        _, length, kind = _CHUNK_HEADER.unpack_from(data, pos)
        if room < _CHUNK_HEADER.size or kind == 0:  # block padding
            pos += room
            continue
        payload += data[pos + _CHUNK_HEADER.size : pos + _CHUNK_HEADER.size + length]
        pos += _CHUNK_HEADER.size + length
        if kind in (_FULL, _LAST):
            records.append(Record.FromString(payload))
            payload = b""
    return records


def _finished_run_records(folder: Path, timeout: float = 60.0) -> list[Record]:
    """The records of the one offline run under ``folder``, once its exit record is on disk
    (wandb's service writes the file asynchronously; ``finish()`` can return before the last
    records land)."""
    deadline = time.monotonic() + timeout
    while True:
        runs = list(folder.glob("offline-run-*/run-*.wandb"))
        records = _run_file_records(runs[0]) if len(runs) == 1 else []
        if (
            any(record.WhichOneof("record_type") == "exit" for record in records)
            or time.monotonic() > deadline
        ):
            return records
        time.sleep(0.2)


def _processor(tmp_path: Path, owns_loss: bool):
    config = ConfigManager().parse_args(
        [
            "--metrics.enable_wandb",
            "--metrics.enable_tensorboard",
            "--job.dump_folder",
            str(tmp_path),
            "--training.steps",
            "2",
        ]
    )
    return MetricsProcessor(
        config.metrics,
        dump_folder=config.job.dump_folder,
        total_steps=config.training.steps,
        parallel_dims=single_process_dims(),
        device=torch.device("cpu"),
        flops_per_token=0,
        owns_loss=owns_loss,
        compute_dtype=torch.float32,
        run_config=dataclasses.asdict(config),
    )


@pytest.fixture(autouse=True)
def fresh_wandb():
    """wandb keeps its settings (the mode, read from the environment) in a process-wide
    singleton."""
    import wandb

    yield
    wandb.teardown()


@pytest.fixture()
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("WANDB_PROJECT", "tt-test")


@pytest.mark.slow
def test_offline_run_holds_the_tensorboard_scalars_and_the_config(offline, tmp_path):
    processor = _processor(tmp_path, owns_loss=True)
    tensorboard = []
    add_scalar = processor.tb.add_scalar
    processor.tb.add_scalar = lambda tag, value, step: (
        tensorboard.append((tag, value, step)),
        add_scalar(tag, value, step),
    )
    records = [processor.log(1, 4.5, 4.75, 0.5, 1e-3), processor.log(2, 3.25, 3.5, 0.25, 2e-3)]
    processor.log_validation({"step": 2, "validation_loss": 3.0, "validation_perplexity": 20.0})
    processor.close()

    logged = []
    config = {}
    for record in _finished_run_records(tmp_path / "wandb"):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            step = items.pop("_step")
            logged += [
                (key, value, step) for key, value in items.items() if not key.startswith("_")
            ]
        elif kind == "run":
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
            assert record.run.project == "tt-test"
    assert sorted(logged) == sorted(tensorboard)
    assert {(key, records[1][key]) for key in ("loss", "grad_norm", "lr")} <= {
        (k, v) for k, v, s in logged if s == 2
    }
    assert ("validation/loss", 3.0, 2) in logged
    assert config["job"]["dump_folder"] == str(tmp_path)
    assert config["metrics"]["enable_wandb"] is True


def test_only_the_rank_that_owns_the_loss_logs(offline, tmp_path):
    processor = _processor(tmp_path, owns_loss=False)
    assert processor.wandb is None
    processor.close()
    assert not (tmp_path / "wandb").exists()


def test_missing_package_is_one_config_error(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "wandb" else find_spec(name, *a),
    )
    with pytest.raises(
        ConfigError, match=r"^metrics.enable_wandb: the wandb package is not installed; pip install"
    ):
        ConfigManager().parse_args(["--metrics.enable_wandb"])


def test_online_without_credentials_is_one_config_error(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc with a key
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    with pytest.raises(
        ConfigError,
        match=r"^metrics.enable_wandb: wandb cannot start a run \(.*\); run `wandb login`",
    ):
        _processor(tmp_path, owns_loss=True)
