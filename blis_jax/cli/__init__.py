"""The `blis-jax` command line: one thin client of the library (flags → `ScenarioConfig` →
library call → output). Nothing outside this package imports it."""

from blis_jax.cli import app
from blis_jax.cli.app import build_parser, console_main, main

__all__ = ["build_parser", "console_main", "main"]


def __getattr__(attr: str):  # TEMPORARY, while library modules move onto blis_jax.scenario
    return getattr(app, attr)
