"""Property-based robustness (hypothesis): generated malformed traces, specs, grids and flag
values through `blis-jax` in-process. The contract: exit 2 with one short `error:` line and no
traceback, or a successful run whose outputs pass the basic invariants (request conservation,
non-negative counters); no input file is ever modified.

Valid draws keep lengths small, so every run shares a few compiled engine programs and the
default examples finish in well under a minute; `-m slow` runs many more.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from blis_jax.errors import ConfigError
from blis_jax.sweep.grid import load_grid

from robust_helpers import (
    COEFFS,
    TRACE_HEADER,
    assert_one_error_line,
    assert_unchanged,
    cli,
    snapshot,
    trace_csv,
    trace_row,
)

FAST = settings(max_examples=int(os.environ.get("BLIS_JAX_PROPERTY_EXAMPLES", "25")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
MANY = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

HUGE = st.sampled_from([2**31, 2**40 + 1, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64, 10**30])
BAD_TEXT = st.sampled_from(["", "-1", "1.5", "nan", "inf", "1e9", "abc", "true", " 7", "0x10", "١٢", "x" * 3000])
SMALL = st.integers(0, 64)


# Every example's files live under one directory per test process, removed when it exits (an
# example per directory: hypothesis runs hundreds, and mkdtemp alone left them all in /tmp).
_SCRATCH_ROOT = tempfile.mkdtemp(prefix="blis-prop-")
atexit.register(shutil.rmtree, _SCRATCH_ROOT, ignore_errors=True)


def _scratch() -> Path:
    return Path(tempfile.mkdtemp(prefix="case-", dir=_SCRATCH_ROOT))


def _mostly(valid: st.SearchStrategy, hostile: st.SearchStrategy, one_in: int = 6) -> st.SearchStrategy:
    """`valid`, but `hostile` one time in `one_in` (hypothesis's own choices are not uniform)."""
    return st.integers(0, one_in - 1).flatmap(lambda k: hostile if k == one_in - 1 else valid)


# A valid row; a test applies at most one hostile cell (a mutation) to the whole trace, so
# about half the traces run and the other half carry exactly one fault.
ROW = st.fixed_dictionaries({
    "request_id": st.integers(0, 5).map(str),
    "input_tokens": st.integers(1, 48).map(str),
    "output_tokens": st.integers(0, 16).map(str),
    "arrival_time_us": st.integers(0, 3 * 10**6).map(str),
    "deadline_us": st.sampled_from(["0", str(10**9)]),
})  # (no prefix groups: their count and length would change the engine's shapes, one compile each)
COLUMNS = ["prefix_length", "prefix_group", "request_id", "input_tokens", "output_tokens", "arrival_time_us", "deadline_us", "prefix_length",
           "streaming", "reason_ratio", "status", "round_index", "server_input_tokens", "first_chunk_time_us"]
HOSTILE_CELL = st.one_of(HUGE.map(str), BAD_TEXT, st.sampled_from(["maybe", "bogus", "-inf"]))
MUTATION = st.one_of(st.none(), st.tuples(st.integers(0, 5), st.sampled_from(COLUMNS), HOSTILE_CELL))


def _check_outputs(tmp: Path) -> None:
    """Invariants of a successful run's metrics file."""
    metrics = json.loads((tmp / "m.json").read_text())
    parts = ("completed_requests", "still_queued", "still_running", "dropped_unservable", "timed_out_requests")
    assert all(metrics[k] >= 0 for k in parts)
    assert metrics["injected_requests"] == sum(metrics[k] for k in parts)
    results = json.loads((tmp / "r.json").read_text())
    assert len(results) == metrics["completed_requests"]


def _event(label: str) -> None:
    try:
        event(label if not label.startswith("/") else "a file")
    except Exception:  # noqa: BLE001 - outside a hypothesis test
        pass


def _contract(tmp: Path, argv: list, inputs: list[Path]) -> int:
    before = snapshot(*inputs)
    for name in ("m.json", "r.json"):
        (tmp / name).unlink(missing_ok=True)
    rc, out, err = cli(*argv, "--metrics-path", tmp / "m.json", "--results-path", tmp / "r.json")
    assert "Traceback" not in err
    if rc != 0:
        line = assert_one_error_line(rc, err)
        assert not (tmp / "m.json").exists()
        _event(line.split(": error: ")[1].split(" ")[0])  # the field blamed (statistics)
    else:
        _check_outputs(tmp)
        _event("ran")
    assert_unchanged(before)
    return rc


def _replay_case(rows, header_text, bom, drop_column, mutation=None):
    tmp = _scratch()
    if mutation is not None and rows:
        row, column, value = mutation
        rows = [dict(r) for r in rows]
        rows[row % len(rows)][column] = value
    text = trace_csv([trace_row(**{**r, "send_time_us": r["arrival_time_us"]}) for r in rows])
    if drop_column is not None:
        lines = [line.split(",") for line in text.splitlines()]
        text = "\n".join(",".join(cells[:drop_column] + cells[drop_column + 1:]) for cells in lines) + "\n"
    header, data = tmp / "t.yaml", tmp / "t.csv"
    header.write_text(header_text)
    data.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode())
    argv = ["replay", "--trace-header", header, "--trace-data", data, "--total-kv-blocks", "4096",
            "--horizon", str(10**8)]
    return tmp, argv, [header, data]


HEADERS = _mostly(st.just(TRACE_HEADER), st.sampled_from(["trace_version: 9\n", "[1, 2]\n", "mode: real\nfoo: 1\n",
                           "trace_version: 3\nworkload_seed: 99999999999999999999999\n", "a: " + "[" * 200,
                           "trace_version: 3\nwarm_up_requests: -1\n"]))


@FAST
@given(rows=st.lists(ROW, min_size=1, max_size=4), header_text=HEADERS, bom=st.booleans(),
       drop_column=_mostly(st.none(), st.integers(0, 26), one_in=8), mutation=MUTATION)
def test_generated_traces_keep_the_contract(rows, header_text, bom, drop_column, mutation):
    tmp, argv, inputs = _replay_case(rows, header_text, bom, drop_column, mutation)
    _contract(tmp, argv, inputs)


SPEC_VALUES = st.one_of(SMALL, HUGE, st.sampled_from([-1, 0.5, "7", True, None, [], {}, "nan", 1e308]))


SPEC_ARGS = dict(
    num_requests=_mostly(st.integers(1, 5), SPEC_VALUES),
    seed=_mostly(st.integers(-2**63, 2**64 - 1), st.one_of(HUGE, st.sampled_from([-(2**63) - 1, "x", 2**64]))),
    rate=_mostly(st.sampled_from([5, 0.5, 1e-3]), SPEC_VALUES), value=_mostly(st.integers(1, 48), SPEC_VALUES),
    extra=_mostly(st.just(""), st.sampled_from(["colour: red\n", "clients: 3\n", "horizon: 99999999999999999999\n"])))


# A valid example is a whole simulation (~4 s): 8 examples in the default suite, the usual
# count with -m slow (CI time).
@settings(FAST, max_examples=min(8, FAST.max_examples))
@given(**SPEC_ARGS)
def test_generated_specs_keep_the_contract(num_requests, seed, rate, value, extra):
    _spec_contract(num_requests, seed, rate, value, extra)


@pytest.mark.slow
@FAST
@given(**SPEC_ARGS)
def test_generated_specs_keep_the_contract_more_examples(num_requests, seed, rate, value, extra):
    _spec_contract(num_requests, seed, rate, value, extra)


def _spec_contract(num_requests, seed, rate, value, extra):
    tmp = _scratch()
    spec = tmp / "s.yaml"
    spec.write_text(
        f"version: '2'\nseed: {json.dumps(seed)}\ncategory: language\naggregate_rate: {json.dumps(rate)}\n"
        f"num_requests: {json.dumps(num_requests)}\nclients:\n- id: c\n  rate_fraction: 1\n"
        f"  arrival: {{process: constant}}\n  input_distribution: {{type: constant, params: {{value: {json.dumps(value)}}}}}\n"
        f"  output_distribution: {{type: constant, params: {{value: 4}}}}\n" + extra)
    rc = _contract(tmp, ["run", "--workload-spec", spec, "--total-kv-blocks", "4096", "--num-requests", "3"], [spec])
    assert rc in (0, 2)


AXIS_VALUES = st.lists(st.one_of(st.integers(-3, 10**6), HUGE, st.sampled_from(["x", None, 1.5, True, [], "nan"])),
                       min_size=0, max_size=5)


@FAST
@given(axes=st.dictionaries(st.sampled_from(["rate", "max-num-seqs", "seed", "total_kv_blocks", "bogus", "tp"]),
                            AXIS_VALUES, max_size=3),
       base=st.dictionaries(st.sampled_from(["num-requests", "rate", "model", "hardware"]),
                            st.one_of(SMALL, HUGE, st.sampled_from(["", "H100", "x" * 500, None])), max_size=2))
def test_generated_grids_load_or_fail_with_one_short_line(axes, base):
    tmp = _scratch()
    grid = tmp / "g.yaml"
    grid.write_text(json.dumps({"base": base, "axes": axes}))
    try:
        loaded = load_grid(grid)
    except ConfigError as e:
        message = str(e)
        assert "\n" not in message and len(message) <= 300, message[:400]
    else:
        assert len(loaded.combos) >= 1


HOSTILE_FLAG = st.one_of(st.sampled_from(["-1", "inf", "-inf", "nan", "1e3", "0.5", "", "abc", "0"]), HUGE.map(str))
# Valid values that do not change the engine's static shapes (one compiled program for all
# runs): the settings that size buffers only get hostile values, or their base value.
FREE_FLAGS = {"--seed": st.integers(-2**63, 2**63 - 1), "--horizon": st.integers(1, 10**12),
              "--rate": st.floats(1e-3, 1e4), "--timeout": st.floats(-10, 10**6),
              "--num-requests": st.integers(1, 3), "--prompt-tokens": st.integers(1, 60),
              "--max-model-len": st.integers(40, 8192), "--long-prefill-token-threshold": st.integers(0, 64),
              "--max-memory-gib": st.floats(0.01, 64), "--gpu-memory-utilization": st.floats(0.05, 1)}
SHAPE_FLAGS = {"--max-num-seqs": "256", "--max-num-batched-tokens": "2048", "--total-kv-blocks": "4096",
               "--block-size-in-tokens": "16", "--tp": "1", "--prefix-tokens": "0", "--output-tokens-max": "16"}
FLAG_VALUE = {**{f: st.one_of(s.map(str), HOSTILE_FLAG) for f, s in FREE_FLAGS.items()},
              **{f: st.one_of(st.just(v), HOSTILE_FLAG) for f, v in SHAPE_FLAGS.items()}}


@FAST
@given(flags=st.lists(st.sampled_from(sorted(FLAG_VALUE)), min_size=1, max_size=3, unique=True).flatmap(
    lambda names: st.fixed_dictionaries({n: FLAG_VALUE[n] for n in names})))
def test_generated_flag_values_keep_the_contract(flags):
    tmp = _scratch()
    base = {"--num-requests": "3", "--total-kv-blocks": "4096", "--prompt-tokens": "32", "--prompt-tokens-stdev": "0",
            "--output-tokens": "4", "--output-tokens-stdev": "0", "--prompt-tokens-max": "64",
            "--output-tokens-max": "16"}
    merged = {**base, **flags}
    argv = ["run"] + [f"{k}={v}" for k, v in merged.items()]
    _contract(tmp, argv, [])


@pytest.mark.slow
@MANY
@given(rows=st.lists(ROW, min_size=0, max_size=6), header_text=HEADERS, bom=st.booleans(),
       drop_column=st.one_of(st.none(), st.integers(0, 26)), mutation=MUTATION)
def test_many_generated_traces_keep_the_contract(rows, header_text, bom, drop_column, mutation):
    tmp, argv, inputs = _replay_case(rows, header_text, bom, drop_column, mutation)
    _contract(tmp, argv, inputs)


def test_coefficients_helper_file_is_valid():
    """The fixtures the properties start from are themselves accepted (a property that only
    ever sees errors would prove nothing)."""
    tmp = _scratch()
    (tmp / "c.yaml").write_text(COEFFS)
    rows = [trace_row(request_id=i, arrival_time_us=10**6 * (i + 1)) for i in range(2)]
    tmp2, argv, inputs = _replay_case(rows, TRACE_HEADER, False, None)
    assert _contract(tmp2, argv + ["--coefficients", tmp / "c.yaml"], inputs) == 0
