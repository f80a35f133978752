"""The project logger: one console format, rank-aware."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("torchtitan")


def init_logger() -> None:
    """Console logging at INFO with the rank in each line (idempotent)."""
    if getattr(logger, "_torchtitan_configured", False):
        return
    logger.setLevel(logging.INFO)
    handler = logging.StreamHandler()
    rank = os.environ.get("RANK")
    prefix = f"[rank{rank}]" if rank is not None else ""
    handler.setFormatter(
        logging.Formatter(f"{prefix}[titan] %(asctime)s - %(levelname)s - %(message)s", "%H:%M:%S")
    )
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger._torchtitan_configured = True  # type: ignore[attr-defined]


def silence_non_logging_ranks(log_ranks: str | None) -> None:
    """Only the ranks listed in LOG_RANK (comma-separated; default "0") log below WARNING."""
    rank = int(os.environ.get("RANK", "0"))
    ranks = {int(r) for r in (log_ranks or "0").split(",") if r.strip()}
    if rank not in ranks:
        logger.setLevel(logging.WARNING)
