"""The errors every layer raises for bad input; entry points print them as one ``error: ...``
line and exit 2 (``torchtitan.config.entry.config_errors_exit``). Imports nothing, so the
lowest layers can raise them without loading the config machinery."""


class UserInputError(ValueError):
    """Bad input from the user (a config value, a path, a checkpoint that does not load): the
    message is one line that names what to change. Its subclasses are the kinds of input."""


class ConfigError(UserInputError):
    """A bad job config; the message is one line that names the field and the fix."""
