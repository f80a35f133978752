"""A Hugging Face model id in ``model.hf_assets_path`` resolves to its snapshot in the Hugging
Face cache (offline here: a cache laid out as huggingface_hub writes it, in the test's
folder), and the hf backend builds the model from it; an id that is neither cached nor
fetchable is one line."""

from __future__ import annotations

import shutil

import huggingface_hub.constants
import pytest

from scripts.hf_compat import build_model, write_folder
from torchtitan.config import ConfigError, ConfigManager

REPO_ID = "acme/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An offline huggingface_hub whose cache (in ``tmp_path``) holds ``REPO_ID``."""
    cache = tmp_path / "hub"
    repo = cache / f"models--{REPO_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(write_folder(tmp_path, "llama"), snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return snapshot


def test_a_hub_id_builds_from_its_cached_snapshot(offline_cache):
    flags = ["--model.name", "hf", "--model.flavor", "full", "--model.hf_assets_path", REPO_ID]
    config = ConfigManager().parse_args(flags)
    assert config.model.hf_assets_path == str(offline_cache)
    model = build_model(offline_cache)
    assert type(model.base).__name__ == "LlamaModel"


def test_a_local_folder_is_not_looked_up(offline_cache, monkeypatch):
    monkeypatch.chdir(offline_cache.parents[3])  # "hub/models--acme--tiny-llama" exists here
    path = "hub/models--acme--tiny-llama"
    config = ConfigManager().parse_args(["--model.hf_assets_path", path])
    assert config.model.hf_assets_path == path


def test_an_id_neither_cached_nor_fetchable_is_one_line(offline_cache):
    with pytest.raises(ConfigError, match=r"^model.hf_assets_path: 'acme/absent' is not a") as e:
        ConfigManager().parse_args(["--model.hf_assets_path", "acme/absent"])
    assert "\n" not in str(e.value)
