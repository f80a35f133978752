"""Local disk vs a local S3 server (SeaweedFS, started here on 127.0.0.1): checkpoint save
and load throughput for the weights of Llama 3's ``1B`` flavor, and the read rate of a token
store::

    python scripts/bench/object_storage.py --output benchmarks/object_storage_cpu.md

Checkpoints: one process writes the weights (random values: nothing compresses) with the paths
training uses: DCP's file-system writer into a local folder, its fsspec writer into ``s3://``,
and reads them back through the hardened loader (``load_dcp``) into a second state dict, then
checks every tensor. The page cache is not dropped between writing and reading the local folder
(a training job's restart usually finds it warm too); the S3 server keeps its volumes on the
same disk. GB/s is 1e9 bytes per second of wall time.

Token store: the embedded corpus prepared by ``scripts/data/prepare.py`` into each, then one
process (one rank, no loader workers) reads ``--sequences`` sequences of 2,049 tokens at
random offsets (what a rank's loader asks of a shuffled store: one positioned read, locally,
or one ranged GET each).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
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
from torchtitan.data.token_store import TokenStore  # noqa: E402
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


def prepare_store(out: str) -> None:
    script = Path(__file__).resolve().parents[1] / "data" / "prepare.py"
    command = [sys.executable, str(script), "--dataset", "python_stdlib", "--out", out]
    subprocess.run(command, check=True, capture_output=True)


def read_rate(folder: str, sequences: int) -> tuple[float, int]:
    """(tokens per second, store tokens) of reading ``sequences`` random sequences."""
    store = TokenStore(folder)
    length = 2049
    generator = torch.Generator().manual_seed(0)
    starts = torch.randint(0, store.num_tokens - length, (sequences,), generator=generator)
    seconds = timed(lambda: [store.tokens(int(s), int(s) + length) for s in starts])
    return sequences * length / seconds, store.num_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="1B")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--sequences", type=int, default=2000)
    parser.add_argument("--output", type=Path, help="write the table here (markdown)")
    args = parser.parse_args()
    state = weights(args.flavor, getattr(torch, args.dtype))
    size = sum(t.numel() * t.element_size() for t in state.values())
    rows, reads = [], []
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        local = Path(tmp) / "local"
        rows.append(("local disk", *measure(state, str(local), FileSystemWriter(local))))
        prepare_store(str(Path(tmp) / "store"))
        reads.append(("local disk", *read_rate(str(Path(tmp) / "store"), args.sequences)))
        server = S3Server(Path(tmp) / "s3")
        try:
            os.environ.update(server.env)
            bucket = server.make_bucket("bench")
            url = f"{bucket}/step-1"
            rows.append(("S3 (SeaweedFS, 127.0.0.1)", *measure(state, url, FsspecWriter(url))))
            prepare_store(f"{bucket}/store")
            reads.append(("S3 (SeaweedFS, 127.0.0.1)", *read_rate(f"{bucket}/store", 500)))
        finally:
            server.stop()
    lines = [
        f"# Object storage throughput ({datetime.now(UTC):%Y-%m-%d})",
        "",
        f"`python scripts/bench/object_storage.py`: Llama 3 `{args.flavor}` weights in "
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
    lines += [
        "",
        f"Token store (the embedded corpus, {reads[0][2]:,} tokens): random sequences of 2,049 "
        f"tokens read by one process ({args.sequences} locally, 500 from S3).",
        "",
        "| storage | tokens/s |",
        "|---|---:|",
        *(f"| {name} | {rate:,.0f} |" for name, rate, _ in reads),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        args.output.write_text(text)


if __name__ == "__main__":
    main()
