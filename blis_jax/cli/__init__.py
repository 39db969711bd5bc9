"""The `blis-jax` command line: one thin client of the library (flags → `ScenarioConfig` →
library call → output). Nothing outside this package imports it (tests/test_layering.py)."""

from blis_jax.cli.app import build_parser, console_main, main

__all__ = ["build_parser", "console_main", "main"]
