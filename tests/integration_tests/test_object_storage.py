"""Checkpoints on object storage, against a real S3 server (SeaweedFS on 127.0.0.1, started
here): saved under FSDP 2 into ``s3://``, a resume from step 2 repeats steps 3-4 bitwise, and
a resume under FSDP 2 x TP 2 gives them within 1e-4; a step whose save did not commit its
marker is never loaded and is purged; bad credentials, a missing bucket and an unknown scheme
end in one ``error:`` line, exit 2, with nothing written."""

from __future__ import annotations

import json

import pytest

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
