"""Every built-in model describes its blocks to the memory estimator's closed form
(``BaseModelArgs.geometry``, ``protocols/geometry.py``) in its own folder."""

from __future__ import annotations

import pytest

from torchtitan.models import BUILTIN_MODELS
from torchtitan.protocols import get_train_spec
from torchtitan.protocols.geometry import Geometry


@pytest.mark.parametrize("spec", [name for name in BUILTIN_MODELS if name != "hf"])
def test_every_flavor_describes_its_geometry(spec: str):
    """Native models (the hf backend's blocks are transformers': the estimator traces them)."""
    for flavor, args in get_train_spec(spec).model_args.items():
        geometry = args.geometry()
        assert isinstance(geometry, Geometry), (spec, flavor)
        assert (geometry.n_layers, geometry.dim) == (args.n_layers, args.dim), (spec, flavor)
