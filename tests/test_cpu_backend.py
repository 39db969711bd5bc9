"""cpu_backend: the one-thread CPU execution pool leaves no thread pinned, stays out of the way
where it must, and changes no output. Each check needs a fresh process (the backend starts once)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                reason="the one-thread start needs thread affinity (Linux) and two or more usable "
                                       "cores; elsewhere it does nothing, by design")

_PROBE = """
import json, os
from jax._src import xla_bridge
from blis_jax.cpu_backend import start_single_thread_cpu_backend
import threading, ctypes
ready, stop = threading.Event(), threading.Event()
def worker():   # a thread of the caller's own, pinned to one core: it must keep its mask
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    ctypes.CDLL(None).prctl(15, b"pinned-worker")
    ready.set(); stop.wait()
threading.Thread(target=worker, daemon=True).start(); ready.wait()
before = sorted(os.sched_getaffinity(0))
first = start_single_thread_cpu_backend()
started = xla_bridge.backends_are_initialized()
second = start_single_thread_cpu_backend()
import jax, jax.numpy as jnp
jax.jit(lambda x: x + 1)(jnp.arange(3)).block_until_ready()   # the pools exist
tasks = os.listdir("/proc/self/task")
threads = [sorted(os.sched_getaffinity(int(t))) for t in tasks]
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in tasks]
pinned = [sorted(os.sched_getaffinity(int(t))) for t, n in zip(tasks, names) if n == "pinned-worker"]
print(json.dumps({"before": before, "first": first, "started": started, "second": second, "threads": threads,
                  "eigen": sum(n.startswith("tf_XLAEigen") for n in names), "pinned": pinned}))
"""


def _env(**env) -> dict:
    """This process's environment without its platform choice, plus `env`."""
    base = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_PLATFORM_NAME")}
    return {**base, **env}


def _probe(**env) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO, env=_env(**env), capture_output=True, text=True,
                         check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_one_execution_thread_and_every_thread_gets_its_own_cores_back():
    got = _probe(JAX_PLATFORMS="cpu")
    assert got["first"] and got["started"] and not got["second"]   # a second call: already started
    assert got["eigen"] == 1   # XLA's execution pool has one thread
    pinned_core = [max(got["before"])]
    assert got["pinned"] == [pinned_core]   # the caller's pinned thread keeps its own mask
    others = [cores for cores in got["threads"] if cores != pinned_core]
    assert len(others) == len(got["threads"]) - 1 and all(cores == got["before"] for cores in others)


def test_the_default_pool_has_a_thread_per_core():
    """What the one-thread start changes (the assertion above could not fail if it did nothing)."""
    got = _probe(JAX_PLATFORMS="cpu", BLIS_JAX_CPU_THREADS="all")
    assert not got["first"] and got["eigen"] == len(got["before"])


_PROBE_ACCELERATOR = """
import json
from jax._src import xla_bridge
from blis_jax.cpu_backend import start_single_thread_cpu_backend
print(json.dumps([start_single_thread_cpu_backend(), xla_bridge.backends_are_initialized()]))
"""


@pytest.mark.parametrize("env", [{"BLIS_JAX_CPU_THREADS": "all"}, {"JAX_PLATFORMS": "cuda"},
                                 {"JAX_PLATFORMS": "cpu,tpu"}, {"TPU_LIBRARY_PATH": "/nonexistent/libtpu.so"}],
                         ids=["opted-out", "accelerator-requested", "cpu-and-another", "tpu-runtime"])
def test_left_alone_when_opted_out_or_an_accelerator_may_be_used(env):
    out = subprocess.run([sys.executable, "-c", _PROBE_ACCELERATOR], cwd=REPO, env=_env(**env),
                         capture_output=True, text=True, check=True, timeout=300)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [False, False]   # the backend was not even started


def test_bad_flags_are_reported_before_the_backend_starts():
    out = subprocess.run([sys.executable, "-m", "blis_jax", "run", "--rate", "inf"], cwd=REPO,
                         env=_env(JAX_PLATFORMS="cpu,tpu"), capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "--rate inf" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_run_output_is_the_same_with_either_pool():
    def run(threads: str) -> bytes:
        env = _env(BLIS_JAX_CPU_THREADS=threads, BLIS_JAX_COMPILE_CACHE="0", JAX_PLATFORMS="cpu")
        return subprocess.run([sys.executable, "-m", "blis_jax", "run", "--num-requests", "300", "--rate", "12",
                               "--num-instances", "2", "--routing-policy", "weighted"],
                              cwd=REPO, env=env, capture_output=True, check=True, timeout=900).stdout

    one, default = run(""), run("all")
    assert b"Simulation Metrics" in one
    assert one == default
