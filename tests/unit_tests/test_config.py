import dataclasses
import subprocess
import sys
import textwrap

import pytest

from tests.launcher import REPO_ROOT
from torchtitan.config import ConfigError, ConfigManager, JobConfig

DEBUG_TOML = str(REPO_ROOT / "train_configs" / "debug_model.toml")


def parse(*args):
    return ConfigManager().parse_args(list(args))


def write(tmp_path, text):
    path = tmp_path / "job.toml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_defaults_without_file():
    config = parse()
    assert isinstance(config, JobConfig)
    assert config.training.steps == 10000 and config.model.name == "llama3"


def test_precedence_cli_over_toml_over_defaults():
    config = parse("--job.config_file", DEBUG_TOML, "--training.steps", "7")
    assert config.training.steps == 7  # CLI
    assert config.training.seq_len == 256  # TOML
    assert config.training.gc_freq == 50  # default


def test_the_last_config_file_flag_is_the_file_read(tmp_path):
    """run_train.sh passes --job.config_file $CONFIG_FILE before the user's arguments."""
    own = write(
        tmp_path,
        """
        [training]
        seq_len = 96
    """,
    )
    for flags in (
        ["--job.config_file", DEBUG_TOML, "--job.config_file", own],
        [f"--job.config_file={DEBUG_TOML}", f"--job.config_file={own}"],
    ):
        config = parse(*flags)
        assert config.job.config_file == own and config.training.seq_len == 96


def test_boolean_flags_and_comma_lists():
    config = parse(
        "--metrics.enable_tensorboard",
        "--metrics.no-disable-color-printing",
        "--checkpoint.exclude_from_loading",
        "optimizer,lr_scheduler",
        "--model.converters=a,b",
        "--training.local-batch-size",
        "3",
    )
    assert config.metrics.enable_tensorboard is True
    assert config.metrics.disable_color_printing is False
    assert config.checkpoint.exclude_from_loading == ["optimizer", "lr_scheduler"]
    assert config.model.converters == ["a", "b"]
    assert config.training.local_batch_size == 3


def test_toml_comma_string_list(tmp_path):
    config = parse(
        "--job.config_file",
        write(
            tmp_path,
            """
        [checkpoint]
        exclude_from_loading = "optimizer, dataloader"
    """,
        ),
    )
    assert config.checkpoint.exclude_from_loading == ["optimizer", "dataloader"]


@pytest.mark.parametrize(
    "toml, message",
    [
        ("[training]\nstepz = 3\n", "training.stepz: unknown key; did you mean 'training.steps'?"),
        ("[trainin]\nsteps = 3\n", "trainin: unknown section; did you mean 'training'?"),
        ("[training]\nsteps = '3'\n", "training.steps: expected an integer"),
        (
            "[training]\nmixed_precision_param = 'fp8'\n",
            "training.mixed_precision_param: must be one of",
        ),
        ("[training\n", "is not valid TOML"),
        ("[training]\nsteps = -3\n", "training.steps: must be >= 1"),
        ("[optimizer]\nlr = 0\n", "optimizer.lr: must be > 0"),
        ("[training]\nseq_len = 0\n", "training.seq_len: must be >= 1"),
    ],
)
def test_bad_toml_gives_one_clear_error(tmp_path, toml, message):
    with pytest.raises(ConfigError) as e:
        parse("--job.config_file", write(tmp_path, toml))
    assert message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--training.stepz", "3"], "did you mean --training.steps?"),
        (
            ["--training.step", "3"],
            "did you mean --training.steps?",
        ),  # not the first of tyro's list
        (["--training.steps", "x"], "--training.steps"),
        (["--optimizer.name", "SGD"], "--optimizer.name"),
        (["--job.config_file", "/nonexistent.toml"], "job.config_file: no such file"),
        (
            ["--training.enable_cpu_offload", "maybe"],
            "--training.enable_cpu_offload is a switch and takes no value (got 'maybe')",
        ),
        (["--compile.enable=true", "--training.steps", "3"], "--compile.enable is a switch"),
        (
            ["--metrics.no-enable-tensorboard=1"],
            "or --metrics.no_enable_tensorboard to turn it off",
        ),
    ],
)
def test_bad_cli_gives_one_clear_error(args, message):
    with pytest.raises(ConfigError) as e:
        parse(*args)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_deprecated_aliases_toml_and_cli(tmp_path, caplog):
    path = write(
        tmp_path,
        """
        [training]
        seed = 5
        deterministic = true
        [lr_scheduler]
        lr_min = 0.1
        [checkpoint]
        last_save_model_weights_only = false
        [experimental]
        custom_args_module = "tests.unit_tests.custom_config_example"
    """,
    )
    with caplog.at_level("WARNING", logger="torchtitan"):
        config = parse("--job.config_file", path, "--training.seed", "9")
    assert config.debug.seed == 9 and config.debug.deterministic is True
    assert config.lr_scheduler.min_lr_factor == 0.1
    assert config.checkpoint.last_save_model_only is False
    assert config.job.custom_config_module == "tests.unit_tests.custom_config_example"
    assert "'training.seed' is deprecated; use 'debug.seed'" in caplog.text


def test_deprecated_value_is_mapped_with_a_warning(tmp_path, caplog):
    path = write(
        tmp_path,
        """
        [memory_estimation]
        mode = "validate"
    """,
    )
    with caplog.at_level("WARNING", logger="torchtitan"):
        assert parse("--job.config_file", path).memory_estimation.mode == "measure"
        assert parse("--memory_estimation.mode", "validate").memory_estimation.mode == "measure"
    assert "memory_estimation.mode = 'validate' is deprecated; use 'measure'" in caplog.text
    assert parse("--memory_estimation.mode", "plan").memory_estimation.mode == "plan"


@pytest.mark.parametrize("signals", ["SIGFOO", "SIGTERM,sigusr1", "SIG_IGN"])
def test_unknown_preemption_signal_is_refused_with_the_config(signals):
    with pytest.raises(ConfigError, match=r"^checkpoint.preemption_signals: unknown signal"):
        parse("--checkpoint.preemption_signals", signals)
    assert parse(
        "--checkpoint.preemption_signals", "SIGTERM,SIGUSR1"
    ).checkpoint.preemption_signals == ["SIGTERM", "SIGUSR1"]


def test_not_yet_supported_feature_is_refused():
    with pytest.raises(ConfigError, match="compiled autograd is not supported yet"):
        parse("--parallelism.enable_compiled_autograd")


def test_custom_config_module_merges_sections_and_fields():
    config = parse(
        "--job.custom_config_module",
        "tests.unit_tests.custom_config_example",
        "--custom_section.knob",
        "4",
        "--training.my_extra_flag",
    )
    assert config.custom_section.knob == 4
    assert config.training.my_extra_flag is True
    assert config.training.steps == 10000  # existing fields kept
    assert dataclasses.is_dataclass(config.training)


def _run_cli(*args, module: str = "torchtitan.config"):
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_cli_prints_merged_config_and_exit_codes():
    ok = _run_cli("--job.config_file", DEBUG_TOML, "--training.steps", "7")
    assert ok.returncode == 0 and "steps = 7" in ok.stdout
    bad_key = _run_cli("--job.config_file", DEBUG_TOML, "--training.stepz", "7")
    assert bad_key.returncode == 2
    assert bad_key.stderr.strip().count("\n") == 0 and "error:" in bad_key.stderr
    bad_value = _run_cli("--job.config_file", DEBUG_TOML, "--training.steps", "-1")
    assert bad_value.returncode == 2 and "training.steps: must be >= 1" in bad_value.stderr
    degrees = _run_cli(
        "--world-size",
        "4",
        "--parallelism.data_parallel_shard_degree",
        "3",
        module="torchtitan.preflight",
    )
    assert degrees.returncode == 2 and "must equal world_size 4" in degrees.stderr
    moved = _run_cli("--world-size", "4")
    assert moved.returncode == 2 and "python -m torchtitan.preflight --world-size" in moved.stderr


def test_help_lists_every_flag_with_docstrings():
    out = _run_cli("--help").stdout
    assert "--training.steps" in out and "Training steps." in out
    assert "--checkpoint.exclude_from_loading" in out
