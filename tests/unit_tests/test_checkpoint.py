"""CheckpointManager in one process (a 1-rank gloo group): cadence, round trips (sync and
async), incomplete or corrupt checkpoints, exclusions, model-only export, purging, and that
loading runs no code from the files."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from tests.layouts import single_process_dims
from torchtitan.components.checkpointing.folders import (
    MANIFEST,
    check_checkpoint_inputs,
    inspect_checkpoint,
    purge_old_checkpoints,
    saved_run_seed,
)
from torchtitan.components.checkpointing.manager import CheckpointManager
from torchtitan.components.checkpointing.safe_loading import read_dcp_metadata
from torchtitan.components.optimizers.builder import build_optimizers
from torchtitan.components.optimizers.lr_schedule import build_lr_schedulers
from torchtitan.config import ConfigError, ConfigManager

pytestmark = pytest.mark.usefixtures("single_rank_gloo")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = checkpoint_wrapper(nn.Linear(4, 8))  # wrapper prefixes must not reach the keys
        self.b = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Loader:
    """A data loader whose state is mergeable per-shard cursors, like SequenceDataLoader's."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict:
        return {
            "data_shards": 2,
            "next_position": self.position,
            "shards": {"0": [0, 0, 0, self.position // 2], "1": [0, 0, 0, self.position // 2]},
        }

    def load_state_dict(self, state: dict) -> None:
        self.position = state["next_position"]


class TrainState:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


class Run:
    """A model, its optimizer, LR schedule, loader, step and CheckpointManager."""

    def __init__(self, folder: Path, *args: str, device: str = "cpu") -> None:
        self.job_config = ConfigManager().parse_args(
            [
                "--job.dump_folder",
                str(folder),
                "--checkpoint.enable",
                "--checkpoint.interval",
                "2",
                "--training.steps",
                "10",
                "--lr_scheduler.warmup_steps",
                "3",
                *args,
            ]
        )
        torch.manual_seed(0)
        self.model = torch.compile(Net().to(device))  # an OptimizedModule: keys lose _orig_mod too
        self.device = device
        dims = single_process_dims()
        self.optimizers = build_optimizers([self.model], self.job_config.optimizer, dims)
        self.lr_schedulers = build_lr_schedulers(
            self.optimizers, self.job_config.lr_scheduler, self.job_config.training.steps
        )
        self.loader, self.train_state = Loader(), TrainState()
        self.checkpointer = CheckpointManager(
            self.job_config.checkpoint,
            dump_folder=self.job_config.job.dump_folder,
            dataloader=self.loader,
            model_parts=[self.model],
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self.train_state},
            parallel_dims=dims,
        )
        self.folder = folder / "checkpoint"

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.train_state.step += 1
            self.optimizers.zero_grad()
            self.model._orig_mod(torch.randn(3, 4, device=self.device)).square().sum().backward()
            self.checkpointer.maybe_wait_for_staging()
            self.optimizers.step()
            self.lr_schedulers.step()
            self.loader.position += 4
            self.checkpointer.save(self.train_state.step, last_step=self.train_state.step == 10)

    def snapshot(self) -> dict:
        return {
            "model": {k: v.clone() for k, v in self.model.state_dict().items()},
            "optimizer": {
                k: v.clone() if isinstance(v, torch.Tensor) else v
                for k, v in self.optimizers.state_dict().items()
            },
            "lr": self.lr_schedulers.state_dict()["last_epoch"],
            "data": self.loader.position,
            "step": self.train_state.step,
            "rng": torch.get_rng_state(),
        }


def assert_same(a: dict, b: dict, skip: tuple[str, ...] = ()) -> None:
    for key in a:
        if key in skip:
            continue
        if isinstance(a[key], dict):
            assert a[key].keys() == b[key].keys(), key
            for name in a[key]:
                x, y = a[key][name], b[key][name]
                assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, f"{key}.{name}"
        elif isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def test_no_test_hook_is_installed_in_the_test_process():
    """A hook module imported by a test patches the pytest process for every later test (the
    pause hook made each asynchronous save here wait two minutes)."""
    assert CheckpointManager._finish.__module__ == "torchtitan.components.checkpointing.manager"


@pytest.mark.parametrize("mode", ["disabled", "async", "async_with_pinned_mem"])
def test_round_trip_restores_every_state(tmp_path, mode, caplog):
    run = Run(tmp_path, "--checkpoint.async_mode", mode)
    run.train(4)
    saved = run.snapshot()
    run.train(1)  # mutates every tensor right after the background save of step 4
    run.checkpointer.close()
    assert sorted(p.name for p in run.folder.iterdir()) == ["step-2", "step-4"]

    fresh = Run(tmp_path, "--checkpoint.async_mode", mode)
    with caplog.at_level("INFO", logger="torchtitan"):
        assert fresh.checkpointer.load(step=-1)
    assert_same(saved, fresh.snapshot())
    assert (
        "step-4 (step 4; model, optimizer, rng, lr_scheduler, dataloader, train_state)"
        in caplog.text
    )
    fresh.checkpointer.close()


@pytest.mark.gpu
def test_pinned_memory_staging_round_trip_on_cuda(tmp_path):
    """Staging runs in the background; the next optimizer step waits for it."""
    run = Run(tmp_path, "--checkpoint.async_mode", "async_with_pinned_mem", device="cuda")
    run.train(4)
    saved = run.snapshot()
    run.train(1)
    run.checkpointer.close()
    fresh = Run(tmp_path, "--checkpoint.async_mode", "async_with_pinned_mem", device="cuda")
    assert fresh.checkpointer.load(step=-1)
    assert_same(saved, fresh.snapshot())
    fresh.checkpointer.close()


def test_cadence_first_step_interval_last_step_force_and_load_only(tmp_path):
    run = Run(
        tmp_path / "a", "--checkpoint.interval", "3", "--checkpoint.enable_first_step_checkpoint"
    )
    run.train(10)
    run.checkpointer.save(7, force=True)
    run.checkpointer.close()
    assert sorted(int(p.name[5:]) for p in run.folder.iterdir()) == [1, 3, 6, 7, 9, 10]
    assert not json.loads((run.folder / "step-7" / MANIFEST).read_text())["model_only"]

    load_only = Run(tmp_path / "b", "--checkpoint.load_only")
    load_only.train(4)
    load_only.checkpointer.save(4, force=True)
    load_only.checkpointer.close()
    assert not load_only.folder.exists()


def test_model_only_export_has_export_dtype_and_plain_keys(tmp_path):
    run = Run(tmp_path, "--checkpoint.export_dtype", "bfloat16")
    run.train(10)
    run.checkpointer.close()
    export = run.folder / "step-10"
    metadata = read_dcp_metadata(export).state_dict_metadata
    assert sorted(metadata) == ["a.bias", "a.weight", "b.bias", "b.weight"]
    assert {m.properties.dtype for m in metadata.values()} == {torch.bfloat16}
    assert json.loads((export / MANIFEST).read_text())["model_only"]
    weights = {k: v.clone() for k, v in run.model.state_dict().items()}

    resumed = Run(tmp_path)  # -1 resumes from the newest FULL checkpoint, not the export
    assert resumed.checkpointer.load(step=-1)
    assert resumed.train_state.step == 8

    fresh = Run(tmp_path)  # the export itself: weights only, step 0
    assert fresh.checkpointer.load(step=10)
    assert fresh.train_state.step == 0 and fresh.loader.position == 0
    for name, value in fresh.model.state_dict().items():
        assert value.dtype == torch.float32
        assert torch.equal(value, weights[name].to(torch.bfloat16).float())


def test_explicit_incomplete_checkpoint_is_an_error_and_latest_falls_back(tmp_path, caplog):
    run = Run(tmp_path)
    run.train(4)
    run.checkpointer.close()
    (run.folder / "step-4" / MANIFEST).unlink()

    fresh = Run(tmp_path)
    with pytest.raises(
        ConfigError, match=r"checkpoint.load_step=4: .*step-4 is incomplete .*complete: 2"
    ):
        fresh.checkpointer.load(step=4)
    with caplog.at_level("INFO", logger="torchtitan"):
        assert fresh.checkpointer.load(step=-1)
    assert "skipping checkpoint" in caplog.text and "step-4 is incomplete" in caplog.text
    assert fresh.train_state.step == 2
    with pytest.raises(ConfigError, match=r"checkpoint.load_step=7: there is no .*step-7"):
        fresh.checkpointer.load(step=7)


def test_truncated_file_is_reported_as_corrupt(tmp_path):
    run = Run(tmp_path)
    run.train(2)
    run.checkpointer.close()
    data = next((run.folder / "step-2").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(
        ConfigError, match=r"step-2 is corrupt \(__0_0.distcp: 100 bytes, expected \d+ bytes\)"
    ):
        Run(tmp_path).checkpointer.load(step=2)
    assert not Run(tmp_path).checkpointer.load(step=-1)  # nothing complete is left


def test_exclude_from_loading(tmp_path):
    run = Run(tmp_path)
    run.train(2)
    saved = run.snapshot()
    run.checkpointer.close()
    fresh = Run(tmp_path, "--checkpoint.exclude_from_loading", "optimizer,lr_scheduler,dataloader")
    before = fresh.snapshot()
    fresh.checkpointer.load(step=-1)
    after = fresh.snapshot()
    assert_same(saved, after, skip=("optimizer", "lr", "data"))
    assert_same(before, after, skip=("model", "step", "rng"))  # the fresh optimizer, LR and data
    assert after["lr"] == 0 and after["data"] == 0
    with pytest.raises(
        ConfigError, match="checkpoint.exclude_from_loading: unknown state.*optimiser"
    ):
        Run(tmp_path, "--checkpoint.exclude_from_loading", "optimiser")


def test_checkpoint_of_another_model_is_one_clear_error(tmp_path):
    run = Run(tmp_path)
    run.train(2)
    run.checkpointer.close()
    other = Run(tmp_path)
    other.model._orig_mod.b = nn.Linear(8, 3)  # another output size
    other.optimizers = build_optimizers([other.model], other.job_config.optimizer, None)
    other.checkpointer.optimizers = other.optimizers
    with pytest.raises(
        ConfigError,
        match=r"step-2/\.metadata: 'b\.(weight|bias)' has shape \(2,.*\), "
        r"the model has \(3,.*; load it with the model flavor",
    ):
        other.checkpointer.load(step=-1)


def test_purge_keeps_newest_complete_and_ignores_other_folders(tmp_path):
    for step in (10, 20, 30, 40):
        (tmp_path / f"step-{step}").mkdir()
        if step != 40:  # step-40 is incomplete: it neither counts nor gets deleted
            (tmp_path / f"step-{step}" / MANIFEST).write_text(json.dumps({"files": {}}))
    for other in ("step-5.tmp", "step-x", "notes", "ft-replica-0"):
        (tmp_path / other).mkdir()
    assert purge_old_checkpoints(tmp_path, keep=0) == []
    assert purge_old_checkpoints(tmp_path, keep=1) == [20, 10]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ft-replica-0",
        "notes",
        "step-30",
        "step-40",
        "step-5.tmp",
        "step-x",
    ]


def test_the_saved_run_seed_is_the_resumed_checkpoints(tmp_path):
    def write(step: int, manifest: dict) -> None:
        (tmp_path / f"step-{step}").mkdir()
        (tmp_path / f"step-{step}" / MANIFEST).write_text(json.dumps(manifest))

    assert saved_run_seed(tmp_path, -1) is None
    write(2, {"model_only": False, "states": {"train_state": {"step": 2}}})  # before seeds
    assert saved_run_seed(tmp_path, -1) is None
    write(4, {"model_only": False, "states": {"train_state": {"step": 4, "seed": 11}}})
    write(6, {"model_only": True, "states": {}})  # an export: no run state
    (tmp_path / "step-8").mkdir()  # incomplete
    assert saved_run_seed(tmp_path, -1) == 11
    assert saved_run_seed(tmp_path, 2) is None
    assert saved_run_seed(tmp_path, 4) == 11


def test_background_purge_with_keep_latest_k(tmp_path):
    run = Run(tmp_path, "--checkpoint.keep_latest_k", "2", "--checkpoint.async_mode", "async")
    run.train(8)
    run.checkpointer.close()
    assert sorted(p.name for p in run.folder.iterdir()) == ["step-6", "step-8"]


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_loading_runs_no_code_from_the_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = Run(tmp_path)
    run.train(2)
    run.checkpointer.close()
    step = run.folder / "step-2"
    (step / ".metadata").write_bytes(pickle.dumps(_Boom()))
    manifest = json.loads((step / MANIFEST).read_text())
    manifest["files"][".metadata"] = (step / ".metadata").stat().st_size
    (step / MANIFEST).write_text(json.dumps(manifest))
    assert (
        "os.system" in inspect_checkpoint(step)[1] or "posix.system" in inspect_checkpoint(step)[1]
    )
    with pytest.raises(ConfigError, match="not valid DCP metadata.*not allowed"):
        Run(tmp_path).checkpointer.load(step=2)
    assert not (tmp_path / "pwned").exists()


def test_hf_export_of_a_model_without_hf_equivalent_fails_at_start(tmp_path):
    from torchtitan.preflight import preflight

    job_config = ConfigManager().parse_args(
        [
            "--job.dump_folder",
            str(tmp_path),
            "--checkpoint.enable",
            "--checkpoint.last_save_in_hf",
            "--model.name",
            "deepseek_v3",
            "--model.flavor",
            "16B",  # softmax routing: no Hugging Face DeepseekV3
        ]
    )
    with pytest.raises(
        ConfigError, match="checkpoint.last_save_in_hf: this model routes with softmax scores"
    ):
        preflight(job_config, 1, "cpu")


def test_seed_checkpoint_into_a_folder_with_later_checkpoints_is_refused_before_launch(tmp_path):
    run = Run(tmp_path)
    run.train(2)
    run.checkpointer.close()
    seed = ConfigManager().parse_args(
        [
            "--job.dump_folder",
            str(tmp_path),
            "--checkpoint.enable",
            "--checkpoint.create_seed_checkpoint",
        ]
    )
    with pytest.raises(
        ConfigError,
        match=r"^checkpoint.create_seed_checkpoint: .* already holds checkpoints \(step-2\)",
    ):
        check_checkpoint_inputs(seed.checkpoint, seed.job.dump_folder)
    check_checkpoint_inputs(seed.checkpoint, str(tmp_path / "empty"))
