"""Shared test setup. Importing blis_jax switches on x64 before any array is created.

Tests that call the CLI in-process would switch on JAX's persistent compilation cache in the
user's cache directory for the rest of the session (the CLI's default); tests keep it off
unless they set BLIS_JAX_COMPILE_CACHE themselves (the compile-cache test does, in a
subprocess). Compiled programs of the modules that build large ones are dropped after the
module: a full run compiles dozens of engine and cluster programs, and keeping them all
resident crashed a run on a small CI machine.
"""

import atexit
import gc
import os
import shutil
import tempfile

os.environ.setdefault("BLIS_JAX_COMPILE_CACHE", "0")
# Every BLIS reference output (blis-diff cases, golden experiments, worked numbers) was produced
# with BLIS's own coefficients, iter29; blis-jax's default is another fit (docs/FITTING.md). The
# suite runs with BLIS's as the default, subprocesses included; tests of the default itself
# unset this (test_config.py).
os.environ["BLIS_JAX_COEFFICIENTS"] = "iter29"
# The suite is dominated by XLA compilation (dozens of engine programs, each run briefly), and
# LLVM's backend optimizations are ~40% of a compile. Without them the same IEEE arithmetic
# runs a little slower; results do not change (the BLIS parity and golden-pin tests hold).
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

import blis_jax  # noqa: E402, F401
from blis_jax import executables  # noqa: E402
from blis_jax.cpu_backend import start_single_thread_cpu_backend  # noqa: E402

# Tests run one device's programs, as `blis-jax run` does, so they use its one-thread execution
# pool (cpu_backend.py): every parity test then holds under it. In-process tests therefore see one
# CPU device; multi-device sweeps are tested in subprocesses (test_sweep.py).
start_single_thread_cpu_backend()

# XLA's persistent compilation cache, for the test session only: a module whose programs were
# dropped (below) loads them again instead of recompiling the same program, and CI points
# BLIS_JAX_TEST_XLA_CACHE at one directory for both of its runs, so the slow suite loads what
# the default suite compiled. Only compilation is cached: tracing still runs, so the
# trace-count tests see every trace. `0` turns it off; unset, a temporary directory is used.
_XLA_CACHE = os.environ.get("BLIS_JAX_TEST_XLA_CACHE")
if _XLA_CACHE is None:
    _XLA_CACHE = tempfile.mkdtemp(prefix="blis-jax-test-xla-")
    atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
if _XLA_CACHE.strip().lower() not in ("0", "off", ""):
    jax.config.update("jax_compilation_cache_dir", _XLA_CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


# Modules whose compiled programs are large or many (clusters, sweeps, fits, golden runs, the
# CLI's and the API's replays of every reference case): dropped after the module. Others keep
# theirs, which later modules often reuse (same shapes).
_LARGE_PROGRAMS = ("cluster", "sweep", "plan", "sensitivity", "golden", "fit", "concurrency", "sessions",
                   "test_cli", "test_api", "accuracy", "docs", "engine_parity")
# Each XLA:CPU executable holds memory mappings of its own; past the kernel's per-process limit
# (vm.max_map_count, 65530 by default) the next compilation crashes in LLVM (a segfault in
# the -m slow run, at 4.1 GB RSS, in a compile that passes alone). Programs are also dropped
# after any module once the process holds this many mappings.
_MAX_MAPPINGS = 20_000


def _mappings() -> int:
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:   # not Linux: the named modules above only
        return 0


# A module can reach the limit by itself (a replay's compiled programs hold ~1,900 mappings;
# test_cli's -m slow replays compile ~25): past this many, its programs are dropped between its
# tests too.
_MAX_MAPPINGS_IN_MODULE = 45_000


def _drop() -> None:
    jax.clear_caches()
    executables.forget()
    gc.collect()


def _large(module_name: str) -> bool:
    return any(word in module_name for word in _LARGE_PROGRAMS)


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs(request):
    yield
    if _large(request.module.__name__) or _mappings() > _MAX_MAPPINGS:
        _drop()


def pytest_runtest_teardown(item, nextitem):
    module = getattr(item, "module", None)
    if module is not None and getattr(nextitem, "module", None) is module and _large(module.__name__) \
            and _mappings() > _MAX_MAPPINGS_IN_MODULE:
        _drop()
