"""Replica-group fault tolerance on torchft (``fault_tolerance.enable``).

Each replica group is its own torchrun job with its own layout (FSDP, TP, ...) inside; the
groups together form the fault-tolerant replicate dimension. torchft's lighthouse (address in
``TORCHFT_LIGHTHOUSE``) decides every step which groups take part (the quorum), and a
``torchft.Manager`` per rank runs the collectives between groups on a process group that
survives the loss of a peer: rank r of every group talks to rank r of the others, which holds
the same shards.

- Fault-tolerant HSDP (``semi_sync_method`` unset): every step the groups sum their valid
  token counts and average their gradients, and a step is applied only if every live group
  committed it. A lost group costs the survivors the step in flight; they go on alone.
- ``diloco`` / ``local_sgd``: groups step alone and synchronise every ``sync_steps`` steps
  (torchft's DiLoCo and LocalSGD hooks on the optimizer).

A group that (re)joins behind the others gets the model, optimizer, scheduler and step from a
live peer (torchft's checkpoint transport) before its first step, and its own data-loader
position from the file it writes after every committed step.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.config import CommConfig, ConfigError, FaultToleranceConfig
from torchtitan.distributed.heal_transport import HealRefused, SafeHTTPTransport
from torchtitan.tools.logging import logger
from torchtitan.tools.step_hooks import StepHook

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
_OUTER_LR = 0.7  # DiLoCo's outer Nesterov SGD (Douillard et al. 2023, section 3)
_OUTER_MOMENTUM = 0.9


def lighthouse_address() -> str:
    address = os.environ.get(LIGHTHOUSE_ENV, "")
    if not address:
        raise ConfigError(
            f"fault_tolerance.enable: set {LIGHTHOUSE_ENV} to the lighthouse's address, e.g. "
            "http://localhost:29510 (start it with: "
            "torchft_lighthouse --min_replicas 1 --bind [::]:29510)"
        )
    return address


def check_lighthouse(address: str, timeout_s: float) -> None:
    """One line naming the address when nothing listens there within ``timeout_s``."""
    parsed = urlparse(address if "://" in address else f"http://{address}")
    try:
        with socket.create_connection(
            (parsed.hostname or "localhost", parsed.port or 80), timeout=timeout_s
        ):
            return
    except OSError as e:
        raise ConfigError(
            "fault_tolerance.enable: no torchft lighthouse reachable at "
            f"{LIGHTHOUSE_ENV}={address} ({e.strerror or e}); start it first "
            "(torchft_lighthouse --min_replicas 1 --bind [::]:PORT)"
        ) from None


def check_fault_tolerance_inputs(ft: FaultToleranceConfig) -> None:
    """Before launch: the lighthouse is named, reachable, and the backend fits the machine."""
    if not ft.enable:
        return
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError(
            "fault_tolerance.enable: the torchft package is not installed; "
            "pip install 'torchtitan[ft]'"
        )
    if ft.process_group == "nccl" and not torch.cuda.is_available():
        raise ConfigError(
            "fault_tolerance.process_group: 'nccl' needs CUDA; use 'gloo' on this machine"
        )
    check_lighthouse(lighthouse_address(), ft.process_group_timeout_ms / 1000)


def _without_refused_heals(record: logging.LogRecord) -> bool:
    """torchft logs a failed heal with its traceback; a refused one is reported by
    ``start_step`` in one line instead."""
    return not (record.exc_info and isinstance(record.exc_info[1], HealRefused))


def replica_dump_folder(dump_folder: str, replica_id: int) -> str:
    """Each group writes its own metrics, checkpoints and config under the shared dump folder."""
    return str(Path(dump_folder) / f"replica_{replica_id}")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _to_local_tree(value: Any) -> Any:
    """A state dict with every DTensor replaced by its local shard (what a peer of the same
    layout needs; torchft's transport sends plain tensors)."""
    if isinstance(value, torch.Tensor):
        return _local(value).detach().clone()
    if isinstance(value, dict):
        return {k: _to_local_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_local_tree(v) for v in value)
    return value


def _like(template: Any, local: Any) -> Any:
    """``local`` (a peer's local shard) shaped like ``template`` (a DTensor or a tensor here)."""
    if isinstance(template, DTensor):
        return DTensor.from_local(
            local.to(template.device),
            template.device_mesh,
            template.placements,
            shape=template.shape,
            stride=template.stride(),
        )
    if isinstance(template, torch.Tensor):
        return local.to(template.device)
    return local


def _attempt_store() -> tuple[dist.TCPStore | None, str, int]:
    """A TCPStore for this group's managers, new in every attempt: torchrun's store outlives
    restarts (MAX_RESTARTS), and the manager's keys there would still name the dead
    attempt's manager server. Rank 0 hosts it; (the store on rank 0, its host, its port)."""
    host = socket.gethostname()
    store = (
        dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        if dist.get_rank() == 0
        else None
    )
    address = [host, store.port if store is not None else 0]
    dist.broadcast_object_list(address, src=0)
    return store, address[0], address[1]


class ModelPartsState:
    """The model parts (several under pipeline parallel) as one Stateful: their FQNs are
    distinct."""

    def __init__(self, model_parts: list[nn.Module]) -> None:
        self.model_parts = model_parts

    def state_dict(self) -> dict[str, Any]:
        return {k: v for part in self.model_parts for k, v in part.state_dict().items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part in self.model_parts:
            part.load_state_dict({k: state_dict[k] for k in part.state_dict()})


class ReplicaGroups:
    """This rank's view of the replica groups: the torchft manager and the per-step calls
    the training step makes (quorum, token sum, gradient average, commit)."""

    def __init__(
        self,
        ft: FaultToleranceConfig,
        comm: CommConfig,
        device: torch.device,
        decode_state: Callable[[bytes, str], Any],
    ) -> None:
        """``decode_state(bytes, source)``: how a state received for healing is read (the
        trainer passes safe_loading's, which runs no code)."""
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        self.config = ft
        timeout = timedelta(milliseconds=ft.process_group_timeout_ms)
        pg = (
            ProcessGroupNCCL(timeout=timeout)
            if ft.process_group == "nccl"
            else ProcessGroupGloo(timeout=timeout)
        )
        self.semi_sync = ft.semi_sync_method
        self._store, store_host, store_port = _attempt_store()
        self.manager = Manager(
            pg=pg,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=ft.min_replica_size,
            # quorum before the forward: a healing group gets the peer's weights before it
            # computes anything, and DiLoCo requires it
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=max(60.0, comm.train_timeout_seconds)),
            connect_timeout=timedelta(seconds=comm.init_timeout_seconds),
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            store_addr=store_host,
            store_port=store_port,
            lighthouse_addr=lighthouse_address(),
            replica_id=f"torchtitan_ft_{ft.replica_id}",
            init_sync=False,  # weights are initialised per FQN from the seed: identical already
            checkpoint_transport=SafeHTTPTransport(
                ft.heal_address or socket.gethostname(), timeout, decode_state
            ),
        )
        logging.getLogger("torchft.manager").addFilter(_without_refused_heals)
        self.device = device
        self.live_groups = 0
        self.changed_at_step: int | None = None
        self.committed = True

    # ------------------------------------------------------------------ state for healing
    def register_states(self, states: dict[str, Any]) -> None:
        """``states``: name -> Stateful (model parts, optimizers, schedulers, train state)
        that a group behind the others receives from a live peer."""

        def save() -> dict[str, Any]:
            return {name: _to_local_tree(obj.state_dict()) for name, obj in states.items()}

        def load(incoming: dict[str, Any]) -> None:
            for name, obj in states.items():
                current = obj.state_dict()
                obj.load_state_dict(
                    {k: _like(current.get(k), v) for k, v in incoming[name].items()}
                )
            logger.info(
                "fault tolerance: model, optimizer and step recovered from a live replica group"
            )

        self.manager.register_state_dict_fn("torchtitan", load, save)

    def align_step(self, step: int) -> None:
        """The manager counts committed steps; start it at the trainer's (resumed) step so the
        quorum compares training steps and heals the groups that are behind."""
        self.manager.load_state_dict({"step": step, "batches_committed": step})

    # ------------------------------------------------------------------ the per-step calls
    @property
    def per_step(self) -> bool:
        """Fault-tolerant HSDP: the groups synchronise every step (semi-sync methods do it
        in their optimizer hooks)."""
        return self.semi_sync is None

    def start_step(self) -> None:
        """The quorum of this step; a group behind the others is healed here. A heal whose
        state was refused ends this group with that one line (torchft would retry it)."""
        self.manager.start_quorum()
        error = self.manager.errored()
        if error is not None and isinstance(error.original_exception, HealRefused):
            raise error.original_exception
        self._note_membership(self.manager.current_step() + 1)

    def _note_membership(self, step: int) -> None:
        live = self.manager.num_participants()
        if live != self.live_groups:
            if self.live_groups:
                logger.warning(
                    f"fault tolerance: step {step}: live replica groups {self.live_groups} "
                    f"-> {live}"
                )
            self.live_groups, self.changed_at_step = live, step

    def sum_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The valid tokens of the global batch of all live groups."""
        self.manager.allreduce(tokens, reduce_op=dist.ReduceOp.SUM).wait()
        return tokens

    def average_gradients_and_loss(
        self, params: list[nn.Parameter], losses: list[torch.Tensor]
    ) -> torch.Tensor:
        """Average the gradients over the live groups, and this rank's loss share with them
        (what one job of all the groups' ranks would log): one all-reduce per dtype over the
        flattened local shards (rank r of each group holds the same shards) with the loss
        riding along. Returns the averaged loss."""
        loss = torch.stack([_local(loss) for loss in losses]).sum().reshape(1)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            if p.grad is not None:
                by_dtype.setdefault(p.grad.dtype, []).append(_local(p.grad))
        by_dtype.setdefault(loss.dtype, []).append(loss)
        for tensors in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in tensors])
            self.manager.allreduce(flat).wait()
            offset = 0
            for t in tensors:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        return loss.reshape(())

    def should_commit(self) -> bool:
        """Whether every live group finished this step (the same answer on all its ranks)."""
        self.committed = self.manager.should_commit()
        return self.committed

    def metrics(self, step: int) -> dict[str, int]:
        """For the metrics line: live groups, the step at which that number last changed, and
        under semi-sync the outer synchronisations so far."""
        if not self.per_step and self.manager.num_participants():
            self._note_membership(step)
        extra = {
            "replica_groups": self.live_groups,
            "replica_groups_changed_at": self.changed_at_step or 0,
        }
        if not self.per_step:
            extra["outer_syncs"] = self.manager.current_step()
        return extra

    # ------------------------------------------------------------------ semi-sync
    @contextmanager
    def semi_sync_context(self, model_parts: list[nn.Module], optimizers: Any) -> Iterator[None]:
        """DiLoCo or LocalSGD hooks on the (single) inner optimizer while training runs."""
        if self.semi_sync is None:
            yield
            return
        from torchft.local_sgd import DiLoCo, LocalSGD

        (model,), (inner,) = model_parts, list(optimizers)
        ft = self.config
        if self.semi_sync == "local_sgd":
            wrapper = LocalSGD(self.manager, model, inner, ft.sync_steps)
        else:
            outer = torch.optim.SGD(
                model.parameters(), lr=_OUTER_LR, momentum=_OUTER_MOMENTUM, nesterov=True
            )
            wrapper = DiLoCo(
                self.manager,
                [model],
                inner,
                outer,
                sync_every=ft.sync_steps,
                backup_device=torch.device("cpu"),
                pin_memory=self.device.type == "cuda",
                should_quantize=ft.should_quantize,
                fragment_sync_delay=ft.fragment_sync_delay,
                fragment_update_alpha=ft.fragment_update_alpha,
            )
        with wrapper:
            yield

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


class DataPositionFile:
    """This rank's data-loader position after its last committed step, written atomically
    after every step (``checkpoint.enable_ft_dataloader_checkpoints``), as JSON: plain data,
    nothing to unpickle."""

    def __init__(self, folder: Path, rank: int) -> None:
        self.path = folder / f"ft_data_rank_{rank}.json"

    def save(self, step: int, dataloader_state: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"step": step, "dataloader": dataloader_state}))
        os.replace(tmp, self.path)  # atomic against a killed process; no fsync on the step path

    def load_newer(self, step: int, dataloader: Any) -> None:
        """Take the saved position when it is newer than the checkpoint just loaded."""
        if not self.path.exists():
            return
        saved = json.loads(self.path.read_text())
        if saved["step"] > step:
            dataloader.load_state_dict(saved["dataloader"])
            logger.info(
                f"fault tolerance: data loader resumes after step {saved['step']} "
                "of this replica group"
            )


class DataPositionSaves(StepHook):
    """Writes ``file`` with ``dataloader``'s position after every committed step."""

    def __init__(self, file: DataPositionFile, dataloader: Any) -> None:
        self.file, self.dataloader = file, dataloader

    def step_closed(self, step: int, committed: bool) -> None:
        if committed:
            self.file.save(step, self.dataloader.state_dict())
