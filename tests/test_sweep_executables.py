"""Compiled sweep programs kept on disk (blis_jax/executables.py): a later process loads them
instead of tracing the engine again, with identical results; the key changes with everything
the program depends on; a damaged or unwritable entry only costs a compilation. The grid is
test_sweep.py's small one, so in-process the programs are those the sweep tests compile anyway.

The test process compiles at XLA backend optimization level 0 (conftest), where XLA:CPU cannot
serialize some engine thunks; the store-and-load round trip therefore runs in two `blis-jax
sweep` processes at the normal level (`-m slow`, ~16 s).
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import yaml

from blis_jax import compile_cache
from blis_jax import executables
from blis_jax.sweep import sharding
from blis_jax.sweep.grid import parse_grid
from blis_jax.sweep.runner import run_sweep

GRID = {"base": {"num-requests": 24, "total-kv-blocks": 600, "max-num-batched-tokens": 512,
                 "prompt-tokens": 150, "prompt-tokens-max": 300, "output-tokens": 30, "output-tokens-max": 60},
        "axes": {"rate": [2, 40], "max-num-seqs": [2, 8]}}
ONE = {"base": GRID["base"], "axes": {"rate": [40], "max-num-seqs": [8]}}   # one program


@pytest.fixture
def disk_cache(tmp_path):
    """The disk cache on, in a fresh directory, for one test."""
    directory = tmp_path / "executables"
    executables.forget()
    compile_cache.set_executable_dir(directory)
    try:
        yield directory
    finally:
        compile_cache.set_executable_dir(None)
        executables.forget()


def test_rows_equal_with_the_disk_cache_and_damaged_entries(disk_cache):
    compile_cache.set_executable_dir(None)
    plain = run_sweep(parse_grid(ONE)).rows
    compile_cache.set_executable_dir(disk_cache)
    assert run_sweep(parse_grid(ONE)).rows == plain
    keys = list(executables._LOADED)
    assert keys                                      # the sweep's programs went through the cache
    disk_cache.mkdir(parents=True, exist_ok=True)
    for key in keys:
        (disk_cache / key).write_bytes(b"not an executable")
    executables.forget()      # read the entries again (the jitted programs stay: no recompilation)
    assert run_sweep(parse_grid(ONE)).rows == plain
    assert sorted(executables._LOADED) == sorted(keys)


def test_key_follows_inputs_and_program():
    mesh = sharding.scenario_mesh()
    ndev = mesh.size

    def key(name="run dims mode", a=(3,), a_type=np.int64, second="b"):
        args = sharding.put({"a": np.zeros((ndev, *a), a_type), second: np.ones((ndev,), np.float64)}, mesh)
        return executables.program_key(name, args)

    base = key()
    assert base == key()
    assert len({base, key(name="run other-dims mode"), key(a=(4,)), key(a_type=np.int32), key(second="c")}) == 5
    assert len(executables.source_digest()) == 64


def test_cli_cache_turns_the_disk_cache_on(tmp_path, monkeypatch):
    monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path / "jax-cache"))
    before = jax.config.jax_compilation_cache_dir
    try:
        assert compile_cache.enable_compile_cache() == tmp_path / "jax-cache"
        assert compile_cache.executable_dir() == tmp_path / "jax-cache-executables"
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        compile_cache.set_executable_dir(None)
    monkeypatch.setenv(compile_cache.ENV_VAR, "off")
    assert compile_cache.enable_compile_cache() is None and compile_cache.executable_dir() is None


@pytest.mark.slow
def test_second_process_loads_the_programs(tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump(GRID))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}   # the normal optimization level
    env[compile_cache.ENV_VAR] = str(tmp_path / "cache")
    entries = tmp_path / "cache-executables"

    def sweep(out: str) -> bytes:
        subprocess.run([sys.executable, "-m", "blis_jax", "sweep", str(grid), "--output-dir", str(tmp_path / out),
                        "--no-plots"], env=env, check=True, capture_output=True)
        return (tmp_path / out / "table.csv").read_bytes()

    first = sweep("first")
    stored = {p.name: p.stat() for p in entries.iterdir()}
    assert stored
    assert sweep("second") == first
    # loaded (touched as recently used), not compiled and written again (a new file)
    again = {p.name: p.stat() for p in entries.iterdir()}
    assert sorted(again) == sorted(stored)
    assert all(again[k].st_ino == stored[k].st_ino and again[k].st_mtime_ns > stored[k].st_mtime_ns for k in again)


def test_prune_keeps_the_most_recently_used(tmp_path):
    for k, name in enumerate(["old", "middle", "new"]):
        path = tmp_path / name
        path.write_bytes(b"x" * 100)
        os.utime(path, ns=(k * 10**9, k * 10**9))
    executables._prune(tmp_path, 250)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["middle", "new"]
    executables._prune(tmp_path, 1000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["middle", "new"]
    executables._prune(tmp_path, 0)
    assert list(tmp_path.iterdir()) == []


_SMALL_PROGRAM = """
import sys
from pathlib import Path
import jax, jax.numpy as jnp
from blis_jax import compile_cache, executables
cache = Path(sys.argv[1])
jax.config.update("jax_compilation_cache_dir", str(cache / "jax"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
compile_cache.set_executable_dir(cache / "executables")
program = jax.jit(lambda x: jnp.where(jnp.sort(x) > 2, jnp.exp(jnp.cumsum(x) / 100), -x).sum())
print(float(executables.call(program, "small", jnp.arange(100.0))), executables.stats["stored"])
print(float(jax.jit(lambda x: jnp.cumsum(x * 2).sum())(jnp.arange(50.0))))   # JAX's cache still works after
"""


def test_an_executable_from_jax_s_cache_is_never_written(tmp_path):
    """The CI failure of stop 26: a process whose compilation JAX's persistent cache answered
    wrote that executable to disk; XLA:CPU had serialized it without its kernels' object code,
    and the next process failed on its first call ("Function ... fusion not found"). Programs
    of this cache are compiled with JAX's cache bypassed, so a lost entry is written again."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}

    def run() -> tuple[str, int]:
        done = subprocess.run([sys.executable, "-c", _SMALL_PROGRAM, str(tmp_path)], env=env,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        value, stored, _ = done.stdout.split()
        return value, int(stored)

    value, stored = run()                    # compiled (JAX's cache bypassed) and written
    assert stored == 1
    assert list((tmp_path / "jax").iterdir()), "JAX's cache holds the other program"
    for entry in (tmp_path / "executables").iterdir():
        entry.unlink()                       # ours lost (pruned)
    assert run() == (value, 1)               # compiled again, not taken from JAX's cache
    assert run() == (value, 0)               # loaded, and it runs
