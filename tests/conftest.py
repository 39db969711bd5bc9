"""Shared test setup. Importing blis_jax switches on x64 before any array is created.

Tests that call the CLI in-process would switch on JAX's persistent compilation cache in the
user's cache directory for the rest of the session (the CLI's default); tests keep it off
unless they set BLIS_JAX_COMPILE_CACHE themselves (the compile-cache test does, in a
subprocess). Compiled programs are dropped after each test module: a full run compiles
dozens of engine and cluster programs, and keeping them all resident exhausted the memory of
a small CI machine.
"""

import gc
import os

os.environ.setdefault("BLIS_JAX_COMPILE_CACHE", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

import blis_jax  # noqa: E402, F401


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    yield
    jax.clear_caches()
    gc.collect()
