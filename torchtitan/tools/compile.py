"""torch.compile of transformer blocks (and the loss) with errors that name the block."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from torchtitan.tools.logging import logger


class CompileError(RuntimeError):
    pass


def _is_compile_failure(error: BaseException) -> bool:
    """Raised by dynamo/inductor themselves (not by the model's own code)."""
    from torch._dynamo.exc import TorchDynamoException

    if isinstance(error, TorchDynamoException):
        return True
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    origin = tb.tb_frame.f_code.co_filename if tb is not None else ""
    return any(part in origin for part in ("torch/_dynamo/", "torch/_inductor/"))


def _name_failures(fn: Callable, name: str) -> Callable:
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            if not _is_compile_failure(e):
                raise
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CompileError(
                f"torch.compile failed for {name} ({first_line}); run without --compile.enable"
            ) from e

    return call


def compile_blocks(
    blocks: nn.ModuleDict,
    backend: str,
    prefix: str = "layers",
    outside: Callable[[nn.Module], bool] = lambda module: False,
) -> None:
    """Compile each block in place (``Module.compile`` keeps parameter FQNs unchanged), one
    graph per block. A block holding a module for which ``outside(module)`` is true (expert
    parallel's experts: their FSDP hooks and token all-to-alls sync with the host) is
    compiled part by part around it, and that module's own computation separately with a
    dynamic row count (tokens per rank vary step to step)."""
    graphs = {}
    for name, block in blocks.items():
        if _holds(block, outside):
            graphs[name] = _compile_around(block, backend, f"{prefix}.{name}", outside)
        else:
            _compile_whole(block, backend, f"{prefix}.{name}")
    logger.info(
        f"compiled {len(blocks)} transformer blocks with backend {backend!r}, one graph each"
        + (
            f" but {len(graphs)} compiled part by part around their expert all-to-alls "
            f"({', '.join(f'{prefix}.{n}: {k} graphs' for n, k in graphs.items())})"
            if graphs
            else ""
        )
    )


def _settled(value):
    """``value``, or where it is an ``AsyncCollectiveTensor`` (tensor parallel's embedding
    output, still in flight), a waited copy: a compiled graph given one returns its
    gradient as a plain tensor where DTensor's redistribute expects a DTensor (torch issue
    184980); the copy keeps autograd's edge to it."""
    return value.clone() if isinstance(value, AsyncCollectiveTensor) else value


def _settling_inputs(fn: Callable) -> Callable:
    def call(*args, **kwargs):
        args = tuple(_settled(a) for a in args)
        return fn(*args, **{k: _settled(v) for k, v in kwargs.items()})

    return call


def _holds(module: nn.Module, outside: Callable[[nn.Module], bool]) -> bool:
    return any(outside(m) for m in module.modules())


def _compile_whole(module: nn.Module, backend: str, name: str) -> None:
    module.compile(backend=backend, fullgraph=True)
    module._compiled_call_impl = _name_failures(_settling_inputs(module._compiled_call_impl), name)


def _compile_around(
    module: nn.Module, backend: str, name: str, outside: Callable[[nn.Module], bool]
) -> int:
    """Compile every child of ``module`` except the path down to the outside modules; the
    glue in the forwards along that path stays eager. Returns how many graphs it made."""
    graphs = 0
    for child_name, child in module.named_children():
        path = f"{name}.{child_name}"
        if outside(child):
            _compile_forward(child, backend, path)
            graphs += 1
        elif _holds(child, outside):
            graphs += _compile_around(child, backend, path, outside)
        elif any(True for _ in child.parameters()):
            _compile_part(child, backend, path)
            graphs += 1
    return graphs


def _compile_part(module: nn.Module, backend: str, name: str) -> None:
    """Like :func:`_compile_whole`, through a function of ours: dynamo does not trace a
    ``torch.nn`` module (a lone ``nn.RMSNorm``) as the root of a graph, only inlined."""
    call = module._call_impl
    compiled = torch.compile(lambda *a, **k: call(*a, **k), backend=backend, fullgraph=True)
    module._compiled_call_impl = _name_failures(_settling_inputs(compiled), name)


def _compile_forward(module: nn.Module, backend: str, name: str) -> None:
    """Compile ``module.forward`` only (its hooks stay eager), its first input's rows
    dynamic."""
    compiled = _settling_inputs(torch.compile(module.forward, backend=backend, fullgraph=True))

    def forward(rows: torch.Tensor, *args, **kwargs):
        rows = _settled(rows)
        torch._dynamo.maybe_mark_dynamic(rows, 0)
        return compiled(rows, *args, **kwargs)

    module.forward = _name_failures(forward, name)


def compile_loss(loss_fn: Callable, backend: str) -> Callable:
    return _name_failures(torch.compile(loss_fn, backend=backend), "the loss function")
