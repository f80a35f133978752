"""Checkpoints on object storage, against a real S3 server (SeaweedFS on 127.0.0.1, started here):
saved under FSDP 2 into ``s3://``, a resume from step 2 repeats steps 3-4 bitwise, and a resume
under FSDP 2 x TP 2 gives them within 1e-4; a step whose save did not commit its marker is never
loaded and is purged; Hugging Face weights load from ``s3://`` and export back there bit for bit;
a token store prepared into ``s3://`` trains as the same store on local disk, bitwise; a save the
storage refuses mid-run, bad credentials, a missing bucket and an unknown scheme end in one
``error:`` line, exit 2, with nothing written."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from scripts.s3_server import S3Server
from tests.launcher import run_command
from tests.parity import assert_parity, train

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

TP2 = ["--parallelism.tensor_parallel_degree", "2"]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = S3Server(tmp_path_factory.mktemp("s3"))
    yield server
    server.stop()


def checkpointing(folder: str) -> list[str]:
    return [
        *("--checkpoint.enable", "--checkpoint.interval", "2", "--training.steps", "4"),
        *("--checkpoint.no_last_save_model_only", "--checkpoint.folder", folder),
    ]


def test_resume_and_reshard_from_s3_repeat_the_uninterrupted_run(s3, tmp_path):
    bucket = s3.make_bucket("resume")
    flags = checkpointing(f"{bucket}/run")
    whole = train(2, tmp_path / "whole", flags, env=s3.env)
    fs = s3.filesystem()
    assert sorted(fs.ls("resume/run")) == ["resume/run/step-2", "resume/run/step-4"]
    marker = json.loads(fs.cat("resume/run/step-2/checkpoint.json"))
    assert marker["files"] == {
        name.rsplit("/", 1)[1]: fs.info(name)["size"]
        for name in fs.ls("resume/run/step-2")
        if not name.endswith("checkpoint.json")
    }
    # step 4 as a save killed before its marker left it: its files, no marker
    fs.rm("resume/run/step-4/checkpoint.json")
    resumed = train(2, tmp_path / "resumed", flags, env=s3.env)
    assert [r["step"] for r in resumed] == [3, 4]
    for got, want in zip(resumed, whole[2:]):
        assert (got["loss"], got["grad_norm"]) == (want["loss"], want["grad_norm"]), got["step"]
    fs.rm("resume/run/step-4", recursive=True)
    resharded = train(4, tmp_path / "resharded", flags + TP2, dp=2, env=s3.env)
    assert_parity(whole[2:], resharded)


def test_hugging_face_weights_round_trip_through_s3(s3, tmp_path):
    """A Hugging Face folder in the bucket is the initial weights of an FSDP 2 run; with a
    learning rate of 1e-30 (no fp32 weight moves) its export into the bucket holds exactly
    those weights."""
    from safetensors.torch import load_file

    from scripts.hf_compat import TOKENIZER
    from tests.integration_tests.test_parity_hf import llama3_folder

    tokenizer = ["--model.tokenizer_path", str(TOKENIZER)]
    published = llama3_folder(tmp_path, tokenizer)
    bucket = s3.make_bucket("hf-weights")
    fs = s3.filesystem()
    fs.put(str(published), "hf-weights/published", recursive=True)
    train(
        2,
        tmp_path / "run",
        tokenizer
        + [
            *("--checkpoint.enable", "--checkpoint.folder", f"{bucket}/run"),
            *("--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path"),
            f"{bucket}/published",
            *("--checkpoint.last_save_in_hf", "--checkpoint.interval", "2"),
            *("--training.steps", "2", "--optimizer.lr", "1e-30", "--optimizer.weight_decay", "0"),
        ],
        env=s3.env,
    )
    fs.get("hf-weights/run/step-2-hf/model.safetensors", str(tmp_path / "exported.safetensors"))
    original = load_file(published / "model.safetensors")
    exported = load_file(tmp_path / "exported.safetensors")
    assert exported.keys() == original.keys()
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key


def prepare_store(out: str, env: dict[str, str]) -> None:
    result = run_command(
        [sys.executable, "scripts/data/prepare.py", "--dataset", "python_stdlib", "--out", out],
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout


def test_a_token_store_on_s3_trains_as_on_local_disk(s3, tmp_path):
    """Prepared into the bucket (uploaded, manifest last) and read with ranged GETs by 2
    loader workers per rank under FSDP 2: the same losses as the local store, bitwise."""
    bucket = s3.make_bucket("stores")
    prepare_store(f"{bucket}/stdlib", s3.env)
    prepare_store(str(tmp_path / "stdlib"), {})
    fs = s3.filesystem()
    assert json.loads(fs.cat("stores/stdlib/manifest.json")) == json.loads(
        (tmp_path / "stdlib" / "manifest.json").read_text()
    )
    runs = {}
    for name, path in (("s3", f"{bucket}/stdlib"), ("local", str(tmp_path / "stdlib"))):
        data = ["--training.dataset", "tokens", "--training.dataset_path", path]
        workers = ["--training.dataloader.num_workers", "2", "--training.steps", "4"]
        runs[name] = train(2, tmp_path / name, data + workers, env=s3.env)
    assert [(r["loss"], r["grad_norm"]) for r in runs["s3"]] == [
        (r["loss"], r["grad_norm"]) for r in runs["local"]
    ]


def test_a_file_replaced_with_the_same_size_is_caught_by_its_etag(s3, monkeypatch):
    """The marker records each file's ETag (the store's content hash): a file replaced by
    other bytes of the same size makes the step corrupt, without reading it back."""
    from torchtitan.components.checkpointing.folders import inspect_checkpoint, publish
    from torchtitan.tools.storage import storage_path

    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    bucket = s3.make_bucket("etags")
    step = storage_path(f"{bucket}/run/step-1", "checkpoint.folder")
    (step / "__0_0.distcp").write_bytes(b"a" * 64)
    publish(step, step, {"step": 1, "model_only": False})
    (step / "__0_0.distcp").write_bytes(b"b" * 64)
    manifest, problem = inspect_checkpoint(step)
    assert manifest is None and "__0_0.distcp was replaced" in problem, problem


# case -> (checkpoint.folder, environment beside the server's, the error line's start)
BAD_INPUT = {
    "wrong credentials": (
        "s3://bad-input/run",
        {"AWS_SECRET_ACCESS_KEY": "not-the-secret"},
        "error: checkpoint.folder: s3://bad-input/run refused these credentials",
    ),
    "missing bucket": (
        "s3://no-such-bucket/run",
        {},
        "error: checkpoint.folder: the bucket 'no-such-bucket' of s3://no-such-bucket/run does "
        "not exist",
    ),
    "unknown scheme": ("s4://bad-input/run", {}, "error: checkpoint.folder: unknown storage"),
}


def test_a_save_the_storage_refuses_is_one_line(s3, tmp_path):
    """Credentials that may read the bucket but not write it: the first save fails after
    the client's retries, and the run ends in one ``error:`` line, exit 2, nothing
    committed."""
    s3.make_bucket("read-only")
    result = run_command(
        ["./run_train.sh", "--model.flavor", "debugmodel_tiny", "--training.steps", "4"]
        + ["--job.dump_folder", str(tmp_path), "--checkpoint.enable"]
        + ["--checkpoint.interval", "2", "--checkpoint.folder", "s3://read-only/run"],
        env={"NGPU": "2", **s3.reader_env},
        timeout=300,
    )
    assert result.returncode == 2, result.stdout
    errors = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: checkpoint.folder: saving step-2 into s3://read-only/run failed (PermissionError: "
        "Access Denied.); the checkpoints committed before it stay loadable"
    ], result.stdout
    assert "Traceback" not in result.stdout
    assert s3.filesystem().ls("read-only") == []


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_storage_input_is_one_line_and_writes_nothing(case, s3, tmp_path):
    folder, env, error = BAD_INPUT[case]
    s3.make_bucket("bad-input")
    result = run_command(
        ["./run_train.sh", "--model.flavor", "debugmodel_tiny", "--training.steps", "1"]
        + ["--job.dump_folder", str(tmp_path), "--checkpoint.enable"]
        + ["--checkpoint.folder", folder],
        env={"NGPU": "1", **s3.env, **env},
        timeout=120,
    )
    assert result.returncode == 2, result.stdout
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(error), result.stdout
    assert "not-the-secret" not in result.stdout
    assert s3.filesystem().ls("bad-input") == []
    assert not tmp_path.exists() or not any(tmp_path.iterdir())
