"""TOML inheritance (``[job] base_config``), where each value came from
(``python -m torchtitan.config --show-sources``), job.save_config_file and the torch minimum
version line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.launcher import REPO_ROOT
from torchtitan.config import ConfigError, ConfigManager, save_config_file
from torchtitan.config.entry import main as print_config_main
from torchtitan.config.requirements import check_torch_version


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def chain(tmp_path: Path) -> Path:
    """grand.toml <- configs/base.toml <- configs/child/run.toml, paths relative per file."""
    _write(
        tmp_path / "grand.toml",
        "[training]\nsteps = 3\nseq_len = 32\nlocal_batch_size = 2\n"
        "[training.dataloader]\npin_memory = true\n[optimizer]\nlr = 0.5\n",
    )
    _write(
        tmp_path / "configs" / "base.toml",
        '[job]\nbase_config = "../grand.toml"\n'
        "[training]\nseq_len = 64\n[checkpoint]\nenable_checkpoint = true\n",
    )
    return _write(
        tmp_path / "configs" / "child" / "run.toml",
        '[job]\nbase_config = "../base.toml"\n[training]\nsteps = 7\n',
    )


def test_child_overrides_base_key_by_key_along_the_chain(chain: Path) -> None:
    config = ConfigManager().parse_args(["--job.config_file", str(chain), "--optimizer.lr", "0.25"])
    assert config.training.steps == 7  # child
    assert config.training.seq_len == 64  # base over grand
    assert config.training.local_batch_size == 2  # grand only
    assert config.training.dataloader.pin_memory is True  # nested table from grand
    assert config.checkpoint.enable is True  # deprecated alias in a base
    assert config.optimizer.lr == 0.25  # the command line wins


def test_show_sources_names_the_file_of_every_value(chain: Path, capsys) -> None:
    assert (
        print_config_main(
            ["--job.config_file", str(chain), "--show-sources", "--optimizer.lr", "0.25"]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    base, grand = chain.parent.parent / "base.toml", chain.parent.parent.parent / "grand.toml"
    assert f"steps = 7  # from {chain}" in lines
    assert f"seq_len = 64  # from {base}" in lines
    assert f"local_batch_size = 2  # from {grand}" in lines
    assert "lr = 0.25  # from command line" in lines
    assert "gc_freq = 50  # from default" in lines


def test_printed_config_without_the_flag_is_plain_toml(chain: Path, capsys) -> None:
    print_config_main(["--job.config_file", str(chain)])
    assert tomllib.loads(capsys.readouterr().out)["training"]["steps"] == 7


def test_a_cycle_is_one_error_line(tmp_path: Path) -> None:
    _write(tmp_path / "a.toml", '[job]\nbase_config = "b.toml"\n')
    _write(tmp_path / "b.toml", '[job]\nbase_config = "a.toml"\n')
    with pytest.raises(
        ConfigError,
        match=r"^job\.base_config: the base configs form a cycle: "
        r".*a\.toml -> .*b\.toml -> .*a\.toml$",
    ):
        ConfigManager().parse_args(["--job.config_file", str(tmp_path / "a.toml")])


def test_a_missing_base_file_is_one_error_line(tmp_path: Path) -> None:
    child = _write(tmp_path / "child.toml", '[job]\nbase_config = "nowhere.toml"\n')
    with pytest.raises(
        ConfigError, match=rf"^job\.base_config \(in {child}\): no such file: .*nowhere\.toml$"
    ):
        ConfigManager().parse_args(["--job.config_file", str(child)])


def test_base_config_is_not_a_command_line_flag(chain: Path) -> None:
    with pytest.raises(ConfigError, match="base_config"):
        ConfigManager().parse_args(["--job.base_config", str(chain)])


@pytest.mark.parametrize("name", ["config.json", "saved/config.toml"])
def test_save_config_file_writes_the_merged_config(chain: Path, tmp_path: Path, name: str) -> None:
    config = ConfigManager().parse_args(
        [
            "--job.config_file",
            str(chain),
            "--job.dump_folder",
            str(tmp_path / "out"),
            "--job.save_config_file",
            name,
        ]
    )
    path = save_config_file(config)
    assert path == os.path.join(tmp_path / "out", name)
    text = Path(path).read_text()
    saved = json.loads(text) if name.endswith(".json") else tomllib.loads(text)
    assert saved["training"]["steps"] == 7 and saved["training"]["seq_len"] == 64


def test_an_old_torch_is_refused_with_one_line() -> None:
    check_torch_version("2.11.0a0+git1234")
    check_torch_version("3.0.0")
    with pytest.raises(
        ConfigError, match=r"^torch 2\.10\.1\+cu128 is installed but this code needs torch >= 2\.11"
    ):
        check_torch_version("2.10.1+cu128")


def test_entry_points_check_the_torch_version(tmp_path: Path) -> None:
    """A fake torch 2.9 distribution first on the path: the config entry point says so in
    one line and exits 2."""
    dist_info = tmp_path / "torch-2.9.0.dist-info"
    _write(dist_info / "METADATA", "Metadata-Version: 2.1\nName: torch\nVersion: 2.9.0\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO_ROOT)])}
    result = subprocess.run(
        [sys.executable, "-m", "torchtitan.config"],
        env=env,
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: torch 2.9.0 is installed but this code needs torch >= 2.11; "
        "upgrade it (pip install 'torch>=2.11')"
    ]
