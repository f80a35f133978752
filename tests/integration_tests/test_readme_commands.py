"""Every shell command README.md and benchmarks/*.md show works as written.

The commands: README's ```bash blocks, the indented command blocks of benchmarks/*.md, and
inline code that runs a script (``python scripts/...``, ``torchrun ... scripts/...``, the
benchmarks' "- command:" lines); ``export``s carry over to the later commands of a block,
``{a,b}`` stands for each alternative and ``[--flags]`` for with and without. Each is checked as
far as this CPU machine allows in well under a minute for all of them:

- the trainer (``./run_train.sh``, ``scripts/run_ft_replicas.sh``, ``python -m torchtitan.train``,
  ``torchrun -m torchtitan.train``) and ``scripts/bench/benchmark.py`` (its trainer flags): the
  flags through the real config loader, then everything ``DRY_RUN=1 ./run_train.sh`` checks
  before launch (the layout for NGPU x NNODES processes, data, tokenizer, checkpoint,
  converters, device features), in this process (a DRY_RUN is ~15 s of Python start-up per
  command here). float8 / MX without emulation is a GPU command, checked as on an SM100 GPU;
  the lighthouse a fault-tolerance block starts in the background is not contacted.
- ``python -m torchtitan.config``: run in this process.
- ``scripts/estimate/estimation.py``: run in this process in closed form (mode analytic), which
  parses the same config and checks the same layout and coverage; tracing 8B or planning 70B
  takes minutes.
- ``scripts/train_tokenizer.py``: run on its first 20 documents, in an empty directory.
- other scripts: ``--help`` (in this process); ``bash`` scripts: ``bash -n`` (setup_env.sh
  installs packages, test.sh runs the whole suite); ``torchft_lighthouse --help``.

A command of any other kind fails: give it a check here.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
from torch.distributed.run import get_args_parser

from tests.integration_tests.test_run_train_from_anywhere import readme_snippet
from tests.launcher import REPO_ROOT
from torchtitan import preflight
from torchtitan.components.quantization import FLOAT8_LINEAR, MX_LINEAR
from torchtitan.config import ConfigManager, JobConfig
from torchtitan.config.entry import main as config_main
from torchtitan.distributed import fault_tolerance
from torchtitan.distributed import process as distributed_utils
from torchtitan.estimate.cli import TIME_FLAG
from torchtitan.estimate.cli import main as estimate_main
from torchtitan.models import BUILTIN_MODELS
from torchtitan.protocols import get_train_spec, train_spec

pytestmark = pytest.mark.slow  # each command costs a config load or a dry run: seconds

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "benchmarks").glob("*.md"))]
DEFAULT_CONFIG = "train_configs/debug_model.toml"  # run_train.sh's
GPU_CAPABILITY = (10, 0)
SHORTENED = {"scripts/train_tokenizer.py": ["--max_docs", "20"]}
PREPARE = "scripts/data/prepare.py"
SCRIPT_KINDS = {
    "scripts/estimate/estimation.py": "estimator",
    "scripts/bench/benchmark.py": "benchmark",
    PREPARE: "prepare",
    **dict.fromkeys(SHORTENED, "shortened"),
}
USER_PACKAGES = ("my_models", "scripts")  # what the commands' custom imports load
ENV_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
STORE_PATH = re.compile(r"(?<![\w/.])stores/")  # a README store, also inside a --training.mixture
INLINE_SCRIPT = re.compile(r"([A-Z_]+=\S+ )*(python|torchrun) .*scripts/", re.DOTALL)


# ------------------------------------------------------------------- finding the commands
@dataclass
class Command:
    where: str  # file:line
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.where} {shlex.join(self.argv)}"


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _without_fences(text: str) -> str:
    """``text`` with every fenced block emptied, its line breaks kept."""
    return re.sub(r"^```.*?^```", lambda m: "\n" * m[0].count("\n"), text, flags=re.M | re.S)


def snippets(text: str) -> list[tuple[int, str]]:
    """(first line, text) of the ```bash blocks, the indented blocks and the inline code that
    runs a script."""
    fenced = [
        (_line_of(text, m.start(1)), m[1])
        for m in re.finditer(r"^```bash\n(.*?)^```", text, re.M | re.S)
    ]
    prose = _without_fences(text)
    indented = [
        (_line_of(prose, m.start()), m[0]) for m in re.finditer(r"(?<=\n\n)(?: {4}.*\n)+", prose)
    ]
    inline = [
        (_line_of(prose, m.start()), " ".join(m[1].split()))
        for m in re.finditer(r"`([^`]+)`", prose)
        if INLINE_SCRIPT.match(m[1])
    ]
    return fenced + indented + inline


def logical_lines(snippet: str) -> Iterator[tuple[int, str]]:
    """(line offset, line) with backslash continuations joined."""
    start, parts = 0, []
    for offset, line in enumerate(snippet.splitlines()):
        start = offset if not parts else start
        if line.rstrip().endswith("\\"):
            parts.append(line.rstrip()[:-1])
            continue
        yield start, " ".join([*parts, line])
        parts = []


def variants(line: str) -> list[str]:
    """``{a,b}``: one line per alternative; ``[--flags]``: with and without them."""
    brace = re.search(r"\{([^{}]*,[^{}]*)\}", line)
    if brace:
        return [
            variant
            for alternative in brace[1].split(",")
            for variant in variants(line[: brace.start()] + alternative + line[brace.end() :])
        ]
    optional = re.compile(r"\[(--[^\]]*)\]")
    if optional.search(line):
        return [optional.sub(r"\1", line), optional.sub("", line)]
    return [line]


def simple_commands(line: str) -> list[list[str]]:
    """The words of each command of ``line`` (split at ``&&``, ``;``, ``&``, ``|``;
    comments dropped)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if set(token) <= set(";&|"):
            commands.append([])
        else:
            commands[-1].append(token)
    return [words for words in commands if words]


def to_command(where: str, words: list[str], exports: dict[str, str]) -> Command | None:
    """The command without its ``VAR=value`` prefix and ``nice``; None for ``export`` (whose
    variables go into ``exports``)."""
    env = dict(exports)
    while ENV_ASSIGNMENT.match(words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    if words[0] == "export":
        exports.update(word.split("=", 1) for word in words[1:])
        return None
    if words[:2] == ["nice", "-n"]:
        words = words[3:]
    return Command(where, words, env)


def doc_commands() -> list[Command]:
    commands = []
    for doc in DOCS:
        name = doc.relative_to(REPO_ROOT).as_posix()
        for first_line, snippet in snippets(doc.read_text()):
            exports: dict[str, str] = {}
            for offset, line in logical_lines(snippet):
                for variant in variants(line):
                    for words in simple_commands(variant):
                        command = to_command(f"{name}:{first_line + offset}", words, exports)
                        commands += [command] if command else []
    return commands


# ------------------------------------------------------------------ what each one runs
@dataclass(frozen=True)
class Check:
    kind: str
    args: list[str]
    world_size: int = 1


def resolve(command: Command) -> Check:
    program, args, env = command.argv[0], command.argv[1:], command.env
    world_size = int(env.get("NGPU", "1")) * int(env.get("NNODES", "1"))
    if program.endswith("run_train.sh"):
        config = env.get("CONFIG_FILE", DEFAULT_CONFIG)
        return Check("trainer", ["--job.config_file", config, *args], world_size)
    if program.endswith("run_ft_replicas.sh"):
        return Check("trainer", [*_ft_replica_args(env), *args], world_size)
    if program in ("python", "python3"):
        return _python(args, 1)
    if program == "torchrun":
        return _torchrun(args)
    if program == "bash":
        return Check("shell", args[:1])
    if program == "torchft_lighthouse":
        return Check("binary", [program])
    return Check("unknown", command.argv)


def _ft_replica_args(env: dict[str, str]) -> list[str]:
    """What scripts/run_ft_replicas.sh passes run_train.sh for replica group 0."""
    return [
        "--job.config_file",
        env.get("CONFIG_FILE", DEFAULT_CONFIG),
        "--fault_tolerance.enable",
        "--fault_tolerance.group_size",
        env.get("REPLICAS", "2"),
        "--fault_tolerance.replica_id",
        "0",
        "--fault_tolerance.min_replica_size",
        env.get("MIN_REPLICAS", "1"),
    ]


def _python(args: list[str], world_size: int) -> Check:
    if args[0] != "-m":
        return _script(args[0], args[1:], world_size)
    module, rest = args[1], args[2:]
    if module == "torch.distributed.run":
        return _torchrun(rest)
    kinds = {"torchtitan.train": "trainer", "torchtitan.config": "config"}
    return Check(kinds.get(module, "unknown"), rest, world_size)


def _torchrun(args: list[str]) -> Check:
    parsed = get_args_parser().parse_args(args)
    launched = ["-m"] if parsed.module else []
    return _python(
        [*launched, parsed.training_script, *parsed.training_script_args],
        int(parsed.nproc_per_node),
    )


def _script(path: str, args: list[str], world_size: int) -> Check:
    path = Path(path).as_posix()
    return Check(SCRIPT_KINDS.get(path, "script"), [path, *args], world_size)


# ----------------------------------------------------------------------------- checks
def needs_gpu(config: JobConfig) -> bool:
    """float8 / MX converters without emulation run on CUDA only."""
    linear = config.quantize.linear
    emulated = {
        **dict.fromkeys(FLOAT8_LINEAR, linear.float8.emulate),
        **dict.fromkeys(MX_LINEAR, linear.mx.emulate),
    }
    return any(not emulated.get(name, False) for name in config.model.converters)


def check_trainer(check: Check, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``DRY_RUN=1 ./run_train.sh`` runs before it prints the launch command (``python -m
    torchtitan.preflight --world-size N``), for a new user's empty dump folder; a token store
    the README prepares (``stores/...``) is the one the ``readme_stores`` fixture made."""
    stores = STORES[0]
    args = [STORE_PATH.sub(f"{stores}/", a) for a in check.args]
    args = [*args, "--job.dump_folder", str(tmp_path / "outputs")]
    if needs_gpu(ConfigManager().parse_args(args)):
        monkeypatch.setattr(preflight, "default_device_type", lambda: "cuda")
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: GPU_CAPABILITY)
    assert_exits_0(lambda: preflight.main(["--world-size", str(check.world_size), *args]))


def _load_script(path: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location(Path(path).stem, REPO_ROOT / path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look it up there
    spec.loader.exec_module(module)
    return module


def _stand_in_corpus(cmd: list[str], **_: object) -> None:
    """The preset's corpus (make_stdlib_docs_corpus.py, ~40 s here) as an empty file: the
    checks before launch only look for its path."""
    Path(cmd[-1]).write_text("")


def check_benchmark(check: Check, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer flags of the benchmark's runs: config, preset and overrides."""
    bench = _load_script(check.args[0], monkeypatch)
    args, overrides = bench.parse_args(check.args[1:])
    if args.preset:
        monkeypatch.setattr(bench, "subprocess", SimpleNamespace(run=_stand_in_corpus))
        corpus = tmp_path / "corpus.json"
        preset = bench.preset_overrides(bench.PRESETS[args.preset], args.nproc, corpus)
        overrides = [*preset, *overrides]
    trainer_args = ["--job.config_file", args.config, *overrides]
    check_trainer(Check("trainer", trainer_args, args.nproc), tmp_path, monkeypatch)


def exit_status(fn: Callable[[], object]) -> tuple[object, str]:
    """What ``fn`` returns (or its SystemExit code; None is 0) and everything it printed."""
    output = io.StringIO()
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        try:
            status = fn()
        except SystemExit as e:
            status = e.code
    return status or 0, output.getvalue()


def assert_exits_0(fn: Callable[[], object]) -> None:
    status, output = exit_status(fn)
    assert status == 0, f"exit status {status}:\n{output[-3000:]}"


def check_config(check: Check, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert_exits_0(lambda: config_main(check.args))


def check_estimator(check: Check, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = list(check.args[1:])
    if "--memory_estimation.plot" in args:  # the picture's command: traced as written (seconds)
        args[args.index("--memory_estimation.plot") + 1] = str(tmp_path / "plot.png")
        assert_exits_0(lambda: estimate_main(args))
        assert (tmp_path / "plot.png").stat().st_size > 0
        return
    args += ["--memory_estimation.mode", "analytic"]
    if check.world_size > 1:  # launched by torchrun
        args += ["--memory_estimation.world_size", str(check.world_size)]
    config_args = [a for a in args if a != TIME_FLAG]  # the estimator's own short flag
    if ConfigManager().parse_args(config_args).memory_estimation.device_memory_gib is None:
        args += ["--memory_estimation.device_memory_gib", "80"]
    assert_exits_0(lambda: estimate_main(args))


def _run_main(path: str) -> None:
    runpy.run_path(str(REPO_ROOT / path), run_name="__main__")


def check_prepare(check: Check, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store of a registered dataset is made for real (seconds), into an empty folder; one of
    the user's own files or Hugging Face datasets (``--dataset hf``) is ``--help``."""
    args = list(check.args[1:])
    if "--dataset" not in args or args[args.index("--dataset") + 1] == "hf":
        return check_script(Check("script", check.args), tmp_path, monkeypatch)
    args[args.index("--out") + 1] = str(tmp_path / "store")
    monkeypatch.setattr(sys, "argv", [PREPARE, *args])
    assert_exits_0(lambda: _run_main(PREPARE))
    assert (tmp_path / "store" / "manifest.json").exists()


def check_script(check: Check, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--help``; a script cheap enough to run shortened runs, in an empty directory."""
    path, args = check.args[0], check.args[1:]
    if check.kind == "shortened":
        monkeypatch.chdir(tmp_path)
        args = [*args, *SHORTENED[path]]
    else:
        args = ["--help"]
    monkeypatch.setattr(sys, "argv", [path, *args])
    monkeypatch.setattr(sys, "path", list(sys.path))
    # worker entry points end their process with os._exit: here a SystemExit, not pytest's end
    monkeypatch.setattr(distributed_utils, "exit_skipping_static_destructors", sys.exit)
    assert_exits_0(lambda: _run_main(path))


def _run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"{shlex.join(cmd)}:\n{result.stdout}{result.stderr}"


def check_shell(check: Check, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _run(["bash", "-n", str(REPO_ROOT / check.args[0])])


def check_binary(check: Check, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    program = check.args[0]
    beside_python = Path(sys.executable).with_name(program)
    _run([str(beside_python) if beside_python.exists() else shutil.which(program), "--help"])


def check_unknown(check: Check, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.fail(f"no check for {shlex.join(check.args)!r}: add one to {__file__}")


CHECKS = {
    "trainer": check_trainer,
    "benchmark": check_benchmark,
    "config": check_config,
    "estimator": check_estimator,
    "prepare": check_prepare,
    "script": check_script,
    "shortened": check_script,
    "shell": check_shell,
    "binary": check_binary,
    "unknown": check_unknown,
}
SUBPROCESS_KINDS = {"shell", "binary"}
COMMANDS = doc_commands()


def _param(command: Command) -> pytest.ParameterSet:
    check = resolve(command)
    marks = [pytest.mark.multiprocess] if check.kind in SUBPROCESS_KINDS else []
    return pytest.param(command, check, id=str(command)[:90], marks=marks)


@pytest.fixture
def users_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """README's ``my_models/tiny.py`` importable, as run_train.sh makes the directory it is
    called from; what custom imports register (train specs, flavors, modules) is undone."""
    project = tmp_path / "project"
    (project / "my_models").mkdir(parents=True)
    (project / "my_models" / "tiny.py").write_text(readme_snippet("my_models/tiny.py"))
    monkeypatch.syspath_prepend(str(project))
    get_train_spec(BUILTIN_MODELS[0])  # the built-in models are registered from here on
    registry = train_spec._train_specs
    specs = dict(registry)
    flavors = {name: dict(specs[name].model_args) for name in BUILTIN_MODELS}
    modules = set(sys.modules)
    for name in set(registry) - set(BUILTIN_MODELS):  # what a new process has registered
        del registry[name]
    yield
    registry.clear()
    registry.update(specs)
    for name, saved in flavors.items():
        specs[name].model_args.clear()
        specs[name].model_args.update(saved)
    for name in set(sys.modules) - modules:
        if name.split(".")[0] in USER_PACKAGES:
            del sys.modules[name]


STORES: list[Path] = []
"""The ``readme_stores`` folder of the running test (check_trainer reads it)."""


@pytest.fixture(scope="module")
def readme_stores(tmp_path_factory) -> Path:
    """The store README's ``scripts/data/prepare.py --dataset python_stdlib`` makes, for the
    commands that train on it (``stores/stdlib``)."""
    root = tmp_path_factory.mktemp("stores")
    subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / PREPARE),
            "--dataset",
            "python_stdlib",
            "--out",
            str(root / "stdlib"),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return root


@pytest.mark.parametrize("command, check", [_param(command) for command in COMMANDS])
def test_command_works_as_written(
    command: Command,
    check: Check,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    users_project: None,
    readme_stores: Path,
):
    monkeypatch.setattr(sys.modules[__name__], "STORES", [readme_stores])
    for name, value in command.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(fault_tolerance, "check_lighthouse", lambda *_: None)
    monkeypatch.chdir(REPO_ROOT)  # run_train.sh's paths are relative to the repository
    CHECKS[check.kind](check, tmp_path, monkeypatch)
