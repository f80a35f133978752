"""GRPO trains like one process: under FSDP 2 the rollouts (sampled from the weights being
trained, each group from a generator seeded by the prompt's global index) are the same tokens
as one process's, and each step's update has the same grad norm (1e-4) and loss; a run
stopped after step 3 resumes (given no seed: the checkpoint's is reused) with bitwise the same
rollouts and losses; LoRA's and (with --matrix) QLoRA's reference (the base, adapters
off) works. The loss (TRL's, checked in tests/unit_tests/test_grpo_against_trl.py) is a sum of
terms that cancel (advantages sum to 0 in a group): it is compared within 1e-7 absolute, its
terms being of size 0.1-1."""

import json
import math
from pathlib import Path

import pytest

from tests.parity import QLORA, grpo_args, train

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

GRPO = [
    "--training.seq_len",
    "32",
    "--training.global_batch_size",
    "16",
    "--training.steps",
    "6",
    *grpo_args(num_generations=4),
    "--grpo.max_completion_length",
    "8",
    "--grpo.beta",
    "0.04",
    # a reward a random model's samples already vary on (tests/integration_tests/
    # grpo_test_rewards.py): non-zero advantages from the first step
    "--grpo.reward_funcs",
    "digit_share",
    "--experimental.custom_import",
    "tests.integration_tests.grpo_test_rewards",
]


def rollouts(folder: Path) -> list[tuple]:
    """Every rank's logged rollouts, in (step, prompt, completion) order."""
    records = [
        json.loads(line)
        for file in sorted((folder / "rollouts").glob("dp_rank*.jsonl"))
        for line in file.read_text().splitlines()
    ]
    return sorted((r["step"], r["prompt_index"], r["completion"], r["reward"]) for r in records)


def assert_same_updates(reference: list[dict], other: list[dict]) -> None:
    assert [r["step"] for r in reference] == [r["step"] for r in other]
    for ref, got in zip(reference, other):
        assert math.isclose(ref["grad_norm"], got["grad_norm"], rel_tol=1e-4), (ref, got)
        assert math.isclose(ref["loss"], got["loss"], rel_tol=0, abs_tol=1e-7), (ref, got)
        assert ref["reward"] == got["reward"]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("grpo_reference")
    records = train(1, folder, GRPO, dp=2)  # two micro-batches of 8 completions
    assert all(r["grad_norm"] > 0.1 for r in records), "no policy gradient"
    assert len({r["reward"] for r in records}) > 1
    return records, rollouts(folder)


def test_fsdp2_samples_the_same_rollouts_and_takes_the_same_steps(reference_run, tmp_path):
    records, sampled = reference_run
    assert_same_updates(records, train(2, tmp_path, GRPO))
    assert rollouts(tmp_path) == sampled
    assert len(sampled) == 6 * 16


def test_tp2_samples_the_same_rollouts_and_takes_the_same_steps(reference_run, tmp_path):
    """Under TP (sequence parallel) every decoding step re-runs the padded sequence: the same
    sampled tokens as one process's KV-cache decoding (their logits agree to rounding)."""
    records, sampled = reference_run
    tp2 = ["--parallelism.tensor_parallel_degree", "2"]
    assert_same_updates(records, train(2, tmp_path, GRPO + tp2, dp=1))
    assert rollouts(tmp_path) == sampled


def test_a_stopped_run_resumes_with_the_same_rollouts_and_losses(reference_run, tmp_path):
    records, sampled = reference_run
    checkpoints = ["--checkpoint.enable", "--checkpoint.interval", "3"]
    stopped = train(1, tmp_path, GRPO + checkpoints + ["--debug.stop_after_step", "3"], dp=2)
    assert [r["step"] for r in stopped] == [1, 2, 3]
    # No seed given at the resume: the run's seed comes back from the checkpoint.
    unseeded = ["--debug.seed", "None"]
    resumed = train(1, tmp_path, GRPO + checkpoints + unseeded, dp=2)[3:]
    for ours, straight in zip(resumed, records[3:]):
        assert (ours["step"], ours["loss"], ours["grad_norm"]) == (
            straight["step"],
            straight["loss"],
            straight["grad_norm"],
        )
    assert rollouts(tmp_path) == sampled


def test_lora_with_the_base_as_reference_trains_like_one_process(tmp_path):
    lora = ["--model.converters", "lora", "--lora.target_modules", "attention,mlp"]
    one = train(1, tmp_path / "one", GRPO + lora, dp=2)
    assert all(r["grad_norm"] > 0 for r in one)
    assert_same_updates(one, train(2, tmp_path / "fsdp2", GRPO + lora))


@pytest.mark.matrix
def test_qlora_with_the_nf4_base_as_reference_trains_like_one_process(tmp_path):
    """The NF4 base (whole NF4 groups: the 256-wide debug model) with the adapters off as
    the reference, under FSDP 2 as on one process."""
    one = train(1, tmp_path / "one", GRPO + QLORA, dp=2)
    assert all(r["grad_norm"] > 0 for r in one)
    assert_same_updates(one, train(2, tmp_path / "fsdp2", GRPO + QLORA))
