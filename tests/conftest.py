"""Shared test setup. Importing blis_jax switches on x64 before any array is created."""

import blis_jax  # noqa: F401
