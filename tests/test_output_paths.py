"""The output-path rule (io_safety.check_command_paths): no output of a command may be, or
overwrite, one of its inputs or another of its outputs (resolved paths: `./x`, symlinks and
hard links count), the trace prefix's .yaml / .csv included; every case leaves each input file
byte-for-byte as it was. Outputs are written atomically."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from blis_jax.io_safety import atomic_write_text

from robust_helpers import (
    COEFFS,
    GRID,
    SPEC,
    assert_one_error_line,
    assert_unchanged,
    cli,
    snapshot,
    write_trace_files,
)


@pytest.fixture
def files(tmp_path):
    header, data = write_trace_files(tmp_path)
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    coeffs = tmp_path / "coeffs.yaml"
    coeffs.write_text(COEFFS)
    grid = tmp_path / "grid.yaml"
    grid.write_text(GRID)
    results = tmp_path / "results.json"
    results.write_text("[]\n")
    observed = tmp_path / "observed.json"
    observed.write_text("{}\n")
    (tmp_path / "link.csv").symlink_to(data)
    os.link(spec, tmp_path / "hard.yaml")
    return dict(tmp=tmp_path, header=header, data=data, spec=spec, coeffs=coeffs, grid=grid,
                results=results, observed=observed)


def _replay(f, *extra):
    return ("replay", "--trace-header", f["header"], "--trace-data", f["data"], *extra)


CASES = {
    # (argv builder, words the error line must contain)
    "replay results onto its trace data": (lambda f: _replay(f, "--results-path", f["data"]),
                                           ("--results-path", "--trace-data")),
    "replay metrics onto its trace header": (lambda f: _replay(f, "--metrics-path", f["header"]),
                                             ("--metrics-path", "--trace-header")),
    "replay trace-output onto its own trace": (lambda f: _replay(f, "--trace-output", f["tmp"] / "t"),
                                              ("--trace-output",)),
    "replay results onto a symlink to its data": (lambda f: _replay(f, "--results-path", f["tmp"] / "link.csv"),
                                                  ("--results-path", "--trace-data")),
    "replay results via ./ onto its data": (lambda f: _replay(f, "--results-path", f"{f['tmp']}/./t.csv"),
                                            ("--results-path",)),
    "replay results onto the coefficient file": (
        lambda f: _replay(f, "--coefficients", f["coeffs"], "--results-path", f["coeffs"]),
        ("--results-path", "--coefficients")),
    "metrics and results naming the same file": (
        lambda f: _replay(f, "--metrics-path", f["tmp"] / "m.json", "--results-path", f["tmp"] / "m.json"),
        ("--metrics-path", "--results-path")),
    "trace-output csv onto the results file": (
        lambda f: _replay(f, "--results-path", f["tmp"] / "o.csv", "--trace-output", f["tmp"] / "o"),
        ("--trace-output", "--results-path")),
    "run trace-output onto the workload spec": (
        lambda f: ("run", "--workload-spec", f["spec"], "--trace-output", f["tmp"] / "spec"),
        ("--trace-output", "--workload-spec")),
    "run metrics onto a hard link of the spec": (
        lambda f: ("run", "--workload-spec", f["spec"], "--metrics-path", f["tmp"] / "hard.yaml"),
        ("--metrics-path", "--workload-spec")),
    "convert output onto its own input": (
        lambda f: ("convert", "inference-perf", "--spec", f["spec"], "--output", f["spec"]),
        ("--output", "--spec")),
    "compose output onto one of its inputs": (
        lambda f: ("compose", "--from", f["spec"], "--from", f["spec"], "--output", f["spec"]),
        ("--output", "--from")),
    "calibrate report onto sim-results": (
        lambda f: ("calibrate", "--trace-header", f["header"], "--trace-data", f["data"], "--sim-results",
                   f["results"], "--report", f["results"]),
        ("--report", "--sim-results")),
    "calibrate report onto the trace data": (
        lambda f: ("calibrate", "--trace-header", f["header"], "--trace-data", f["data"], "--sim-results",
                   f["results"], "--report", f["data"]),
        ("--report", "--trace-data")),
    "fit output onto its start": (
        lambda f: ("fit", "--observed", f["observed"], "--start", f["coeffs"], "--output", f["coeffs"]),
        ("--output", "--start")),
    "fit output onto the observed file": (
        lambda f: ("fit", "--observed", f["observed"], "--output", f["observed"]),
        ("--output", "--observed")),
    "sensitivity output onto its spec": (
        lambda f: ("sensitivity", "--workload-spec", f["spec"], "--output", f["spec"]),
        ("--output", "--workload-spec")),
    "sensitivity output and metrics the same": (
        lambda f: ("sensitivity", "--output", f["tmp"] / "s.json", "--metrics-path", f["tmp"] / "s.json"),
        ("--output", "--metrics-path")),
    "sweep output-dir table onto the grid": (
        lambda f: (f["tmp"] / "table.csv").write_text(GRID) and
        ("sweep", f["tmp"] / "table.csv", "--output-dir", f["tmp"]),
        ("--output-dir", "GRID.yaml")),
    "observe trace header onto its workload spec": (
        lambda f: ("observe", "--server-url", "http://127.0.0.1:9", "--model", "m", "--workload-spec", f["spec"],
                   "--trace-header", f["spec"], "--trace-data", f["tmp"] / "o.csv"),
        ("--trace-header", "--workload-spec")),
    "observe ITL file onto its trace data": (
        lambda f: ("observe", "--server-url", "http://127.0.0.1:9", "--model", "m", "--rate", "1",
                   "--trace-header", f["tmp"] / "o.yaml", "--trace-data", f["data"], "--record-itl",
                   "--itl-output", f["data"]),
        ("--itl-output", "--trace-data")),
    "plan output-dir onto the grid": (
        lambda f: (f["tmp"] / "plan.json").write_text(GRID) and
        ("plan", f["tmp"] / "plan.json", "--slo", "ttft_p99_ms=100", "--output-dir", f["tmp"]),
        ("--output-dir", "GRID.yaml")),
    "output into a missing directory": (lambda f: _replay(f, "--results-path", f["tmp"] / "no" / "r.json"),
                                        ("--results-path", "does not exist")),
    "output is a directory": (lambda f: _replay(f, "--results-path", f["tmp"]), ("is a directory",)),
    "empty output path": (lambda f: _replay(f, "--metrics-path", ""), ("--metrics-path", "empty")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_no_output_overwrites_an_input_or_another_output(files, case):
    build, words = CASES[case]
    argv = build(files)
    inputs = [p for p in files["tmp"].iterdir() if p.is_file()]
    before = snapshot(*inputs)
    rc, out, err = cli(*argv)
    assert_one_error_line(rc, err, *words)
    assert out == ""
    assert_unchanged(before)
    assert sorted(p for p in files["tmp"].iterdir() if p.is_file()) == sorted(before)  # nothing new written


@pytest.mark.skipif(os.geteuid() == 0, reason="as root, file permissions do not stop a write, so no unwritable output path can be set up")
def test_unwritable_output_directory_is_refused_before_simulating(files):
    locked = files["tmp"] / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        rc, out, err = cli(*_replay(files, "--results-path", locked / "r.json"))
    finally:
        locked.chmod(0o700)
    assert_one_error_line(rc, err, "--results-path", "not writable")
    assert out == ""  # refused before the simulation printed its metrics


def test_atomic_write_replaces_whole_file_or_leaves_it(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("good\n")
    atomic_write_text(target, "new\n")
    assert target.read_text() == "new\n"

    class Boom(Exception):
        pass

    from blis_jax.io_safety import atomic_output

    with pytest.raises(Boom):
        with atomic_output(target, "w") as f:
            f.write("half")
            raise Boom
    assert target.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]  # no temporary left behind


@pytest.mark.slow  # 17 s of simulation: the default suite's time budget
def test_distinct_outputs_are_written(files, tmp_path):
    """The rule does not refuse a legitimate command: every output lands, inputs unchanged."""
    before = snapshot(files["header"], files["data"])
    rc, out, err = cli(*_replay(files, "--results-path", tmp_path / "r.json", "--metrics-path",
                                tmp_path / "m.json", "--trace-output", tmp_path / "o", "--total-kv-blocks", "4096",
                                "--horizon", "100000000"))
    assert rc == 0, err
    for name in ("r.json", "m.json", "o.yaml", "o.csv"):
        assert (tmp_path / name).stat().st_size > 0
    assert_unchanged(before)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_atomic_write_follows_symlinks_and_writes_devices_directly(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old\n")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    atomic_write_text(link, "new\n")
    assert link.is_symlink() and target.read_text() == "new\n"
    atomic_write_text("/dev/null", "discarded\n")  # a device is not replaced by a regular file
    assert not Path("/dev/null").is_file()
