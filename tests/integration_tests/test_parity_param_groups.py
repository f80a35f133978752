"""Parameter groups (weight decay exclusions, lr multipliers) train like one process on every
layout: per-step loss and grad norm (1e-4) under FSDP 2, TP 2 and PP 2; FSDP 2's step-5 checkpoint
(the groups saved by FQN) resumes under FSDP 2 x TP 2 and continues the one-process losses.
Adam's moments in bf16 (``optimizer.state_dtype``) train like one process under FSDP 2 x TP 2."""

import shutil
from pathlib import Path

import pytest

from tests.parity import assert_parity, train

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

GROUPS = [
    "--optimizer.weight_decay",
    "0.5",
    "--optimizer.weight_decay_exclude",
    "*norm*",
    "tok_embeddings.*",
    "--optimizer.lr_multipliers",
    "output.*",
    "2",
    "layers.0.*",
    "0.5",
]


@pytest.fixture(scope="module")
def groups_reference(tmp_path_factory):
    return train(1, tmp_path_factory.mktemp("groups_reference"), GROUPS)


def test_groups_under_pipeline_parallel(groups_reference, tmp_path):
    pp = ["--parallelism.pipeline_parallel_degree", "2"]
    assert_parity(groups_reference, train(2, tmp_path, GROUPS + pp, dp=1))


def test_groups_under_tensor_parallel(groups_reference, tmp_path):
    tp = ["--parallelism.tensor_parallel_degree", "2"]
    assert_parity(groups_reference, train(2, tmp_path, GROUPS + tp, dp=1))


def test_fsdp2_checkpoint_resumes_under_fsdp2_tp2(groups_reference, tmp_path):
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "5"]
    assert_parity(groups_reference, train(2, tmp_path / "fsdp2", GROUPS + ckpt))
    step5 = Path("checkpoint") / "step-5"
    shutil.copytree(tmp_path / "fsdp2" / step5, tmp_path / "fsdp2_tp2" / step5)
    tp = ["--parallelism.tensor_parallel_degree", "2"]
    resumed = train(4, tmp_path / "fsdp2_tp2", GROUPS + ckpt + tp, dp=2)
    assert [r["step"] for r in resumed] == list(range(6, 11))
    assert_parity(groups_reference[5:], resumed)


def test_bf16_states_under_fsdp2_tp2(tmp_path):
    bf16 = ["--optimizer.state_dtype", "bfloat16"]
    reference = train(1, tmp_path / "one_process", bf16)
    tp = ["--parallelism.tensor_parallel_degree", "2"]
    assert_parity(reference, train(4, tmp_path / "fsdp2_tp2", bf16 + tp, dp=2))
