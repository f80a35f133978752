"""The error every layer raises for bad input; entry points print it as one ``error: ...``
line and exit 2 (``torchtitan.config.entry.config_errors_exit``). Imports nothing, so the
lowest layers can raise it without loading the config machinery."""


class ConfigError(ValueError):
    """A bad job config; the message is one line that names the field and the fix."""
