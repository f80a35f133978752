"""Process-group start-up, determinism, cross-rank reductions and gradient clipping."""

from __future__ import annotations

import atexit
import logging
import math
import os
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchtitan.distributed.parallel_dims import ParallelDims, default_device_type
from torchtitan.distributed.restarts import WORKER_START_ENV
from torchtitan.tools.logging import logger
from torchtitan.tools.step_hooks import StepHook

if TYPE_CHECKING:
    from torchtitan.config import CommConfig


def init_distributed(comm: CommConfig, dump_folder: str, cpu_offload: bool = False) -> torch.device:
    """Pick the device from the machine (cuda+nccl, else cpu+gloo; with ``cpu_offload`` also
    gloo for the CPU tensors) and start the default process group from torchrun's environment."""
    device_type = default_device_type()
    # torch's flight recorder (gloo too, torch >= 2.7): the hang watchdog dumps it
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(comm.trace_buf_size))
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo" if cpu_offload else "nccl"
        _set_nccl_env(comm, dump_folder)
    else:
        device = torch.device(device_type)
        backend = (
            "gloo"
            if device_type == "cpu"
            else dist.Backend.default_device_backend_map.get(device_type, "gloo")
        )
    if not dist.is_initialized():
        timeout = timedelta(seconds=comm.init_timeout_seconds)
        attempt = os.environ.get(WORKER_START_ENV)
        if attempt is None:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
            # torchrun keeps one store across restarts; without a prefix per attempt the
            # process groups of a restarted attempt can read the dead attempt's addresses
            store = dist.PrefixStore(f"torchtitan_attempt_{attempt}", store)
            dist.init_process_group(
                backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout
            )
    return device


def leave_together() -> None:
    """Barrier, then destroy every process group: no rank tears down its connections while
    a peer is still finishing its last collective. Only on the success path: a barrier with
    a failed peer waits for the timeout."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_skipping_static_destructors(code: int = 0) -> NoReturn:
    """End a worker process that used gloo process groups, after a clean finish or a
    planned early exit (a user error: 2): Python's exit handlers run and the streams are
    flushed; C++ static destructors do not. With torch 2.13 on CPU such a process sometimes
    aborts in them ("terminate called without an active exception"; about one run in five
    after the torch profiler ran, rarely otherwise) although its work is done and its
    process groups are destroyed, which would turn a finished run into a failed one, and a
    refused input into a crash (SIGABRT instead of exit 2). Only where a worker process
    ends (entry points), never in code that tests call in-process."""
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_worker_entry_point(main: Callable[[], int | None]) -> NoReturn:
    """Run a worker process's ``main`` and end the process with its return value as the exit
    status, without C++ static destructors (see above), also when ``main`` ends with
    ``sys.exit`` (a user error, a non-finite loss); an uncaught exception still ends the
    process with its traceback."""
    try:
        code = _exit_status(main())
    except SystemExit as e:
        code = _exit_status(e.code)
    exit_skipping_static_destructors(code)


def _exit_status(code: object) -> int:
    """The status ``sys.exit(code)`` ends with: None is 0, an int itself, anything else is
    printed to stderr and gives 1."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def _set_nccl_env(comm: CommConfig, dump_folder: str) -> None:
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    if comm.trace_buf_size > 0:
        folder = os.path.join(dump_folder, comm.save_traces_folder)
        os.makedirs(folder, exist_ok=True)
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        prefix = os.path.join(folder, comm.save_traces_file_prefix)
        os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", prefix)


class TrainTimeouts(StepHook):
    """``comm.train_timeout_seconds`` for every collective once the first step is done."""

    def __init__(self, timeout_seconds: int, parallel_dims: ParallelDims) -> None:
        self.timeout_seconds, self.parallel_dims = timeout_seconds, parallel_dims

    def step_closed(self, step: int, committed: bool) -> None:
        if step == 1 and committed:
            set_pg_timeouts(self.timeout_seconds, self.parallel_dims)


def set_pg_timeouts(timeout_seconds: int, parallel_dims: ParallelDims) -> None:
    """After the first step (compiles, warm-up done), tighten collective timeouts."""
    timeout = timedelta(seconds=timeout_seconds)
    groups = {None}
    mesh = parallel_dims.world_mesh
    for name in mesh.view_names:
        groups.update(mesh[name].get_all_groups())
    for group in groups:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        try:
            pg._get_backend(torch.device(mesh.device_type))._set_default_timeout(timeout)
        except (RuntimeError, AttributeError):
            pass  # backends without a settable timeout keep the init timeout


def set_determinism(
    parallel_dims: ParallelDims,
    device: torch.device,
    seed: int | None,
    deterministic: bool,
    warn_only: bool = False,
    saved_seed: int | None = None,
) -> int:
    """Seed every rank identically and return the seed, which also seeds the per-FQN weight
    init. When none is given: rank 0's ``saved_seed`` (the resumed run's), else a random
    one drawn on rank 0. ``warn_only``: an op without a deterministic implementation warns
    instead of raising."""
    if seed is None:
        t = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=device)
        if saved_seed is not None:
            t.fill_(saved_seed)
        if dist.is_initialized():
            dist.broadcast(t, src=0)
        seed = int(t.item())
    pp_rank = parallel_dims.world_mesh["pp"].get_local_rank() if parallel_dims.pp_enabled else 0
    torch.manual_seed(seed + pp_rank)
    if deterministic:
        logger.info("deterministic algorithms enabled (slower)")
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    return seed


def dist_reduce(x: torch.Tensor, op: str, mesh: DeviceMesh | None) -> float:
    """All-reduce a scalar over ``mesh`` ('sum', 'avg' or 'max'); one host sync."""
    if mesh is None:
        return x.item()
    if isinstance(x, DTensor):
        x = x.full_tensor()
    t = x.detach().clone().float()
    if op == "avg":
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=mesh.get_group())
        t /= mesh.size()
    else:
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        dist.all_reduce(t, op=reduce_op, group=mesh.get_group())
    return t.item()


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    foreach: bool | None = None,
    pp_mesh: DeviceMesh | None = None,
) -> torch.Tensor:
    """Clip gradients by their total norm over all ranks and return that (pre-clip) norm.

    DTensor gradients (FSDP/TP shards) reduce to the full norm, per device mesh (expert
    parallel puts experts and dense parameters on different meshes), and the per-mesh norms
    are combined; with pipeline parallel the per-stage norms are combined over the pp group.
    """
    by_mesh: dict[DeviceMesh | None, list[torch.Tensor]] = defaultdict(list)
    for p in parameters:
        if p.grad is not None:
            by_mesh[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p)
    norms = []
    for params in by_mesh.values() or [[]]:
        grads = [p.grad for p in params]
        norm = torch.nn.utils.get_total_norm(
            grads, norm_type, error_if_nonfinite=False, foreach=foreach
        )
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total_norm = (
        norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms), norm_type)
    )
    if pp_mesh is not None:
        if math.isinf(norm_type):
            dist.all_reduce(total_norm, op=dist.ReduceOp.MAX, group=pp_mesh.get_group())
        else:
            total_norm **= norm_type
            dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
            total_norm **= 1.0 / norm_type
    for params in by_mesh.values():  # foreach kernels take one mesh at a time
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm, foreach=foreach)
    return total_norm
