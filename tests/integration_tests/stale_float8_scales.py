"""Test-only planted error (loaded with ``--experimental.custom_import``): the float8 scales
of the FSDP weights are computed after the first optimizer step and never again, so the
float8 all-gather casts the later weights with stale scales. The parity check must fail."""

from __future__ import annotations

from torchtitan.components.quantization import Float8LinearConverter

_refresh_scales = Float8LinearConverter.post_optimizer_hook


def _refresh_scales_once(self, model_parts):
    if not getattr(self, "scales_computed", False):
        _refresh_scales(self, model_parts)
        self.scales_computed = True


Float8LinearConverter.post_optimizer_hook = _refresh_scales_once
