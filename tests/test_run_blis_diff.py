"""`blis-jax run` with each blis-diff case's `generation_args` against BLIS's generating run.

For a case whose replay reproduces its generating run (`replay_matches_generating_run`), the
case's `stdout.txt` is what BLIS's `run` printed: ours must equal it byte for byte, and the
`trace.yaml` / `trace.csv` we write with `--trace-output` must equal the case's, every column
(the generation columns and the outcome columns the simulation fills: chunk times, status).
C06 (closed-loop multi-turn) is the exception: its `stdout.txt` is the replay's of the flattened
trace, not the generating run's; its `trace.csv` is the generating run's, follow-up rounds
included, and the generating run's figures are derived from it (and from the case notes).

Every case is a full simulation (~10-30 s each on 2 cores, most of it compilation), so the set is
`slow`. The cases test_cli.py replays run there, each in its replay's test, right after the
replay, whose compiled program it reuses (A01 in the default suite); here, every other case
(`run_in_test_cli`).
Cases that need features not built yet are strict xfails (blis_diff.case_param).
"""

from __future__ import annotations

import csv
import io
import json
import re
from functools import cache

import numpy as np
import pytest

from blis_jax import cli
from blis_diff import STDOUT_GAPS, case_param  # noqa: E402
from shared_data import BLIS_DIFF, needs_blis_diff  # noqa: E402
from test_cli import _cluster_cases, _single_instance_cases, metrics_blocks  # noqa: E402


@cache
def run_in_test_cli() -> frozenset[str]:
    """The cases test_cli.py replays and runs, the run right after the replay, reusing its compiled
    program. Not the strict xfails (their replays fail first), nor a run whose replay is not the
    generating run (C06's closed-loop sessions compile a program of their own): those run here."""
    def replay_is_the_run(cid: str) -> bool:
        case = json.loads((next(BLIS_DIFF.glob(f"{cid}_*")) / "case.json").read_text())
        return case["replay_matches_generating_run"] is not False

    return frozenset(p.id for p in _cluster_cases() + _single_instance_cases()
                     if not p.marks and replay_is_the_run(p.id) and p.id not in STDOUT_GAPS)


def _params():
    """Every case but those run in test_cli.py, and but those whose replay there is a strict xfail
    (a simulation not yet BLIS's: the run would fail for the same reason; their generation is
    test_go_generation.py's). A case fixed there runs there again (run_after_the_replay)."""
    if not BLIS_DIFF.is_dir():
        return []
    replayed = run_in_test_cli()
    known_gaps = {p.id for p in _cluster_cases() + _single_instance_cases() if p.marks}
    out = []
    for path in sorted(p for p in BLIS_DIFF.iterdir() if (p / "case.json").is_file()):
        case = json.loads((path / "case.json").read_text())
        cid = case["id"].split("_")[0]
        if cid not in replayed and cid not in known_gaps:
            out.append(case_param(cid, case, stdout_exact=True))
    return out


def run_case(case_id: str, tmp_path):
    """`blis-jax run` with the case's generation_args (files from the case folder, the trace
    written under tmp_path): (case folder, case.json, stdout)."""
    case_dir = next(BLIS_DIFF.glob(f"{case_id}_*"))
    case = json.loads((case_dir / "case.json").read_text())
    argv = ["run"] + [str(case_dir / a) if (case_dir / a).is_file() else a for a in case["generation_args"]]
    if "defaults" in case.get("config_files", {}):   # BLIS's run read a modified defaults.yaml in place
        argv += ["--defaults-filepath", str(case_dir / "defaults.yaml")]
    argv += ["--log", "info"]   # the autoscaler's drain and placement lines are info
    argv[argv.index("--trace-output") + 1] = str(tmp_path / "trace")
    out, err = io.StringIO(), io.StringIO()
    rc = cli.main(argv, stdout=out, stderr=err)
    assert rc == 0, err.getvalue()
    return case_dir, case, out.getvalue(), err.getvalue()


def assert_run_equals_blis(case_id: str, tmp_path) -> None:
    case_dir, case, stdout, stderr = run_case(case_id, tmp_path)
    assert (tmp_path / "trace.yaml").read_text() == (case_dir / "trace.yaml").read_text()
    assert (tmp_path / "trace.csv").read_text() == (case_dir / "trace.csv").read_text()
    if case.get("command") == "run" and (case_dir / "stderr.txt").is_file():
        assert_log_events_agree(case_dir, stderr, tmp_path / "trace.csv")
    if case["replay_matches_generating_run"] is not False:
        assert stdout == (case_dir / "stdout.txt").read_text()
    else:
        assert_generating_run_figures(case_dir, stdout)


def assert_log_events_agree(case_dir, stderr: str, trace_csv) -> None:
    """A run-only case's events that only BLIS's log shows (stderr.txt, --log info): the
    requests rejected at routing and the instances placed (one per-instance KV line each)
    against our run's warnings and trace."""
    blis = (case_dir / "stderr.txt").read_text()
    rejected = re.findall(r"req (request_\d+): no routable instances", blis)
    ours = re.search(r"(\d+) request\(s\) rejected at routing: .*: (request_\d+), .*?(request_\d+)$", stderr, re.M)
    if not rejected:
        assert ours is None and "rejected at routing" not in stderr
    else:
        assert ours is not None, stderr
        assert (int(ours.group(1)), ours.group(2), ours.group(3)) == (len(rejected), rejected[0], rejected[-1])
        rows = list(csv.DictReader(open(trace_csv)))
        unserved = [f"request_{r['request_id']}" for r in rows if r["status"] == "incomplete"
                    and r["first_chunk_time_us"] == "0"]
        assert unserved == rejected
    # the autoscaler's lines, in order and word for word (ours add the simulated time)
    scaling = re.compile(r"^\[(analyzer|actuator|autoscaler)\] ")
    theirs = [m.replace('\\"', '"') for m in re.findall(r'msg="(.*)"$', blis, re.M)]
    theirs = [m for m in theirs if scaling.match(m)]
    mine = [re.sub(r" \(at \d+\.\d{6} s\)$", "", line.split(": ", 2)[2]) for line in stderr.splitlines()
            if line.count(": ") >= 2 and scaling.match(line.split(": ", 2)[2])]
    assert mine == theirs
    case = json.loads((case_dir / "case.json").read_text())
    if "per_instance_total_kv_blocks" not in case:   # no node pools
        return
    placed = len(re.findall(r"per-instance KV auto-calc for GPU", blis))
    assert placed == len(case["per_instance_total_kv_blocks"])
    pending = [f"instance_{i}" for i in range(placed, case["num_instances"])]
    if pending:
        assert f"{', '.join(pending)}: no Ready node has" in stderr
    else:
        assert "no Ready node has" not in stderr


def assert_generating_run_figures(case_dir, stdout: str) -> None:
    """A closed-loop case: the run's cluster block against the figures its trace.csv records
    (chunk times are the generating run's) and the notes' totals of the generating run."""
    rows = list(csv.DictReader((case_dir / "trace.csv").open()))
    block = metrics_blocks(stdout)[-1]
    ok = [r for r in rows if r["status"] == "ok"]
    assert block["completed_requests"] == len(ok) == block["injected_requests"]
    assert block["total_input_tokens"] == sum(int(r["prefix_length"]) + int(r["input_tokens"]) for r in rows)
    assert block["total_output_tokens"] == sum(int(r["output_tokens"]) for r in ok)
    ttft = np.array([int(r["first_chunk_time_us"]) - int(r["arrival_time_us"]) for r in ok], np.int64)
    assert block["ttft_mean_ms"] == pytest.approx(ttft.mean() / 1000, rel=1e-12)
    assert block["ttft_p99_ms"] == pytest.approx(np.percentile(ttft, 99) / 1000, rel=1e-12)
    notes = " ".join(json.loads((case_dir / "case.json").read_text())["notes"])
    # "cache_hit_rate there 0.3173, ...; total_input_tokens there 363600"
    there = notes.split("cache_hit_rate there ")[1]
    assert f"Cache Hit Rate: {there[:6]}" in stdout
    assert block["total_input_tokens"] == int(notes.split("total_input_tokens there ")[1].split(",")[0])


@needs_blis_diff
@pytest.mark.slow
@pytest.mark.parametrize("case_id", _params())
def test_run_with_generation_args_equals_blis_run(case_id, tmp_path):
    assert_run_equals_blis(case_id, tmp_path)
