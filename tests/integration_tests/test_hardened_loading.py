"""Crafted and corrupt checkpoints through every entry point that reads them.

Each case (tests/crafted_checkpoints.py) is handed to every reader of its kind: DCP folders
to the trainer's resume and initial_load_path, generation and convert_to_hf; Hugging Face
folders to initial_load_in_hf and convert_from_hf. Each must end with exit code 2 and one
``error:`` line, no traceback, and the payload's marker file must never appear. The entry
points run in this process (their real ``main``), except the end-to-end runs through
run_train.sh under torchrun and the generation exploit as a command line.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.crafted_checkpoints import (
    DCP_CASES,
    HF_CASES,
    add_remote_code,
    generation_exploit,
    key_relabelled_as_bytes,
    payload_bytes,
    pickle_named_safetensors,
)
from tests.launcher import REPO_ROOT, run_command
from torchtitan.tools.logging import logger

DEBUG_TOML = REPO_ROOT / "train_configs" / "debug_model.toml"
MODEL = ["--job.config_file", str(DEBUG_TOML), "--model.flavor", "debugmodel_tiny"]
SCRIPTS = REPO_ROOT / "scripts"


def _load_script(path: Path):
    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _exit_code(fn, *args) -> int:
    try:
        fn(*args)
    except SystemExit as e:
        return 0 if e.code is None else e.code
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def one_rank_environment():
    """torchrun's environment for one rank, so that the trainer's own main() runs in this
    process; the SIGTERM handler it installs (preemption) is undone afterwards, and the
    project logger writes to this test's stderr (not to an earlier test's captured one)."""
    previous_handler = signal.getsignal(signal.SIGTERM)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(logger, "_torchtitan_configured", False, raising=False)
        for name, value in {
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
            "TORCHTITAN_DEVICE_TYPE": "cpu",
        }.items():
            mp.setenv(name, value)
        mp.delenv("TORCHTITAN_USER_ERROR_FILE", raising=False)
        yield
    signal.signal(signal.SIGTERM, previous_handler)


@pytest.fixture
def one_rank_env():
    with one_rank_environment():
        yield


def train(dump_folder: Path, *args: str) -> int:
    from torchtitan.train import main

    return _exit_code(
        main,
        [
            *MODEL,
            "--training.steps",
            "1",
            "--job.dump_folder",
            str(dump_folder),
            "--checkpoint.enable",
            "--training.no-cpu_keep_freed_memory",
            *args,
        ],
    )


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> dict[str, Path]:
    """A trainer checkpoint (step-1, full state), its Hugging Face export and that export
    converted back to a plain DCP folder: the valid inputs every case starts from."""
    root = tmp_path_factory.mktemp("valid")
    with one_rank_environment():
        assert (
            train(
                root / "run", "--checkpoint.interval", "1", "--checkpoint.no-last_save_model_only"
            )
            == 0
        )
    step = root / "run" / "checkpoint" / "step-1"
    to_hf = _load_script(SCRIPTS / "checkpoint_conversion" / "convert_to_hf.py")
    from_hf = _load_script(SCRIPTS / "checkpoint_conversion" / "convert_from_hf.py")
    assert _exit_code(to_hf.main, [str(step), str(root / "hf"), *MODEL]) == 0
    assert _exit_code(from_hf.main, [str(root / "hf"), str(root / "plain"), *MODEL]) == 0
    return {"step": step, "hf": root / "hf", "plain": root / "plain"}


def crafted(valid_folder: Path, case, tmp_path: Path) -> tuple[Path, Path]:
    """A changed copy of ``valid_folder`` and the marker its payload would create."""
    folder = tmp_path / "input" / valid_folder.name
    shutil.copytree(valid_folder, folder)
    marker = tmp_path / "code-ran"
    case(folder, marker)
    return folder, marker


def assert_refused(code: int, output: str, marker: Path) -> None:
    assert not marker.exists(), "code from the files ran"
    assert code == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if re.search(r"\berror:", line)]
    assert len(errors) == 1, output[-3000:]


# ---------------------------------------------------------------------- DCP entry points
def resume(folder: Path, tmp_path: Path) -> int:
    run = tmp_path / "resume"
    shutil.copytree(folder, run / "checkpoint" / "step-1")
    return train(run, "--checkpoint.load_step", "1")


def initial_load(folder: Path, tmp_path: Path) -> int:
    return train(
        tmp_path / "initial",
        "--checkpoint.initial_load_path",
        str(folder),
        "--checkpoint.initial_load_model_only",
    )


def generation(folder: Path, tmp_path: Path) -> int:
    cli = _load_script(SCRIPTS / "generate" / "test_generate.py")
    return _exit_code(
        cli.main,
        [
            "--config",
            str(DEBUG_TOML),
            "--checkpoint",
            str(folder),
            "--model.flavor",
            "debugmodel_tiny",
            "--max_new_tokens",
            "2",
        ],
    )


def convert_to_hf(folder: Path, tmp_path: Path) -> int:
    cli = _load_script(SCRIPTS / "checkpoint_conversion" / "convert_to_hf.py")
    return _exit_code(cli.main, [str(folder), str(tmp_path / "out"), *MODEL])


DCP_ENTRY_POINTS = {
    "resume": ("step", resume),
    "initial_load_path": ("plain", initial_load),
    "generation": ("step", generation),
    "convert_to_hf": ("step", convert_to_hf),
}


@pytest.mark.slow
@pytest.mark.usefixtures("one_rank_env")
@pytest.mark.parametrize("entry", DCP_ENTRY_POINTS)
@pytest.mark.parametrize("case", DCP_CASES)
def test_crafted_dcp_checkpoint_is_refused_in_one_line(valid, case, entry, tmp_path, capfd):
    source, run = DCP_ENTRY_POINTS[entry]
    folder, marker = crafted(valid[source], DCP_CASES[case], tmp_path)
    code = run(folder, tmp_path)
    out, err = capfd.readouterr()
    assert_refused(code, out + err, marker)


# ---------------------------------------------------------------------- Hugging Face entry points
def initial_load_in_hf(folder: Path, tmp_path: Path) -> int:
    return train(
        tmp_path / "initial_hf",
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.initial_load_path",
        str(folder),
    )


def convert_from_hf(folder: Path, tmp_path: Path) -> int:
    cli = _load_script(SCRIPTS / "checkpoint_conversion" / "convert_from_hf.py")
    return _exit_code(cli.main, [str(folder), str(tmp_path / "out"), *MODEL])


HF_ENTRY_POINTS = {"initial_load_in_hf": initial_load_in_hf, "convert_from_hf": convert_from_hf}


@pytest.mark.slow
@pytest.mark.usefixtures("one_rank_env")
@pytest.mark.parametrize("entry", HF_ENTRY_POINTS)
@pytest.mark.parametrize("case", HF_CASES)
def test_crafted_hf_folder_is_refused_in_one_line(valid, case, entry, tmp_path, capfd):
    folder, marker = crafted(valid["hf"], HF_CASES[case], tmp_path)
    code = HF_ENTRY_POINTS[entry](folder, tmp_path)
    out, err = capfd.readouterr()
    assert_refused(code, out + err, marker)


@pytest.mark.usefixtures("one_rank_env")
def test_pickle_files_beside_hf_weights_are_never_read(valid, tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(valid["hf"], folder)
    marker = tmp_path / "code-ran"
    (folder / "pytorch_model.bin").write_bytes(payload_bytes(marker))
    assert initial_load_in_hf(folder, tmp_path) == 0
    assert not marker.exists()


@pytest.mark.usefixtures("one_rank_env")
def test_remote_code_of_a_built_in_architecture_is_named_and_never_run(valid, tmp_path, capfd):
    """As official releases ship it (auto_map, modelling code and a pickle beside the
    safetensors): the weights load, one warning names what is ignored, nothing of it runs."""
    folder = tmp_path / "hf"
    shutil.copytree(valid["hf"], folder)
    marker = tmp_path / "code-ran"
    add_remote_code(folder, marker)
    (folder / "training_args.bin").write_bytes(payload_bytes(marker))
    assert initial_load_in_hf(folder, tmp_path) == 0
    assert not marker.exists()
    out, err = capfd.readouterr()
    warned = [line for line in (out + err).splitlines() if "ignoring its remote code" in line]
    assert len(warned) == 1 and "modeling_evil.py, training_args.bin" in warned[0], warned


@pytest.mark.usefixtures("one_rank_env")
@pytest.mark.parametrize("entry", ["resume", "initial_load_path"])
def test_stray_files_in_a_dcp_folder_are_named_and_never_opened(valid, entry, tmp_path, capfd):
    source, run = DCP_ENTRY_POINTS[entry]
    marker = tmp_path / "code-ran"
    folder = tmp_path / "input" / valid[source].name
    shutil.copytree(valid[source], folder)
    (folder / "extra_state.pkl").write_bytes(payload_bytes(marker))
    assert run(folder, tmp_path) == 0
    assert not marker.exists()
    out, err = capfd.readouterr()
    assert "ignoring extra_state.pkl (not files DCP writes; never opened)" in out + err


# ---------------------------------------------------------------------- real command lines
@pytest.mark.multiprocess
def test_generation_exploit_is_refused(valid, tmp_path):
    """The reported exploit: a model key re-labelled as bytes made test_generate.py unpickle
    its payload (with weights_only=False) and then generate as if nothing happened."""
    folder, marker = crafted(valid["step"], generation_exploit, tmp_path)
    result = run_command(
        [
            sys.executable,
            str(SCRIPTS / "generate" / "test_generate.py"),
            "--config",
            str(DEBUG_TOML),
            "--checkpoint",
            str(folder),
            "--model.flavor",
            "debugmodel_tiny",
            "--max_new_tokens",
            "2",
        ],
        timeout=120,
    )
    assert_refused(result.returncode, result.stdout, marker)
    assert (
        "'tok_embeddings.weight': a bytes record with crafted attributes ['size']" in result.stdout
    )


def run_train_sh(args: list[str], nproc: int = 2) -> subprocess.CompletedProcess:
    env = {"NGPU": str(nproc), "MASTER_PORT": str(_free_port()), "PYTHON": sys.executable}
    return run_command(
        ["./run_train.sh", *MODEL[2:], "--training.steps", "1", *args], env=env, timeout=180
    )


@pytest.mark.multiprocess
def test_refused_resume_under_torchrun_is_one_line_and_exit_2(valid, tmp_path):
    folder, marker = crafted(valid["step"], key_relabelled_as_bytes, tmp_path)
    run = tmp_path / "run"
    shutil.copytree(folder, run / "checkpoint" / "step-1")
    result = run_train_sh(["--job.dump_folder", str(run), "--checkpoint.enable"])
    assert_refused(result.returncode, result.stdout, marker)
    assert "ChildFailedError" not in result.stdout and "FAILED" not in result.stdout


@pytest.mark.multiprocess
def test_refused_hf_load_under_torchrun_is_one_line_and_exit_2(valid, tmp_path):
    folder, marker = crafted(valid["hf"], pickle_named_safetensors, tmp_path)
    result = run_train_sh(
        [
            "--job.dump_folder",
            str(tmp_path / "run"),
            "--checkpoint.enable",
            "--checkpoint.initial_load_in_hf",
            "--checkpoint.initial_load_path",
            str(folder),
        ]
    )
    assert_refused(result.returncode, result.stdout, marker)
    assert "ChildFailedError" not in result.stdout


# ---------------------------------------------------------------------- nothing else loads
_LOADING_CALL = re.compile(
    r"\b(dcp\.load|torch\.load|pickle\.loads?|Unpickler|import pickle|safe_open|"
    r"safetensors\.torch\.load|load_file|trust_remote_code|from_pretrained|weights_only=False)\b"
)


def test_only_the_safe_loading_module_reads_checkpoint_files():
    """A future caller cannot bypass safe_loading: no other module of the package or the
    scripts unpickles, torch.load()s, dcp.load()s or opens safetensors."""
    allowed = REPO_ROOT / "torchtitan" / "components" / "checkpointing" / "safe_loading.py"
    # hf_compat's LoRA check has PEFT load the adapter it has just written to a temporary
    # folder, as a user's PEFT would: PEFT's own loading is what that check is about
    verifier = (REPO_ROOT / "scripts" / "hf_compat.py", "PeftModel.from_pretrained(")
    offenders = []
    for root in (REPO_ROOT / "torchtitan", REPO_ROOT / "scripts"):
        for path in root.rglob("*.py"):
            if path == allowed:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if (path, verifier[1]) == verifier and verifier[1] in line:
                    continue
                if _LOADING_CALL.search(line):
                    offenders.append(f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
