"""Bad input ends in one ``error:`` line and exit code 2, as a new user meets it through
./run_train.sh: caught by the one-process check before launch, or inside the ranks (then
printed once by the launcher, without tracebacks or torchrun's report); CLI choices name
their flag; and scripts/run_train.slurm turns SLURM's variables into the torchrun command."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import typing
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.launcher import REPO_ROOT, run_command
from tests.parity import dpo_args
from torchtitan.config import ConfigError, ConfigManager, JobConfig
from torchtitan.config.parsing import _field_types
from torchtitan.distributed.launch import lowest_rank_error

TINY = ["--model.flavor", "debugmodel_tiny", "--training.steps", "1"]

# case -> (CLI overrides, the field the error line must name); caught before any rank starts
BEFORE_LAUNCH = {
    "unknown dataset": (["--training.dataset", "nosuch"], "training.dataset"),
    "missing dataset path": (
        ["--training.dataset", "jsonl", "--training.dataset_path", "/no/such/data"],
        "training.dataset_path",
    ),
    "missing tokenizer": (["--model.tokenizer_path", "/no/such/tokenizer"], "model.tokenizer_path"),
    "global batch": (["--training.global_batch_size", "12"], "training.global_batch_size"),
    "load_step": (["--checkpoint.enable", "--checkpoint.load_step", "5"], "checkpoint.load_step"),
    "initial_load_path": (
        ["--checkpoint.enable", "--checkpoint.initial_load_path", "/no/such/ckpt"],
        "checkpoint.initial_load_path",
    ),
    "unknown converter": (["--model.converters", "nosuch"], "model.converters"),
    "missing token store": (
        ["--training.dataset", "tokens", "--training.dataset_path", "/no/such/store"],
        "training.dataset_path",
    ),
    "shuffled text": (["--training.shuffle_seed", "3"], "training.shuffle_seed"),
    "lora rank": (["--model.converters", "lora", "--lora.rank", "0"], "lora.rank"),
    "lora targets": (
        ["--model.converters", "lora", "--lora.target_modules", "wz"],
        "lora.target_modules",
    ),
    "dpo beta": (["--dpo.beta", "0"], "dpo.beta: must be > 0"),
    "grpo group": (["--grpo.num_generations", "1"], "grpo.num_generations: a group needs"),
    "grpo reward": (
        [
            "--training.dataset",
            "prompts",
            "--training.dataset_path",
            "tests/assets/prompts_tiny.jsonl",
            "--grpo.enable",
            "--grpo.reward_funcs",
            "nosuch",
        ],
        "grpo.reward_funcs: unknown reward function 'nosuch'",
    ),
    "no lighthouse": (
        ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"],
        "fault_tolerance.enable",
    ),
    "CLI choice": (
        ["--parallelism.fsdp_reshard_after_forward", "maybe"],
        "--parallelism.fsdp_reshard_after_forward: invalid choice 'maybe'; valid: "
        "'default', 'always', 'never'",
    ),
}
# case -> (CLI overrides, the error line): found by the ranks when they read the data
IN_RANKS = {
    "preference row": (
        dpo_args("tests/assets/preference_without_rejected.jsonl"),
        "training.dataset_path: tests/assets/preference_without_rejected.jsonl line 2: no "
        "'rejected' field",
    ),
}
RANK_LOCAL = [
    "--experimental.custom_import",
    "tests.integration_tests.rank_local_user_error",
    "--model.name",
    "llama3_rank1_user_error",
]
SLURM_NODE_1_OF_2 = {
    "SLURM_JOB_NODELIST": "gpu[007-008]",
    "SLURM_NNODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_GPUS_ON_NODE": "2",
    "LOG_RANK": "0,3",
}


def _fake_srun(folder: Path) -> dict[str, str]:
    """A PATH whose ``srun`` runs its command once, here (as on the node the env names)."""
    srun = folder / "srun"
    srun.write_text('#!/bin/sh\nwhile [ "${1#-}" != "$1" ]; do shift; done\nexec "$@"\n')
    srun.chmod(0o755)
    return {"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}


def _slurm(
    env: dict[str, str], bin_dir: Path, submit_dir: Path = REPO_ROOT
) -> subprocess.CompletedProcess:
    return run_command(
        ["bash", str(REPO_ROOT / "scripts" / "run_train.slurm"), *TINY],
        env={**_fake_srun(bin_dir), "SLURM_SUBMIT_DIR": str(submit_dir), "DRY_RUN": "1", **env},
        timeout=300,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every run_train.sh case, two at a time (each costs at least one Python start)."""
    root = tmp_path_factory.mktemp("user-errors")
    dump = ["--job.dump_folder", str(root / "dump")]
    jobs = {
        case: (
            lambda args=args: run_command(
                ["./run_train.sh", *TINY, *dump, *args],
                env={"NGPU": "1", "TORCHFT_LIGHTHOUSE": ""},
                timeout=300,
            )
        )
        for case, (args, _) in BEFORE_LAUNCH.items()
    }
    for case, (args, _) in IN_RANKS.items():
        jobs[case] = lambda args=args: run_command(
            ["./run_train.sh", *TINY, *dump, *args], env={"NGPU": "1"}, timeout=300
        )
    jobs["rank-local"] = lambda: run_command(
        ["./run_train.sh", *TINY, *dump, *RANK_LOCAL], env={"NGPU": "2"}, timeout=300
    )
    jobs["slurm"] = lambda: _slurm(SLURM_NODE_1_OF_2, root)
    jobs["one node"] = lambda: run_command(
        ["./run_train.sh", *TINY], env={"NGPU": "2", "DRY_RUN": "1"}, timeout=300
    )
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


def _error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", BEFORE_LAUNCH)
def test_bad_input_is_the_only_output_line(runs, case):
    result, field = runs[case], BEFORE_LAUNCH[case][1]
    assert result.returncode == 2, result.stdout
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {field}"), result.stdout


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", IN_RANKS)
def test_bad_data_is_one_error_line_without_tracebacks(runs, case):
    result, line = runs[case], IN_RANKS[case][1]
    assert result.returncode == 2, result.stdout
    errors = _error_lines(result.stdout)
    assert len(errors) == 1 and errors[0].startswith(f"error: {line}"), result.stdout
    assert "Traceback" not in result.stdout


@pytest.mark.multiprocess
def test_error_on_one_rank_is_printed_once_without_tracebacks(runs):
    """Rank 1 (whose output run_train.sh filters) finds bad input; rank 0 then fails in its
    next collective: one line, exit 2, no traceback and no torchrun log or report."""
    output = runs["rank-local"].stdout
    assert runs["rank-local"].returncode == 2, output
    assert _error_lines(output) == [
        "error: training.dataset_path: planted error found on rank 1 only"
    ], output
    assert "Traceback" not in output and "ChildFailedError" not in output, output
    assert not [line for line in output.splitlines() if re.match(r"[EW]\d{4} ", line)], output


def test_launcher_prints_the_lowest_ranks_error(tmp_path):
    report = tmp_path / "errors"
    report.write_text("3\tfrom rank 3\n1\tfrom rank 1\n1\tagain rank 1\n")
    assert lowest_rank_error(report) == "from rank 1"
    report.write_text("")
    assert lowest_rank_error(report) is None


def _choice_fields() -> dict[str, tuple]:
    """Every config field whose value is one of fixed choices (also when it may be None)."""
    out = {}
    for field, tp in _field_types(JobConfig).items():
        arms = (
            typing.get_args(tp)
            if typing.get_origin(tp) in (typing.Union, type(int | None))
            else (tp,)
        )
        choices = [
            c
            for arm in arms
            if typing.get_origin(arm) is typing.Literal
            for c in typing.get_args(arm)
        ]
        if choices:
            out[field] = tuple(choices)
    return out


def test_every_cli_choice_error_names_the_flag_and_valid_values(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")  # a narrow terminal must not split the flag name
    fields = _choice_fields()
    assert "parallelism.fsdp_reshard_after_forward" in fields and len(fields) >= 10
    for field, choices in fields.items():
        with pytest.raises(ConfigError) as e:
            ConfigManager().parse_args([f"--{field}", "no-such-choice"])
        message = str(e.value)
        assert message.startswith(f"--{field}: invalid choice 'no-such-choice'; valid: "), message
        assert all(repr(c) in message for c in choices) and "\n" not in message, message


# ------------------------------------------------------------------------ launching
@pytest.mark.multiprocess
def test_slurm_node_runs_torchrun_on_the_named_rendezvous(runs):
    result = runs["slurm"]
    assert result.returncode == 0, result.stdout
    command = result.stdout.strip().splitlines()[-1]
    for option in (
        "--nproc_per_node=2",
        "--nnodes=2",
        "--node_rank=1",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=gpu007:29500",
    ):
        assert f"'{option}'" in command, command
    assert "'--local-ranks-filter' '1'" in command, command  # global rank 3 = node 1's local rank 1
    assert "--standalone" not in command and "'-m' 'torchtitan.train'" in command, command


@pytest.mark.multiprocess
def test_one_node_uses_a_standalone_rendezvous(runs):
    result = runs["one node"]
    assert result.returncode == 0, result.stdout
    command = result.stdout.strip().splitlines()[-1]
    assert "'--standalone'" in command and "rdzv_endpoint" not in command, command


@pytest.mark.skipif(shutil.which("scontrol") is not None, reason="scontrol expands the list itself")
@pytest.mark.parametrize(
    "nodelist, first",
    [
        ("gpu[003-005,9]", "gpu003"),
        ("node-a1,node-b2", "node-a1"),
        ("big[12],small[1-3]", "big12"),
        ("solo", "solo"),
    ],
)
def test_slurm_rendezvous_is_the_first_host(tmp_path, nodelist, first):
    """The rendezvous address and node rank run_train.sh gets (a stand-in prints them)."""
    stand_in = tmp_path / "run_train.sh"
    stand_in.write_text('#!/bin/sh\necho "$MASTER_ADDR:$MASTER_PORT $NNODES $NODE_RANK"\n')
    stand_in.chmod(0o755)
    env = {"SLURM_JOB_NODELIST": nodelist, "SLURM_NNODES": "3", "SLURM_NODEID": "2"}
    result = _slurm(env, tmp_path, submit_dir=tmp_path)
    assert result.stdout.strip() == f"{first}:29500 3 2", result.stdout


def test_several_nodes_need_the_rendezvous_address():
    result = run_command(
        ["./run_train.sh"], env={"NGPU": "1", "NNODES": "2", "DRY_RUN": "1", "MASTER_ADDR": ""}
    )
    assert result.returncode == 2
    assert (
        result.stdout.strip()
        == "error: MASTER_ADDR: set it to the address of node 0 for a run on NNODES=2 nodes"
    )


@pytest.mark.multiprocess
def test_run_train_sh_leaves_warnings_to_the_trainer(tmp_path):
    """The one-process check before launch prints warnings (here: a deprecated alias) only on a
    dry run; otherwise the trainer prints them (a stand-in launcher here), so they show once."""
    python = tmp_path / "python"
    python.write_text(
        f'#!/bin/sh\nif [ "$2" = torchtitan.distributed.launch ]; then echo launched; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    warning = "'training.seed' is deprecated; use 'debug.seed'"
    for dry_run, shown in (("1", 1), ("0", 0)):
        result = run_command(
            ["./run_train.sh", *TINY, "--training.seed", "3"],
            env={"NGPU": "1", "DRY_RUN": dry_run, "PYTHON": str(python)},
        )
        assert result.returncode == 0, result.stdout
        assert result.stdout.count(warning) == shown, result.stdout
