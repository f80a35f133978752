"""Training through the Hugging Face source (tiny Llama 3, fp32, gloo): a 3-file parquet set
and a save_to_disk folder of the same documents train with the same losses; a streamed set
stopped at step 10 and resumed with 2 loader workers continues bitwise."""

from __future__ import annotations

from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.launcher import read_metrics, run_torchrun
from tests.parity import train_args

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

STEPS, RESUME_AT = 20, 10


def documents() -> list[str]:
    """Text with structure a tiny model learns within 20 steps."""
    return [
        f"def function_{i}(x):\n    return x * {i % 7} + {i % 5}\n" * (1 + i % 3)
        for i in range(800)
    ]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_training")
    texts = documents()
    for name, files in (("parquet3", 3), ("parquet8", 8)):
        (root / name).mkdir()
        size = -(-len(texts) // files)
        for k in range(files):
            table = pa.table({"text": texts[k * size : (k + 1) * size]})
            pq.write_table(table, root / name / f"part-{k}.parquet")
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(root / "saved"))
    return {name: root / name for name in ("parquet3", "parquet8", "saved")}


def train(folder: Path, dataset: Path, *flags: str, steps: int = STEPS) -> dict[int, dict]:
    args = ["--training.dataset", "hf", "--training.dataset_path", str(dataset)]
    args += ["--training.steps", str(steps), *flags]
    env = {"HF_DATASETS_CACHE": str(folder / "hf_cache")}
    run_torchrun(1, train_args(1, folder, args), env=env, timeout=300)
    return {r["step"]: r for r in read_metrics(folder)}


def test_parquet_files_and_a_save_to_disk_folder_train_alike(folders, tmp_path):
    parquet = train(tmp_path / "parquet", folders["parquet3"], steps=8)
    saved = train(tmp_path / "saved", folders["saved"], steps=8)
    assert [(r["loss"], r["grad_norm"]) for r in parquet.values()] == [
        (r["loss"], r["grad_norm"]) for r in saved.values()
    ]


def test_a_streamed_run_resumes_bitwise_with_other_worker_counts(folders, tmp_path):
    streaming = ["--training.hf.streaming", "--checkpoint.enable"]
    streaming += ["--checkpoint.interval", str(RESUME_AT)]
    straight = train(tmp_path / "straight", folders["parquet8"], *streaming)
    stopped = tmp_path / "stopped"
    first = train(stopped, folders["parquet8"], *streaming, "--debug.stop_after_step", "10")
    assert sorted(first) == list(range(1, RESUME_AT + 1))
    workers = ["--training.dataloader.num_workers", "2"]
    resumed = train(stopped, folders["parquet8"], *streaming, *workers)
    assert [r["step"] for r in read_metrics(stopped)] == list(range(1, STEPS + 1))  # resumed
    for step in range(RESUME_AT + 1, STEPS + 1):
        a, b = straight[step], resumed[step]
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), step
    assert straight[STEPS]["loss"] < straight[1]["loss"] - 0.5
