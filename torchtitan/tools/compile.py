"""torch.compile of transformer blocks (and the loss) with errors that name the block."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

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


def compile_blocks(blocks: nn.ModuleDict, backend: str, prefix: str = "layers") -> None:
    """Compile each block in place (``Module.compile`` keeps parameter FQNs unchanged)."""
    for name, block in blocks.items():
        block.compile(backend=backend, fullgraph=True)
        block._compiled_call_impl = _name_failures(block._compiled_call_impl, f"{prefix}.{name}")
    logger.info(f"compiled {len(blocks)} transformer blocks with backend {backend!r}")


def compile_loss(loss_fn: Callable, backend: str) -> Callable:
    return _name_failures(torch.compile(loss_fn, backend=backend), "the loss function")
