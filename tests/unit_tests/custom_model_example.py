"""A user's own train spec, registered from outside the package (README "Adding a model").
Loaded with ``--experimental.custom_import tests.unit_tests.custom_model_example``."""

from dataclasses import replace

from torchtitan.protocols import TrainSpec, get_train_spec, register_train_spec

_base = get_train_spec("llama3")
_flavors = {"micro": replace(_base.model_args["debugmodel_tiny"], n_layers=2)}

register_train_spec(TrainSpec(**{**vars(_base), "name": "my_llama", "model_args": _flavors}))
