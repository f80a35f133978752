"""Built-in models. Their train specs register when ``register_builtin_models()`` imports
them (the train-spec registry calls it on first use), not when this package is imported, so
that low-level modules (attention, init) import without pulling in every model."""

import importlib

BUILTIN_MODELS = ("llama3", "deepseek_v3", "qwen3", "gpt_oss", "qwen3_5", "hf")


def register_builtin_models() -> None:
    for name in BUILTIN_MODELS:
        importlib.import_module(f"torchtitan.models.{name}")
