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
                                reason="thread affinity needs Linux and two or more usable cores")

_PROBE = """
import json, os
from jax._src import xla_bridge
from blis_jax.cpu_backend import start_single_thread_cpu_backend
before = sorted(os.sched_getaffinity(0))
first = start_single_thread_cpu_backend()
started = xla_bridge.backends_are_initialized()
second = start_single_thread_cpu_backend()
threads = [sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")]
print(json.dumps({"before": before, "first": first, "started": started, "second": second, "threads": threads}))
"""


def _probe(**env) -> dict:
    full = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_PLATFORM_NAME")}
    full.update(env)
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO, env=full, capture_output=True, text=True,
                         check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_backend_starts_and_every_thread_gets_all_its_cores_back():
    got = _probe(JAX_PLATFORMS="cpu")
    assert got["first"] and got["started"] and not got["second"]   # a second call: already started
    assert len(got["threads"]) > 1   # XLA's threads exist, and none of them stays on one core
    assert all(cores == got["before"] for cores in got["threads"])


@pytest.mark.parametrize("env", [{"BLIS_JAX_CPU_THREADS": "all"}, {"JAX_PLATFORMS": "cuda"}],
                         ids=["opted-out", "accelerator-requested"])
def test_left_alone_when_opted_out_or_an_accelerator_may_be_used(env):
    got = _probe(**env)
    assert not got["first"] and not got["started"]   # it did not even start the backend


@pytest.mark.slow
def test_run_output_is_the_same_with_either_pool(tmp_path):
    def run(threads: str) -> bytes:
        env = dict(os.environ, BLIS_JAX_CPU_THREADS=threads, BLIS_JAX_COMPILE_CACHE="0", JAX_PLATFORMS="cpu")
        return subprocess.run([sys.executable, "-m", "blis_jax", "run", "--num-requests", "300", "--rate", "12",
                               "--num-instances", "2", "--routing-policy", "weighted"],
                              cwd=REPO, env=env, capture_output=True, check=True, timeout=900).stdout

    one, default = run("one"), run("all")
    assert b"Simulation Metrics" in one
    assert one == default
