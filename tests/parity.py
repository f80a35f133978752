"""The parity harness every parallelism reuses: train the tiny Llama 3 for 10 steps in fp32
under a given layout and compare per-step loss AND grad norm with the 1-process run."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import pytest

from tests.launcher import REPO_ROOT, read_metrics, run_torchrun

DEBUG_TOML = str(REPO_ROOT / "train_configs" / "debug_model.toml")
GLOBAL_BATCH = 8
STEPS = 10
RTOL = 1e-4
SEED = 7

# Same seed, data, global batch and model for every layout; an lr at which the loss falls
# clearly within 10 steps (6.19 -> ~4.7), so a flat loss cannot pass for parity.
BASE_OVERRIDES = [
    "--job.config_file",
    DEBUG_TOML,
    "--model.flavor",
    "debugmodel_tiny",
    "--training.seq_len",
    "64",
    "--training.global_batch_size",
    str(GLOBAL_BATCH),
    "--training.steps",
    str(STEPS),
    "--training.mixed_precision_param",
    "float32",
    "--training.data_shards",
    "8",
    "--optimizer.lr",
    "3e-3",
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.log_freq",
    "1",
    "--debug.seed",
    str(SEED),
]

FULL_LOGITS = ["--training.loss_chunk_size", "0"]

# QLoRA on attention and MLP; NF4 needs weights of whole NF4 groups (16,384 values): the
# 256-wide debug model.
QLORA = [
    "--model.converters",
    "lora",
    "--model.flavor",
    "debugmodel",
    "--lora.target_modules",
    "attention,mlp",
    "--lora.base_quantization",
    "nf4",
]


def grpo_args(num_generations: int) -> list[str]:
    """GRPO on tests/assets/prompts_tiny.jsonl, ``num_generations`` completions a prompt."""
    return [
        "--training.dataset",
        "prompts",
        "--training.dataset_path",
        str(REPO_ROOT / "tests" / "assets" / "prompts_tiny.jsonl"),
        "--grpo.enable",
        "--grpo.num_generations",
        str(num_generations),
    ]


def dpo_args(dataset_path: str) -> list[str]:
    """DPO on the preference pairs at ``dataset_path``, with the mask and positions it needs."""
    return [
        "--training.dataset",
        "preference",
        "--training.dataset_path",
        dataset_path,
        "--dpo.enable",
        "--model.attn_type",
        "flex",
        "--model.attn_mask_type",
        "block_causal",
        "--training.reset_position_ids_per_document",
    ]


"""The loss on the whole logits: the references run it, every layout the chunked default."""


def train(
    nproc: int,
    dump_folder: Path,
    overrides: list[str] = (),
    dp: int | None = None,
    timeout: float = 240,
    env: dict[str, str] | None = None,
) -> list[dict]:
    """Run the trainer under torchrun and return its metrics.jsonl records.

    ``dp`` (default nproc) sets local_batch_size = GLOBAL_BATCH / dp (no accumulation)
    unless the overrides set it themselves.
    """
    run_torchrun(nproc, train_args(nproc, dump_folder, overrides, dp), timeout=timeout, env=env)
    return read_metrics(dump_folder)


def train_args(
    nproc: int, dump_folder: Path, overrides: list[str] = (), dp: int | None = None
) -> list[str]:
    """The trainer arguments ``train`` uses (for tests that launch the run themselves)."""
    args = list(BASE_OVERRIDES) + ["--job.dump_folder", str(dump_folder)]
    if "--training.local_batch_size" not in overrides:
        args += ["--training.local_batch_size", str(GLOBAL_BATCH // (dp or nproc))]
    return args + list(overrides)


class ParityError(AssertionError):
    pass


def assert_parity(reference: list[dict], other: list[dict], rtol: float = RTOL) -> None:
    """Per-step loss and grad norm within ``rtol`` (relative) of the reference."""
    if [r["step"] for r in reference] != [r["step"] for r in other]:
        raise ParityError(f"logged steps differ: {[r['step'] for r in other]}")
    for ref, got in zip(reference, other):
        for key in ("loss", "grad_norm"):
            a, b = ref[key], got[key]
            if not math.isclose(a, b, rel_tol=rtol, abs_tol=0.0):
                raise ParityError(
                    f"step {ref['step']}: {key} {b!r} vs reference {a!r} "
                    f"(relative difference {abs(a - b) / abs(a):.2e} > {rtol})"
                )


def assert_loss_falls(records: list[dict]) -> None:
    first, last = records[0]["loss"], records[-1]["loss"]
    assert last < first - 0.5, f"loss did not fall clearly: {first} -> {last}"


def ci_subset(cases: Iterable[str], covered_by: dict[str, str]) -> list:
    """``cases`` as pytest parameters, those in ``covered_by`` marked matrix (they run with
    ``--matrix``): CI leaves each to the composition named beside it, which runs its
    parallelisms together (the suite's time is spent once per code path)."""
    cases = list(cases)
    for case, composition in covered_by.items():
        assert case in cases and composition in cases and composition not in covered_by
    return [pytest.param(c, marks=pytest.mark.matrix) if c in covered_by else c for c in cases]
