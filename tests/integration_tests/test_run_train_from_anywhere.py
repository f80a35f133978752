"""run_train.sh called from outside the repository: README's "Adding a model" example works
from the user's own directory, which holds ``my_models/tiny.py`` (README's snippet, taken
from README.md) and a relative CONFIG_FILE."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests.launcher import REPO_ROOT, read_metrics, run_command

RUN_TRAIN = str(REPO_ROOT / "run_train.sh")
CUSTOM_MODEL = ["--experimental.custom_import", "my_models.tiny", "--model.name", "my_llama"]
SHORT = [
    "--training.steps",
    "2",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--model.flavor",
    "debugmodel_tiny",
    "--metrics.log_freq",
    "1",
]


def readme_snippet(path: str) -> str:
    """The ```python block of README.md whose first line is ``# <path>``."""
    readme = (REPO_ROOT / "README.md").read_text()
    match = re.search(rf"```python\n# {re.escape(path)}\n(.*?)```", readme, re.DOTALL)
    assert match is not None, f"README.md has no ```python block starting with '# {path}'"
    return match[1]


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    """A directory outside the repository with the README's custom model and a copied TOML."""
    assert not tmp_path.is_relative_to(REPO_ROOT)
    (tmp_path / "my_models").mkdir()
    (tmp_path / "my_models" / "tiny.py").write_text(readme_snippet("my_models/tiny.py"))
    shutil.copy(REPO_ROOT / "train_configs" / "debug_model.toml", tmp_path / "my_config.toml")
    return tmp_path


@pytest.mark.multiprocess
def test_dry_run_from_the_users_directory(user_dir: Path):
    result = run_command(
        [RUN_TRAIN, *CUSTOM_MODEL],
        env={"NGPU": "1", "DRY_RUN": "1", "CONFIG_FILE": "my_config.toml"},
        cwd=user_dir,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert f"'{user_dir / 'my_config.toml'}'" in result.stdout.splitlines()[-1]


@pytest.mark.multiprocess
def test_two_steps_of_the_custom_model_from_the_users_directory(user_dir: Path):
    dump = user_dir / "outputs"
    result = run_command(
        [RUN_TRAIN, *CUSTOM_MODEL, *SHORT, "--job.dump_folder", str(dump)],
        env={"NGPU": "1", "CONFIG_FILE": "my_config.toml"},
        cwd=user_dir,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert [r["step"] for r in read_metrics(dump)] == [1, 2]
