"""BLIS's golden experiments (blis_jax/golden.py): 15 inference-perf workloads × 2 latency models.

* Our own outputs are pinned in golden/<latency model>.json (written by
  `python -m blis_jax.golden --write golden`): any change to them is a behaviour change.
* Against BLIS, from the pins (default suite, no simulation): request and token totals exactly,
  every latency metric within 0.1 % (the workloads come from BLIS's Go streams, so the pins
  agree with BLIS to float rounding, ≤ 1e-14 relative).

Simulation is `pytest -m slow`: every experiment batched under both latency models against the
pins (one `python -m blis_jax.golden --write` subprocess, XLA optimizing as for the pins);
experiments 66 and 67 each run alone (their own dims) against the same pins, so batched equals
single; the smallest (67, reasoning-lite, 1200 requests) through the `run` command line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from blis_jax import golden

from shared_data import BLIS_REF, needs_blis_ref  # noqa: E402

TESTDATA = BLIS_REF / "testdata"
GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden"


def _experiments(kind: str, ids=None):
    exps = golden.load_experiments(TESTDATA, kind)
    return [e for e in exps if ids is None or e.id in ids]


def _pinned(kind: str) -> dict:
    return json.loads((GOLDEN_DIR / f"{kind}.json").read_text())["experiments"]


@needs_blis_ref
@pytest.mark.slow
def test_single_runs_equal_the_batched_pins():
    """Batched equals single: each experiment run alone (its own dims, `simulate_sessions`)
    gives the pinned metrics, which the batched runs reproduce (next tests)."""
    exps = _experiments("trained-physics", ["66", "67"])
    pinned = _pinned("trained-physics")
    assert golden.run_experiments(exps, batched=False) == [pinned[e.id]["metrics"] for e in exps]


@needs_blis_ref
@pytest.mark.slow  # a whole experiment through the CLI (~11 s): the default suite's time budget
def test_run_flags_reproduce_the_experiment_through_the_cli(tmp_path, capsys):
    from blis_jax.cli import main

    exp = _experiments("trained-physics", ["67"])[0]
    spec = golden.write_spec(exp, tmp_path)
    assert main(golden.run_flags(exp, spec) + ["--metrics-path", str(tmp_path / "m.json")]) == 0
    printed = capsys.readouterr().out
    block = json.loads(printed.split("=== Simulation Metrics ===\n", 1)[1].split("\n}\n", 1)[0] + "\n}")
    assert block == _pinned("trained-physics")["67"]["metrics"]
    assert "=== Session Metrics ===\n  Sessions: 23\n" in printed


@needs_blis_ref
def test_pins_cover_every_experiment():
    for kind in golden.REFERENCE_FILES:
        pinned = _pinned(kind)
        assert sorted(pinned) == sorted(e.id for e in _experiments(kind))
        for exp in _experiments(kind):
            m = pinned[exp.id]["metrics"]
            for key in golden.EXACT_FIELDS:
                assert m[key] == exp.expected[key], (exp.name, key)


@pytest.fixture(scope="module")
def golden_command(tmp_path_factory):
    """`python -m blis_jax.golden --write DIR` (every experiment, both latency models, batched) in
    a subprocess, as the pins were written: with XLA's backend optimizations, which conftest.py
    turns off to save compile time. These runs are long, and -O0 runs them ~2.5x slower
    (experiments 66 + 67 batched, once compiled: 6.2 s CPU vs 2.5 s; compiling: 22 s vs 28 s)."""
    out = tmp_path_factory.mktemp("golden")
    flags = os.environ.get("XLA_FLAGS", "").replace("--xla_backend_optimization_level=0", "").strip()
    package_root = str(Path(golden.__file__).resolve().parents[1])  # the blis_jax this process imported
    env = {**os.environ, "XLA_FLAGS": flags,
           "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "blis_jax.golden", "--reference", str(TESTDATA), "--write",
                           str(out)], env=env, cwd=out, capture_output=True, text=True, timeout=1800)
    return proc, out


@needs_blis_ref
@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(golden.REFERENCE_FILES))
def test_every_experiment_reproduces_the_pins(kind, golden_command):
    proc, out = golden_command
    assert (out / f"{kind}.json").is_file(), proc.stdout + proc.stderr
    metrics = json.loads((out / f"{kind}.json").read_text())["experiments"]
    pinned = _pinned(kind)
    assert sorted(metrics) == sorted(pinned)
    for exp_id, entry in pinned.items():
        assert metrics[exp_id]["metrics"] == entry["metrics"], f"{kind}:{exp_id}"
    assert proc.returncode == 0, proc.stdout + proc.stderr  # and within BLIS's tolerances


def _all_cases():
    if not TESTDATA.exists():
        return []
    return [(kind, e.id) for kind in sorted(golden.REFERENCE_FILES) for e in _experiments(kind)]


@needs_blis_ref
@pytest.mark.parametrize("kind, exp_id", _all_cases(), ids=lambda v: str(v))
def test_experiment_within_blis_tolerances(kind, exp_id):
    """The acceptance check, per experiment, on the pinned outputs (see the module doc)."""
    exp = _experiments(kind, [exp_id])[0]
    problems = golden.compare(exp, _pinned(kind)[exp_id]["metrics"])
    assert not problems, "\n".join(problems)
