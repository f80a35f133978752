"""Test-only train spec (loaded with --experimental.custom_import): only rank 1 finds bad
input (a ConfigError while building its data loader), so the test can check that a user
error on a rank whose output is filtered still ends the run with that one error line."""

import os
from dataclasses import replace

from torchtitan.config import ConfigError
from torchtitan.protocols import get_train_spec, register_train_spec

_base = get_train_spec("llama3")


def _loader_refused_on_rank_1(data, parallel_dims, tokenizer, split="train"):
    if os.environ.get("RANK") == "1":
        raise ConfigError("training.dataset_path: planted error found on rank 1 only")
    return _base.build_dataloader_fn(data, parallel_dims, tokenizer, split)


register_train_spec(
    replace(_base, name="llama3_rank1_user_error", build_dataloader_fn=_loader_refused_on_rank_1)
)
