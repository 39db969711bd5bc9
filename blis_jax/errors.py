"""The one exception type for bad user input: it names the field and the fix."""


class ConfigError(ValueError):
    """Invalid configuration or input data. The message names the field and how to fix it."""


class SimulationFailed(RuntimeError):
    """The engine could not complete a run (not a user-input problem); the message says what
    overflowed and what to change."""
