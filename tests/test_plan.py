"""`blis-jax plan`: the answer checks out against separate `blis-jax run`s of the chosen
candidate and of the next one; SLO / candidate parsing; the answer rule on hand-made tables.

The engine runs share test_sweep.py's program shapes (8 vmapped lanes; 24 requests,
max-num-seqs <= 8, 600 KV blocks): with max-num-seqs 4 these scenarios saturate between 12 and
16 req/s, where p99 TTFT jumps from ~30 ms to >100 ms. The num-instances plan shares
test_sweep.py's cluster programs (128 requests; 4 instance slots, and 2 for the check run).
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import yaml

from blis_jax.cli import main
from blis_jax.errors import ConfigError
from blis_jax.sweep.plan import (
    Answer,
    describe,
    evaluate,
    parse_candidates,
    parse_search,
    parse_slo,
)
from blis_jax.sweep.table import METRICS, SweepTable

BASE = {"num-requests": 24, "total-kv-blocks": 600, "max-num-seqs": 4, "max-num-batched-tokens": 512,
        "prompt-tokens": 150, "prompt-tokens-max": 300, "output-tokens": 30, "output-tokens-max": 60}
RATES = [4, 8, 12, 16, 20, 24, 32, 48]
SLO_TTFT_MS = 80.0


def cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = main([str(a) for a in argv], stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def run_metrics(tmp_path: Path, settings: dict) -> dict:
    path = tmp_path / "metrics.json"
    rc, _, err = cli("run", *[f"--{k}={v}" for k, v in settings.items()], "--metrics-path", path)
    assert rc == 0, err
    return json.loads(path.read_text())


def meets(m: dict) -> bool:
    return m["ttft_p99_ms"] <= SLO_TTFT_MS and m["completed_requests"] == m["injected_requests"]


@pytest.mark.slow  # two extra runs per answer; `pytest -m slow`
def test_largest_rate_checks_out(tmp_path):
    grid = tmp_path / "plan.yaml"
    grid.write_text(yaml.safe_dump({"base": BASE, "axes": {"rate": RATES}}))
    rc, out, err = cli("plan", grid, "--slo", f"ttft_p99_ms={SLO_TTFT_MS:g}", "--output-dir", tmp_path / "o",
                       "--max-batch", 8)
    assert rc == 0, err
    (answer,) = re.findall(r"^rate = (\S+): the largest candidate meeting ttft_p99_ms<=80", out, re.MULTILINE)
    chosen = float(answer)
    # an interior answer, so that both checks below mean something
    assert RATES[0] < chosen < RATES[-1], out
    nxt = RATES[RATES.index(chosen) + 1]
    assert f"next candidate {nxt} fails: ttft_p99_ms=" in out
    assert meets(run_metrics(tmp_path, {**BASE, "rate": chosen}))
    assert not meets(run_metrics(tmp_path, {**BASE, "rate": nxt}))
    # the table behind it: every smaller candidate passes too
    rows = json.loads((tmp_path / "o" / "plan.json").read_text())["rows"]
    assert [r["meets_slo"] for r in rows] == [rate <= chosen for rate in RATES]


@pytest.mark.slow  # three compiled programs (the plan's cluster grid and two check runs)
def test_smallest_instance_count_checks_out(tmp_path):
    """`plan --search num-instances` (default: smallest): at 30 req/s one and two instances
    miss the p99 TTFT target and four meet it; separate runs agree."""
    settings = {**BASE, "num-requests": 128, "rate": 30}
    grid = tmp_path / "base.yaml"
    grid.write_text(yaml.safe_dump({"base": settings}))
    rc, out, err = cli("plan", grid, "--slo", f"ttft_p99_ms={SLO_TTFT_MS:g}", "--search", "num-instances",
                       "--candidates", "1,2,4", "--output-dir", tmp_path / "o")
    assert rc == 0, err
    (answer,) = re.findall(r"^num-instances = (\d+): the smallest candidate meeting ttft_p99_ms<=80", out,
                           re.MULTILINE)
    chosen = int(answer)
    assert chosen > 1, out
    smaller = {2: 1, 4: 2}[chosen]
    assert f"next candidate {smaller} fails: ttft_p99_ms=" in out
    assert meets(run_metrics(tmp_path, {**settings, "num-instances": chosen}))
    assert not meets(run_metrics(tmp_path, {**settings, "num-instances": smaller}))
    rows = json.loads((tmp_path / "o" / "plan.json").read_text())["rows"]
    assert [(r["num-instances"], r["meets_slo"]) for r in rows] == [(n, n >= chosen) for n in (1, 2, 4)]


@pytest.mark.slow  # 30 s: the default suite's time budget (the other plan tests cover the search)
def test_smallest_batch_limit_with_candidates_flag(tmp_path):
    """Search down (min) over an axis the grid does not have (--candidates): the smallest
    max-num-seqs that keeps p99 TTFT within the target at 20 req/s."""
    settings = {k: v for k, v in BASE.items() if k != "max-num-seqs"} | {"rate": 20}
    grid = tmp_path / "base.yaml"
    grid.write_text(yaml.safe_dump({"base": settings}))  # no axes: the base scenario alone
    rc, out, err = cli("plan", grid, "--slo", f"ttft_p99_ms<={SLO_TTFT_MS:g}", "--search", "max-num-seqs:min",
                       "--candidates", "1:8:8", "--max-batch", 8)
    assert rc == 0, err
    (answer,) = re.findall(r"^max-num-seqs = (\d+): the smallest candidate meeting", out, re.MULTILINE)
    chosen = int(answer)
    assert 1 < chosen <= 8, out
    assert meets(run_metrics(tmp_path, {**settings, "max-num-seqs": chosen}))
    assert not meets(run_metrics(tmp_path, {**settings, "max-num-seqs": chosen - 1}))


# ------------------------------------------------------------------------ parsing, rules


def test_parse_slo():
    assert [str(t) for t in parse_slo("ttft_p99_ms=200, itl_p99_ms<=50,responses_per_sec=8")] == [
        "ttft_p99_ms<=200", "itl_p99_ms<=50", "responses_per_sec>=8"]  # '=' means "at least" for throughputs
    assert str(parse_slo("e2e_mean_ms>=1.5")[0]) == "e2e_mean_ms>=1.5"
    for text, fragment in (("ttft_p99=200", "did you mean ttft_p99_ms"), ("ttft_p99_ms", "METRIC=VALUE"),
                           ("ttft_p99_ms=inf", "finite"), ("", "METRIC=VALUE")):
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            parse_slo(text)


def test_parse_candidates_and_search():
    assert parse_candidates("8,2,4,4") == [2, 4, 8]
    assert parse_candidates("1:2:5") == [1, 1.25, 1.5, 1.75, 2]
    for bad in ("1:1:3", "1:5:1", "a,b", "1:5"):
        with pytest.raises(ConfigError, match="--candidates"):
            parse_candidates(bad)
    assert parse_search("rate") == ("rate", "max")
    assert parse_search("num_instances") == ("num-instances", "min")
    assert parse_search("num-instances:max") == ("num-instances", "max")
    assert parse_search("max-num-seqs:min") == ("max-num-seqs", "min")
    with pytest.raises(ConfigError, match="max-num-seqs:max or max-num-seqs:min"):
        parse_search("max-num-seqs")


def test_bad_instance_candidates_are_one_clear_error(tmp_path):
    grid = tmp_path / "g.yaml"
    grid.write_text(yaml.safe_dump({"base": {"rate": 5}}))
    for candidates, fragment in (("0,1,2", ": 0: the number of instances must be an integer in 1..1024"),
                                 ("1,2.5", "2.5 must be an integer")):
        rc, out, err = cli("plan", grid, "--slo", "ttft_p99_ms=100", "--search", "num-instances",
                           "--candidates", candidates)
        assert rc == 2 and out == "" and err.count("\n") == 1, err
        assert "num-instances" in err and fragment in err, err


def _table(entries) -> SweepTable:
    """Hand-made rows: (rate, ttft_p99_ms, completed, injected, result)."""
    rows = []
    for i, (rate, ttft, completed, injected, result) in enumerate(entries):
        metrics = dict.fromkeys(METRICS, 0.0) | {"ttft_p99_ms": ttft, "completed_requests": completed,
                                                 "injected_requests": injected}
        rows.append({"scenario": i, "rate": rate, "result": result} | metrics)
    return SweepTable(axes=("rate",), rows=tuple(rows))


def test_answer_rule():
    slo = parse_slo("ttft_p99_ms=100")
    # rows out of order; 8 fails, so 16 passing again does not count (noted as not monotone)
    table = _table([(16, 90, 10, 10, "ok"), (2, 50, 10, 10, "ok"), (8, 150, 10, 10, "ok"), (4, 99, 10, 10, "ok")])
    evaluated, (answer,) = evaluate(table, "rate", "max", slo)
    assert (answer.value, answer.next_value, answer.also_passing) == (4, 8, (16,))
    assert answer.failures == ("ttft_p99_ms=150 (needs <=100)",)
    assert [r["meets_slo"] for r in evaluated.rows] == [True, True, False, True]
    # a timed-out request or an engine failure fails a candidate even with good latencies
    table = _table([(2, 50, 10, 10, "ok"), (4, 50, 9, 10, "ok"), (8, 50, 10, 10, "rows_full")])
    _, (answer,) = evaluate(table, "rate", "max", slo)
    assert (answer.value, answer.next_value) == (2, 4) and "only 9 of 10" in answer.failures[0]
    _, (answer,) = evaluate(table, "rate", "max", slo, require_complete=False)
    assert (answer.value, answer.failures) == (4, ("engine result rows_full",))
    # min direction; nothing passes
    _, (answer,) = evaluate(_table([(1, 500, 1, 1, "ok"), (2, 400, 1, 1, "ok")]), "rate", "min", slo)
    assert answer.value is None and answer.next_value == 2


def test_describe_smallest_possible_instance_count():
    slo = parse_slo("ttft_p99_ms=100")
    one = Answer(context={"rate": 8}, value=1, next_value=None, failures=(), also_passing=())
    assert describe(one, "num-instances", "min", slo) == (
        "[rate=8] num-instances = 1: the smallest candidate meeting ttft_p99_ms<=100 (every candidate passes, "
        "and 1 is the smallest possible num-instances)")
    two = Answer(context={}, value=2, next_value=None, failures=(), also_passing=())
    assert "extend the candidates down" in describe(two, "num-instances", "min", slo)
