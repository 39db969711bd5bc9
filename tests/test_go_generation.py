"""`blis-jax run`'s generator against BLIS's generated traces (blis-rng.md §15).

For every blis-diff case, the case's `generation_args` go through `run`'s flag parser and
workload resolution (generation only, no simulation), and the request records we would write
with `--trace-output` are compared with the case's `trace.csv` column by column: every column
generation fixes. Closed-loop follow-ups (C06) are created by the simulation, so only the rows
BLIS generated up front (round 0) are compared here.
"""

from __future__ import annotations

import csv
import io
import json
import os

import pytest

from blis_jax import cli
from blis_jax.cli.app import Diagnostics, resolve_command
from blis_jax.workload.tracev2 import format_records
from shared_data import BLIS_DIFF, needs_blis_diff  # noqa: E402

GENERATED_COLUMNS = ("request_id", "client_id", "tenant_id", "slo_class", "session_id", "round_index",
                     "prefix_group", "prefix_length", "streaming", "input_tokens", "output_tokens",
                     "text_tokens", "image_tokens", "audio_tokens", "video_tokens", "reason_ratio", "model",
                     "deadline_us", "arrival_time_us", "send_time_us")


# PD pool flags of shared-pool cases (H01, H02, H04) that blis-jax's PD does not accept yet.
_CLUSTER_ONLY_FLAGS = {"--prefill-decode-instances", "--prefill-instances", "--decode-instances", "--pd-decider",
                       "--pd-prefix-threshold", "--prefill-routing-scorers", "--decode-routing-scorers",
                       "--prefill-latency-model", "--decode-latency-model", "--prefill-tp"}


def _cases():
    if not BLIS_DIFF.exists():
        return []
    return sorted(p.name for p in BLIS_DIFF.iterdir() if (p / "case.json").exists())


def generated_records(case_dir) -> list[dict]:
    case = json.loads((case_dir / "case.json").read_text())
    argv = ["run"]
    gen = list(case["generation_args"])
    k = 0
    while k < len(gen):
        a = gen[k]
        if a in _CLUSTER_ONLY_FLAGS:       # cluster shape only: generation does not read them
            k += 2
            continue
        argv.append(str(case_dir / a) if (case_dir / a).is_file() and a.endswith((".yaml", ".json")) else a)
        k += 1
    if "defaults" in case.get("config_files", {}):   # BLIS's run read a modified defaults.yaml in place
        argv += ["--defaults-filepath", str(case_dir / "defaults.yaml")]
    # Flags of features blis-jax lacks (node pools, LoRA, offload, ...) do not touch generation.
    args, _unsupported = cli.build_parser().parse_known_args(argv)
    resolved = resolve_command(args, Diagnostics(io.StringIO()))
    requests, sessions = resolved.requests, resolved.sessions
    if sessions is not None:
        static = ~sessions.follow_up
        requests = _take(requests, static)
    return list(csv.DictReader(io.StringIO(format_records(requests))))


def _take(requests, mask):
    import numpy as np

    from blis_jax.workload.requests import make_request_set
    rows = np.flatnonzero(mask)
    return make_request_set(
        request_id=requests.request_id[rows], arrival_us=requests.arrival_us[rows],
        input_len=requests.input_len[rows], output_len=requests.output_len[rows],
        deadline_us=requests.deadline_us[rows],
        prefix_group=[requests.prefix_group_names[g] if g >= 0 else "" for g in requests.prefix_group[rows]],
        prefix_len=requests.prefix_len[rows], slo_class=requests.slo_class[rows],
        tenant_id=requests.tenant_id[rows], client_id=requests.client_id[rows],
        session_id=requests.session_id[rows], round_index=requests.round_index[rows], model=requests.model[rows],
        trace_columns={k: v[rows] for k, v in requests.trace_columns.items()})


def reference_records(case_dir, round0_only: bool) -> list[dict]:
    rows = list(csv.DictReader((case_dir / "trace.csv").open()))
    if round0_only:
        rows = [r for r in rows if not r["session_id"] or r["round_index"] == "0"]
        for k, r in enumerate(rows):
            r["request_id"] = str(k)
    return rows


def compare(case_id: str) -> list[str]:
    case_dir = BLIS_DIFF / case_id
    ours = generated_records(case_dir)
    multi_turn = "C06" in case_id
    ref = reference_records(case_dir, multi_turn)
    problems = []
    if len(ours) != len(ref):
        problems.append(f"{len(ours)} rows, BLIS {len(ref)}")
    for k, (a, b) in enumerate(zip(ours, ref)):
        for col in GENERATED_COLUMNS:
            if a.get(col, "") != b.get(col, ""):
                problems.append(f"row {k} {col}: {a.get(col)!r} != BLIS {b.get(col)!r}")
                break
        if len(problems) > 5:
            break
    return problems


@needs_blis_diff
@pytest.mark.parametrize("case_id", _cases())
def test_generated_trace_equals_blis(case_id):
    assert compare(case_id) == []


if __name__ == "__main__":
    for c in _cases():
        try:
            p = compare(c)
        except Exception as e:  # noqa: BLE001 - a survey script
            p = [f"{type(e).__name__}: {e}"]
        print(c, "OK" if not p else p[:3], flush=True)


TRACE_COLUMNS_C06 = (*GENERATED_COLUMNS, "first_chunk_time_us", "last_chunk_time_us", "status")


@needs_blis_diff
@pytest.mark.slow  # a full closed-loop simulation (Scout, TP 2)
def test_c06_run_writes_blis_trace_with_its_follow_ups(tmp_path):
    """`blis-jax run` with C06's generation arguments: all 600 rows of BLIS's trace.csv, the 580
    follow-ups the simulation creates included (their arrivals, lengths, labels, chunk times)."""
    case_dir = BLIS_DIFF / next(c for c in _cases() if c.startswith("C06"))
    case = json.loads((case_dir / "case.json").read_text())
    argv = ["run"] + [str(case_dir / a) if a == "workload.yaml" else a for a in case["generation_args"]]
    argv[argv.index("--trace-output") + 1] = str(tmp_path / "trace")
    assert cli.main(argv, stdout=io.StringIO(), stderr=io.StringIO()) == 0
    ours = list(csv.DictReader((tmp_path / "trace.csv").open()))
    ref = list(csv.DictReader((case_dir / "trace.csv").open()))
    assert len(ours) == len(ref) == 600
    key = lambda r: (r["session_id"], int(r["round_index"]))  # noqa: E731 - row order within a tick may differ
    mine = {key(r): r for r in ours}
    for r in ref:
        o = mine[key(r)]
        for col in TRACE_COLUMNS_C06:
            if col != "request_id":
                assert o[col] == r[col], (key(r), col, o[col], r[col])


def test_spec_seed_wins_unless_seed_is_given(tmp_path):
    """BLIS: a workload spec's `seed` is the workload seed unless `--seed` is given (blis-rng §4.1)."""
    spec = tmp_path / "w.yaml"
    spec.write_text("version: '2'\nseed: 7\naggregate_rate: 10\nnum_requests: 5\nclients:\n"
                    "  - {id: c, rate_fraction: 1, arrival: {process: poisson},\n"
                    "     input_distribution: {type: exponential, params: {mean: 100}},\n"
                    "     output_distribution: {type: exponential, params: {mean: 50}}}\n")

    def arrivals(*flags):
        args = cli.build_parser().parse_args(["run", "--model", "meta-llama/Llama-3.1-8B-Instruct",
                                              "--workload-spec", str(spec), *flags])
        return resolve_command(args, Diagnostics(io.StringIO())).requests.arrival_us.tolist()

    assert arrivals() == arrivals("--seed", "7") != arrivals("--seed", "42")
