"""Checkpointing with torch.distributed.checkpoint (DCP).

A checkpoint is the folder ``{job.dump_folder}/{checkpoint.folder}/step-N``:

- DCP files (``.metadata``, ``__R_0.distcp``) hold the tensors: the model weights under their
  plain FQNs (identical for every parallel layout, so DCP reshards on load), ``optimizer.*``
  (FQN-keyed, flattened) and ``rng.rank{R}.{cpu,cuda}`` (every rank's RNG state as uint8).
- ``checkpoint.json``, written last, is the completion marker: the manifest (step, model-only
  or not, world size, dp degree, the size of every file) plus the non-tensor states as plain
  JSON: ``train_state``, ``lr_scheduler`` and the data-loader state merged over the dp ranks,
  which loads under any dp degree.

A save is written to ``step-N.tmp`` and published as ``step-N`` by rank 0 once DCP reports
every rank's files written (DCP's own all-reduce at the end of a save is the barrier), so a
crash never leaves a ``step-N`` that looks complete (``folders``). Which checkpoint loads is
``load_choice``'s decision; loading goes through ``safe_loading`` (no code runs from the
files; every entry is checked against the metadata first) and JSON.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from torchtitan.components.adapters.lora_linear import is_lora_param
from torchtitan.components.adapters.qlora import PendingBase
from torchtitan.components.checkpointing.folders import (
    FORMAT,
    check_seed_folder,
    plain_json,
    publish,
    purge_old_checkpoints,
    remove_leftovers,
    save_folder,
)
from torchtitan.components.checkpointing.huggingface import (
    HFCheckpointError,
    load_hf_weights,
    save_hf_weights,
)
from torchtitan.components.checkpointing.load_choice import (
    LoadChoice,
    choose_checkpoint,
    choose_initial_weights,
)
from torchtitan.components.checkpointing.peft import load_peft_adapter, save_peft_adapter
from torchtitan.components.checkpointing.safe_loading import LoadError, load_dcp
from torchtitan.config import ConfigError
from torchtitan.data.state import merge_data_states
from torchtitan.distributed.data_parallel import TORCH_DTYPES
from torchtitan.tools.logging import logger
from torchtitan.tools.storage import (
    StorageError,
    checkpoint_root,
    first_line,
    is_object_store,
    reading_from,
    remove_tree,
    storage_path,
)

if TYPE_CHECKING:
    from torchtitan.config import CheckpointConfig, LoRAConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols import StateDictAdapter

_BUILTIN_STATES = ("model", "optimizer", "lr_scheduler", "dataloader", "rng")


@dataclass
class _PendingSave:
    step: int
    staging: Future | None
    upload: Future
    finish: Future | None  # rank 0: marker + rename


class CheckpointManager:
    """Saves and loads the whole training state of the ``[checkpoint]`` section under
    ``{dump_folder}/{checkpoint.folder}``; see the module docstring for the format.

    ``states`` holds extra Stateful objects whose state_dict() is plain JSON data (the
    trainer's ``{"step": N}``). ``state_dict_adapter``: the model's Hugging Face mapping, for
    ``initial_load_in_hf`` and ``last_save_in_hf`` (None: the model has none). ``lora``: the
    run trains LoRA adapters on a frozen base (None: it does not); base weights then load
    without adapters, and with ``lora.save_adapters_only`` checkpoints hold the adapters
    and the run state only, the base loading first at every start. ``pending_base``: QLoRA's
    base weights, still on meta: whatever load brings the base fills them (block by block,
    quantized as they come). Coordination
    uses a dedicated gloo group, so that async saves never interleave with training
    collectives; the data-loader state is gathered over ``parallel_dims.world_mesh["dp"]``.
    """

    def __init__(
        self,
        checkpoint: CheckpointConfig,
        *,
        dump_folder: str,
        dataloader: Any,
        model_parts: list[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        parallel_dims: ParallelDims,
        state_dict_adapter: StateDictAdapter | None = None,
        lora: LoRAConfig | None = None,
        pending_base: PendingBase | None = None,
    ) -> None:
        self.config = checkpoint
        self.lora = lora
        self.pending_base = pending_base
        self.adapters_only = lora is not None and lora.save_adapters_only
        self.state_dict_adapter = state_dict_adapter
        self.enable = self.config.enable
        self.dataloader = dataloader
        self.model_parts = model_parts
        self.optimizers = optimizers
        self.lr_schedulers = lr_schedulers
        self.states = dict(states)
        self.parallel_dims = parallel_dims
        self.root = checkpoint_root(self.config.folder, dump_folder)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.excluded = self._check_exclusions(self.config.exclude_from_loading)
        self._async = self.config.async_mode != "disabled"
        self._pending: _PendingSave | None = None
        self._stager = None
        self._group = None
        self._worker: ThreadPoolExecutor | None = None
        if self.enable or self.config.create_seed_checkpoint:
            self._group = dist.new_group(backend="gloo")
            if self.rank == 0:  # rank 0 publishes and purges, in order, off the training thread
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
            if self.config.async_mode == "async_with_pinned_mem":
                self._stager = self._pinned_memory_stager()

    # ------------------------------------------------------------------ set-up
    def _check_exclusions(self, names: list[str]) -> set[str]:
        valid = (*_BUILTIN_STATES, *self.states)
        unknown = [n for n in names if n not in valid]
        if unknown:
            raise ConfigError(
                f"checkpoint.exclude_from_loading: unknown state(s) {', '.join(unknown)}; "
                f"choose from {', '.join(valid)}"
            )
        return set(names)

    @staticmethod
    def _pinned_memory_stager() -> DefaultStager | None:
        """Stages GPU tensors to pinned CPU memory in the background (maybe_wait_for_staging
        waits for it); None (plain async staging) without CUDA."""
        if not torch.cuda.is_available():
            logger.info(
                "checkpoint.async_mode=async_with_pinned_mem: pinned memory needs CUDA; "
                "staging to ordinary CPU memory (as async)"
            )
            return None
        return DefaultStager(
            StagingOptions(
                use_pinned_memory=True,
                use_shared_memory=False,
                use_async_staging=True,
                use_non_blocking_copy=True,
            )
        )

    @property
    def _dp_group(self):
        if not self.parallel_dims.dp_enabled:
            return None
        return self.parallel_dims.world_mesh["dp"].get_group()

    # ------------------------------------------------------------------ saving
    def _should_save(self, step: int, last_step: bool, force: bool) -> bool:
        if not self.enable or self.config.load_only:
            return False
        if force or last_step or step % self.config.interval == 0:
            return True
        return step == 1 and self.config.enable_first_step_checkpoint

    def save(self, curr_step: int, last_step: bool = False, force: bool = False) -> None:
        """Save after step ``curr_step``: every ``interval`` steps, after step 1 with
        ``enable_first_step_checkpoint``, at the last step (model only with
        ``last_save_model_only``) and always when ``force`` (a full checkpoint that is
        complete when this returns: preemption, debug.stop_after_step)."""
        if not self._should_save(curr_step, last_step, force):
            return
        if last_step and not force and self.config.last_save_in_hf:
            self._save_hf(curr_step)
            return
        model_only = last_step and not force and self.config.last_save_model_only
        dtype = self.config.export_dtype if model_only else None
        self._write(
            curr_step, model_only=model_only, dtype=dtype, blocking=force or not self._async
        )

    def _write(self, step: int, *, model_only: bool, dtype: str | None, blocking: bool) -> None:
        """Save a checkpoint; ``dtype`` (model-only exports) casts the weights."""
        self._wait_for_pending()
        start = time.perf_counter()
        tensors = self._tensor_state(model_only, dtype)
        manifest = self._manifest(step, model_only, dtype, tensors)
        final, tmp = self.root / f"step-{step}", save_folder(self.root, step)
        if self.rank == 0:  # before DCP's planning collective, so before any rank writes
            with self._storage_failures(step):
                remove_tree(tmp)
        writer = FsspecWriter(str(final)) if is_object_store(final) else FileSystemWriter(tmp)
        kind = "model-only " if model_only else ""
        if blocking:
            with self._storage_failures(step):
                dcp.save(tensors, storage_writer=writer, process_group=self._group)
                if self.rank == 0:  # the worker thread does every rename and delete, in order
                    self._worker.submit(self._finish, None, tmp, final, manifest, start).result()
            if self.rank == 0:
                self._worker.submit(self._purge)
            return
        logger.info(f"saving {kind}checkpoint step-{step} in the background")
        response = dcp.async_save(
            tensors, storage_writer=writer, process_group=self._group, async_stager=self._stager
        )
        staging, upload = (
            (response.staging_completion, response.upload_completion)
            if isinstance(response, AsyncSaveResponse)
            else (None, response)
        )
        finish = None
        if self.rank == 0:
            finish = self._worker.submit(self._finish, upload, tmp, final, manifest, start)
            self._worker.submit(self._purge)
        self._pending = _PendingSave(step, staging, upload, finish)

    def _tensor_state(self, model_only: bool, dtype: str | None) -> dict[str, Any]:
        keys = "adapters" if self.adapters_only else "all"
        tensors: dict[str, Any] = self._model_state_dict(keys)
        if dtype is not None:
            tensors = {k: v.to(TORCH_DTYPES[dtype]) for k, v in tensors.items()}
        if model_only:
            return tensors
        tensors["optimizer"] = self.optimizers.state_dict()
        tensors["rng"] = {f"rank{self.rank}": self._rng_state()}
        return tensors

    def _model_state_dict(self, keys: str) -> dict[str, Any]:
        """The model's state dict: ``all`` entries, only the LoRA ``adapters`` or only the
        ``base`` (everything but the adapters)."""
        merged: dict[str, Any] = {}
        for part in self.model_parts:
            merged.update(get_model_state_dict(part))
        for fqn in self._pending_fqns():
            del merged[fqn]  # on meta until the load fills it
        if keys == "all":
            return merged
        return {k: v for k, v in merged.items() if is_lora_param(k) == (keys == "adapters")}

    def _pending_fqns(self) -> set[str]:
        return self.pending_base.fqns if self.pending_base is not None else set()

    @staticmethod
    def _rng_state() -> dict[str, torch.Tensor]:
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def _manifest(
        self, step: int, model_only: bool, dtype: str | None, tensors: dict[str, Any]
    ) -> dict[str, Any]:
        """The manifest with the JSON states, taken now (the data-loader gather is a
        collective over the dp group, so every rank calls this)."""
        manifest = {
            "format": FORMAT,
            "step": step,
            "model_only": model_only,
            "dtype": dtype,
            "world_size": self.world_size,
            "dp_degree": self.parallel_dims.dp_degree,
            "adapters_only": self.adapters_only,
            "rng": [] if model_only else sorted(tensors["rng"][f"rank{self.rank}"]),
            "states": {},
        }
        if model_only:
            return manifest
        states = {"lr_scheduler": self.lr_schedulers.state_dict()}
        states.update({name: obj.state_dict() for name, obj in self.states.items()})
        if self.dataloader is not None:
            states["dataloader"] = self._merged_data_state()
        manifest["states"] = plain_json(states)
        return manifest

    def _merged_data_state(self) -> dict[str, Any]:
        local = self.dataloader.state_dict()
        # Under replica-group fault tolerance a group saves and resumes its own ranks' shards.
        partial = self.parallel_dims.replica_groups > 1
        group = self._dp_group
        if group is None:
            return merge_data_states([local], partial)
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, local, group=group)
        return merge_data_states(gathered, partial)

    def _finish(
        self, upload: Future | None, tmp: Path, final: Path, manifest: dict[str, Any], start: float
    ) -> None:
        """Rank 0, once every rank's files are written: marker, then the atomic rename."""
        if upload is not None:
            upload.result()
        publish(tmp, final, manifest)
        kind = "model-only checkpoint" if manifest["model_only"] else "checkpoint"
        logger.info(f"saved {kind} {final} in {time.perf_counter() - start:.2f}s")

    def _purge(self) -> None:
        try:
            deleted = purge_old_checkpoints(self.root, self.config.keep_latest_k)
        except OSError as e:
            logger.warning(f"checkpoint.keep_latest_k: could not delete old checkpoints: {e}")
            return
        if deleted:
            logger.info(
                f"deleted old checkpoints (keep_latest_k={self.config.keep_latest_k}): "
                + ", ".join(f"step-{s}" for s in deleted)
            )

    def maybe_wait_for_staging(self) -> None:
        """Before the optimizer step: the tensors being staged must not change under it."""
        if self._pending is not None and self._pending.staging is not None:
            self._pending.staging.result()
            self._pending.staging = None

    def _wait_for_pending(self) -> None:
        """Finish the background save (every rank: its upload; rank 0: also the rename)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        with self._storage_failures(pending.step):
            if pending.staging is not None:
                pending.staging.result()
            pending.upload.result()
            if pending.finish is not None:
                pending.finish.result()

    @contextlib.contextmanager
    def _storage_failures(self, step: int) -> Iterator[None]:
        """A save that the storage failed (after its client's retries) is one line; the
        step stays unpublished, so the checkpoints committed before it are what loads."""
        try:
            yield
        except (OSError, CheckpointException) as e:
            raise StorageError(
                f"checkpoint.folder: saving step-{step} into {self.root} failed "
                f"({first_line(e)}); the checkpoints committed before it stay loadable"
            ) from None

    # ------------------------------------------------------------------ loading
    def load(self, step: int = -1) -> bool:
        """Restore the state from ``step`` (-1: the newest complete checkpoint, preferring
        full ones over model-only exports, else checkpoint.initial_load_path), then, unless
        a checkpoint of this run was resumed, the adapters of lora.peft_adapter_path; return
        whether anything was loaded."""
        if not self.enable:
            return False
        choice = self._decided(lambda: self._choose(step))
        if choice.path is None:
            logger.info(f"no checkpoint in {self.root}; starting from scratch")
        else:
            if choice.manifest and choice.manifest.get("adapters_only"):
                self._load_base()
            self._load_choice(choice)
        resumed = choice.path is not None and not choice.base
        if self.lora is not None and self.lora.peft_adapter_path and not resumed:
            field = "lora.peft_adapter_path"
            load_peft_adapter(
                self.model_parts, self.lora.peft_adapter_path, self._adapter(field), self.lora
            )
            return True
        return choice.path is not None

    def load_initial_weights(self, parts: list[nn.Module]) -> bool:
        """The configured initial weights (checkpoint.initial_load_path, Hugging Face or DCP)
        into ``parts``, a second model laid out as this run's (DPO's frozen reference, which
        starts where the policy started whether or not this run resumes); False where none
        is configured (the seeded initialisation stands) or checkpointing is off."""
        if not self.enable:
            return False
        choice = self._decided(lambda: choose_initial_weights(self.config, self._hf_assets_path()))
        if choice.path is None:
            return False
        policy, pending = self.model_parts, self.pending_base
        self.model_parts, self.pending_base = parts, None
        try:
            if choice.hf:
                self._load_choice(choice)
            else:
                path = storage_path(choice.path, "checkpoint.initial_load_path")
                self._load(path, choice.manifest, model_only=True, keys="all")
        finally:
            self.model_parts, self.pending_base = policy, pending
        return True

    def _decided(self, choose: Callable[[], LoadChoice]) -> LoadChoice:
        """Rank 0's choice on every rank; its error raised on every rank."""
        objects = [choose() if self.rank == 0 else None]
        dist.broadcast_object_list(objects, src=0, group=self._group)
        if objects[0].error:
            raise ConfigError(objects[0].error)
        return objects[0]

    def _load_choice(self, choice: LoadChoice) -> None:
        if choice.hf:
            with reading_from(storage_path(choice.path, "checkpoint.initial_load_path")) as local:
                self._load_hf(local)
            return
        keys = "all"
        if choice.manifest and choice.manifest.get("adapters_only"):
            keys = "adapters"
        elif choice.base and self.lora is not None:
            keys = "base"
        path = storage_path(choice.path, "checkpoint.initial_load_path")
        self._load(path, choice.manifest, choice.model_only, keys)

    def _load_base(self) -> None:
        """Before an adapters-only checkpoint: the frozen base from the initial weights."""
        choice = self._decided(lambda: choose_initial_weights(self.config, self._hf_assets_path()))
        if choice.path is None:
            logger.info(
                "lora: no checkpoint.initial_load_path; the frozen base is this run's seeded "
                "initialisation"
            )
            return
        self._load_choice(choice)

    def _choose(self, step: int) -> LoadChoice:
        """Rank 0: the leftovers of interrupted saves removed, which checkpoint to load."""
        remove_leftovers(self.root)
        return choose_checkpoint(self.root, step, self.config, self._hf_assets_path())

    def _hf_assets_path(self) -> str | None:
        adapter = self.state_dict_adapter
        return adapter.hf_assets_path if adapter is not None else None

    def _adapter(self, field: str) -> StateDictAdapter:
        if self.state_dict_adapter is None:
            raise ConfigError(f"{field}: this model has no Hugging Face state-dict adapter")
        return self.state_dict_adapter

    def _load_hf(self, path: Path) -> None:
        field = "checkpoint.initial_load_path"
        try:
            weights = load_hf_weights(self.model_parts, path, self._adapter(field), field)
            if self.pending_base is not None:
                self.pending_base.fill(weights.load_into)
        except HFCheckpointError as e:
            raise ConfigError(str(e)) from None

    def _save_hf(self, step: int) -> None:
        if self.lora is not None:
            adapter = self._adapter("checkpoint.last_save_in_hf")
            save_peft_adapter(self.model_parts, self.root / f"step-{step}-peft", adapter, self.lora)
        folder = self.root / f"step-{step}-hf"
        dtype = TORCH_DTYPES[self.config.export_dtype]
        try:
            save_hf_weights(
                self.model_parts,
                folder,
                self._adapter("checkpoint.last_save_in_hf"),
                dtype,
                self.parallel_dims,
            )
        except HFCheckpointError as e:
            raise ConfigError(str(e)) from None

    def create_seed_checkpoint(self) -> None:
        """Write the freshly initialised weights as step-0 (one process); any layout that
        loads it starts from identical weights."""
        check_seed_folder(self.root)
        remove_leftovers(self.root)
        self._write(0, model_only=True, dtype=None, blocking=True)
        self._wait_for_pending()
        logger.info(f"seed checkpoint written to {self.root / 'step-0'}")

    def _load(
        self, path: Path, manifest: dict[str, Any] | None, model_only: bool, keys: str
    ) -> None:
        start = time.perf_counter()
        wanted = (
            {"model"} if model_only else set(_BUILTIN_STATES) | set(self.states)
        ) - self.excluded
        rng_kinds = self._rng_kinds(manifest) if "rng" in wanted else []
        tensors: dict[str, Any] = {}
        if "model" in wanted:
            tensors.update(self._model_state_dict(keys))
        if "optimizer" in wanted:
            tensors["optimizer"] = self.optimizers.state_dict()
        if rng_kinds:
            current = self._rng_state()
            tensors["rng"] = {f"rank{self.rank}": {k: current[k] for k in rng_kinds}}
        if tensors:
            self._dcp_load(tensors, path)
        pending = self._pending_fqns()
        self._apply_tensors(tensors, strict=keys == "all" and not pending)
        if "model" in wanted and keys != "adapters" and pending:
            self.pending_base.fill(lambda block: self._dcp_load(block, path))
        loaded = [name for name in ("model", "optimizer") if name in wanted]
        loaded += ["rng"] if rng_kinds else []
        loaded += self._apply_json_states(manifest["states"] if manifest else {}, wanted, manifest)
        step = manifest["step"] if manifest else "?"
        logger.info(
            f"loaded checkpoint {path} (step {step}; {', '.join(loaded) or 'nothing'}) "
            f"in {time.perf_counter() - start:.2f}s"
        )
        if model_only and manifest and manifest["step"] > 0:
            logger.warning(
                f"{path} holds model weights only: optimizer, data position and step start fresh"
            )

    def _dcp_load(self, tensors: dict[str, Any], path: Path) -> None:
        hint = (
            "; load it with the model flavor that saved it, or skip states with "
            "checkpoint.exclude_from_loading"
        )
        try:
            load_dcp(tensors, path, process_group=self._group, hint=hint)
        except LoadError as e:
            raise ConfigError(str(e)) from None

    def _rng_kinds(self, manifest: dict[str, Any] | None) -> list[str]:
        if not manifest or not manifest["rng"]:
            return []
        if manifest["world_size"] != self.world_size:
            logger.info(
                f"RNG states not restored: saved by {manifest['world_size']} ranks, now "
                f"{self.world_size}; every rank keeps its seeded state"
            )
            return []
        return [kind for kind in manifest["rng"] if kind in self._rng_state()]

    def _apply_tensors(self, tensors: dict[str, Any], strict: bool) -> None:
        model_keys = {k: v for k, v in tensors.items() if k not in ("optimizer", "rng")}
        if model_keys:
            options = StateDictOptions(strict=strict and len(self.model_parts) == 1)
            for part in self.model_parts:
                set_model_state_dict(part, model_keys, options=options)
        if "optimizer" in tensors:
            self.optimizers.load_state_dict(tensors["optimizer"])
        for kind, state in tensors.get("rng", {}).get(f"rank{self.rank}", {}).items():
            (torch.set_rng_state if kind == "cpu" else torch.cuda.set_rng_state)(state)

    def _apply_json_states(
        self, states: dict[str, Any], wanted: set[str], manifest: dict[str, Any] | None
    ) -> list[str]:
        loaded = []
        if "lr_scheduler" in wanted and "lr_scheduler" in states:
            self.lr_schedulers.load_state_dict(states["lr_scheduler"])
            loaded.append("lr_scheduler")
        if "dataloader" in wanted and "dataloader" in states and self.dataloader is not None:
            try:
                self.dataloader.load_state_dict(states["dataloader"])
            except ValueError as e:  # a data state this run's data settings cannot continue
                raise ConfigError(
                    f"{e}; or start the data from the beginning with "
                    "--checkpoint.exclude_from_loading dataloader"
                ) from None
            data = states["dataloader"]
            layout = (
                f"{data['data_shards']} data shards" if "data_shards" in data else "the sources"
            )
            logger.info(
                f"data position restored for dp degree {self.parallel_dims.dp_degree} (saved under "
                f"dp degree {manifest['dp_degree']}): next global sequence {data['next_position']} "
                f"of {layout}"
            )
            loaded.append("dataloader")
        for name, obj in self.states.items():
            if name in wanted and name in states:
                obj.load_state_dict(states[name])
                loaded.append(name)
        return loaded

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Finish any background save and purge (idempotent)."""
        try:
            self._wait_for_pending()
        finally:
            if self._worker is not None:
                self._worker.shutdown(wait=True)
                self._worker = None
            if self._stager is not None:
                self._stager.close()
                self._stager = None
