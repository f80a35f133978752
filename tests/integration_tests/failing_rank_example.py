"""Test-only train spec (loaded with --experimental.custom_import): rank 1's data loader
raises after two batches, so the test can check that one failing rank tears down all."""

import os
from dataclasses import replace

from torchtitan.protocols import get_train_spec, register_train_spec

_base = get_train_spec("llama3")


def _failing_loader(data, parallel_dims, tokenizer, split="train"):
    loader = _base.build_dataloader_fn(data, parallel_dims, tokenizer, split)
    if os.environ.get("RANK") != "1":
        return loader

    class Failing:
        def __iter__(self):
            for i, batch in enumerate(loader):
                if i == 2:
                    raise RuntimeError("planted failure on rank 1")
                yield batch

        def state_dict(self):
            return loader.state_dict()

        def load_state_dict(self, state):
            loader.load_state_dict(state)

    return Failing()


register_train_spec(replace(_base, name="llama3_failing_rank", build_dataloader_fn=_failing_loader))
