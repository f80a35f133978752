"""Checkpoint save and load throughput, local disk vs a local S3 server (SeaweedFS, started
here on 127.0.0.1), for the weights of Llama 3's ``1B`` flavor::

    python scripts/bench/checkpoint_storage.py --output benchmarks/checkpoint_storage_cpu.md

One process writes the weights (random values: nothing compresses) with the paths training
uses: DCP's file-system writer into a local folder, its fsspec writer into ``s3://``, and
reads them back through the hardened loader (``load_dcp``) into a second state dict, then
checks every tensor. The page cache is not dropped between writing and reading the local
folder (a training job's restart usually finds it warm too); the S3 server keeps its volumes
on the same disk. GB/s is 1e9 bytes per second of wall time.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.s3_server import S3Server  # noqa: E402
from torchtitan.components.checkpointing.safe_loading import load_dcp  # noqa: E402
from torchtitan.protocols.train_spec import get_train_spec  # noqa: E402


def weights(flavor: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    spec = get_train_spec("llama3")
    with torch.device("meta"):
        model = spec.model_cls(spec.flavor_args(flavor))
    generator = torch.Generator().manual_seed(0)
    return {
        name: torch.randn(p.shape, generator=generator).to(dtype)
        for name, p in model.state_dict().items()
    }


def timed(action) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def measure(state: dict[str, torch.Tensor], folder: str, writer) -> tuple[float, float]:
    """(save seconds, load seconds) of ``state`` at ``folder``."""
    save = timed(lambda: dcp.save(state, storage_writer=writer, no_dist=True))
    target = {k: torch.empty_like(v) for k, v in state.items()}
    load = timed(lambda: load_dcp(target, folder))
    for key, value in state.items():
        assert torch.equal(target[key], value), key
    return save, load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="1B")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--output", type=Path, help="write the table here (markdown)")
    args = parser.parse_args()
    state = weights(args.flavor, getattr(torch, args.dtype))
    size = sum(t.numel() * t.element_size() for t in state.values())
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        local = Path(tmp) / "local"
        rows.append(("local disk", *measure(state, str(local), FileSystemWriter(local))))
        server = S3Server(Path(tmp) / "s3")
        try:
            os.environ.update(server.env)
            url = f"{server.make_bucket('bench')}/step-1"
            rows.append(("S3 (SeaweedFS, 127.0.0.1)", *measure(state, url, FsspecWriter(url))))
        finally:
            server.stop()
    lines = [
        f"# Checkpoint storage throughput ({datetime.now(UTC):%Y-%m-%d})",
        "",
        f"`python scripts/bench/checkpoint_storage.py`: Llama 3 `{args.flavor}` weights in "
        f"{args.dtype}, {size / 1e9:.2f} GB in {len(state)} tensors, one process, "
        f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
        f"torch {torch.__version__}.",
        "",
        "| storage | save s | save GB/s | load s | load GB/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, save, load in rows:
        lines.append(
            f"| {name} | {save:.1f} | {size / save / 1e9:.2f} | {load:.1f} | "
            f"{size / load / 1e9:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        args.output.write_text(text)


if __name__ == "__main__":
    main()
