"""The one exception type for bad user input: it names the field and the fix."""


class ConfigError(ValueError):
    """Invalid configuration or input data. The message names the field and how to fix it."""
