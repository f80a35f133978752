"""Moved to ``torchtitan.preflight`` (above ``config/``). This re-export only keeps
scripts/generate/test_generate.py importing until its import names the new place; delete
it then."""

from torchtitan.preflight import preflight  # noqa: F401
