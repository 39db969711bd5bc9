"""observe: the stdout summary, goodput, session block and the Prometheus KV scrape (spec §7,
§8.4; worked examples E13–E16)."""

from __future__ import annotations

import pytest
from observe_helpers import client_for, run

from blis_jax.errors import ConfigError
from blis_jax.observe import kvscrape, summary
from blis_jax.observe.http_request import RequestSpec
from blis_jax.observe.testserver import OpenAITestServer


def row(rid, send, first, last, out=0, status="ok", cls="", session="", rnd=0):
    return {"request_id": rid, "status": status, "send": send, "first": first, "last": last,
            "output_tokens": out, "slo_class": cls, "session_id": session, "round_index": rnd}


def test_e13_metrics_block():
    rows = [row(0, 0, 50_000, 200_000, 100), row(1, 0, 60_000, 210_000, 120)]
    m = summary.metrics_block(rows, 1.0)
    assert m["completed_requests"] == 2
    assert (m["ttft_mean_ms"], m["ttft_p90_ms"], m["ttft_p95_ms"]) == pytest.approx((55, 59, 59.5))
    assert m["ttft_p99_ms"] == pytest.approx(59.9)
    e2e = (m["e2e_mean_ms"], m["e2e_p90_ms"], m["e2e_p95_ms"], m["e2e_p99_ms"])
    assert e2e == pytest.approx((205, 209, 209.5, 209.9))
    assert (m["responses_per_sec"], m["tokens_per_sec"]) == (2, 220)
    assert list(m)[:10] == ["instance_id", "completed_requests", "still_queued", "still_running", "injected_requests",
                            "total_input_tokens", "total_output_tokens", "vllm_estimated_duration_s",
                            "responses_per_sec", "tokens_per_sec"]
    with_itl = summary.metrics_block(rows, 1.0, itl={0: [50_000, 65_000, 83_000]})
    assert (with_itl["itl_mean_ms"], with_itl["itl_p90_ms"]) == pytest.approx((16.5, 17.7))
    assert (with_itl["itl_p95_ms"], with_itl["itl_p99_ms"]) == pytest.approx((17.85, 17.97))
    text = summary.render(summary.metrics_block([row(0, 5, 0, 0, status="error")], 1.0), "")
    assert text.startswith("=== Simulation Metrics ===\n{\n") and '"completed_requests": 0,' in text
    assert '"vllm_estimated_duration_s": 0,' in text and '"timed_out_requests": 0\n}' in text


def test_e14_goodput_denominator_counts_errors_and_timeouts():
    rows = [row(0, 0, 100_000, 1_000_000), row(1, 0, 100_000, 10_000_000), row(2, 5, 0, 0, status="error"),
            row(3, 5, 0, 0, status="timeout"), row(4, 5, 0, 0, status="incomplete")]
    g = summary.goodput_block(rows, {"default": {"e2e_ms": 5000}}, 10.0)
    c = g["per_class"]["default"]
    assert (c["count"], c["slo_attainment"], c["goodput_rps"]) == (4, 0.25, pytest.approx(0.1))
    assert (g["slo_attainment"], g["goodput_rps"]) == (0.25, pytest.approx(0.1))
    assert c["slo_attainment_by_dim"] == {"e2e": 0.5}
    assert list(c) == sorted(c)


def test_slo_flags_and_go_durations():
    assert summary.parse_slo_flag("critical=100ms,standard=1.5s") == {"critical": 100.0, "standard": 1500.0}
    assert summary.parse_go_duration("1m30s") == 90e6 and summary.parse_go_duration("0") == 0
    assert summary.parse_go_duration("1.5h") == 5400e6 and summary.parse_go_duration("250us") == 250
    for text, message in (("a=1ms,,b=2ms", 'empty pair in "a=1ms,,b=2ms"'), ("a", 'invalid pair "a"'),
                          ("=1ms", 'empty class key in pair "=1ms"'),
                          ("a=fast", 'unparseable duration in pair "a=fast"'),
                          ("a=10", 'unparseable duration in pair "a=10"'),
                          ("a=0s", 'non-positive duration in pair "a=0s"')):
        with pytest.raises(ConfigError, match=message):
            summary.parse_slo_flag(text)
    assert summary.merge_targets({"critical": {"ttft_ms": 50, "e2e_ms": 900}, "x": {"ttft_ms": 0}},
                                 {"ttft_ms": {"critical": 100.0}}) == {"critical": {"ttft_ms": 100.0, "e2e_ms": 900}}


def test_e15_session_block():
    rows = [row(0, 1_000_000, 1_010_000, 1_100_000, session="s1"),
            row(1, 1_200_000, 1_205_000, 1_400_000, session="s1", rnd=1)]
    text = summary.session_block(rows)
    assert text.splitlines() == [
        "=== Session Metrics ===", "  Sessions: 1",
        "  TTFT cold (round 0): mean=10.00 p50=10.00 p95=10.00 p99=10.00 ms (n=1)",
        "  TTFT warm (round≥1): mean=5.00 p50=5.00 p95=5.00 p99=5.00 ms (n=1)",
        "  Session duration:    mean=400.00 p50=400.00 p95=400.00 p99=400.00 ms (n=1)"]
    errored = [row(0, 1_000_000, 0, 0, status="error", session="s1"), rows[1]]
    lines = summary.session_block(errored).splitlines()
    assert not any("cold" in line for line in lines) and any("duration" in line for line in lines)
    assert summary.session_block([row(0, 1, 2, 3)]) == ""


def test_e16_prometheus_parsing():
    text = ('# HELP x\nvllm:kv_offload_tiering_block_hits{tier="cpu"} 30\n'
            'vllm:kv_offload_tiering_block_hits{tier="disk"} 12 1712345678\n'
            "vllm:gpu_prefix_cache_hits_total 55\nvllm:gpu_prefix_cache_hits 5\nfoo_created 1.7e9\n"
            "bad_value abc\nnovalue\n")
    fams = kvscrape.parse_prometheus(text)
    assert fams["vllm:kv_offload_tiering_block_hits"] == 42
    assert fams["vllm:gpu_prefix_cache_hits"] == 60 and fams["foo_created"] == 1.7e9
    assert "bad_value" not in fams and "novalue" not in fams


def test_e16_hit_rate_derivation():
    q, h = "vllm:kv_offload_tiering_block_queries", "vllm:kv_offload_tiering_block_hits"
    block = kvscrape.derive_kv_metrics({h: 200, q: 600}, {h: 500, q: 1200}, "pinned-sha")
    assert block == {"source": "tiered", "hit_rate": 0.5, "block_hits": 300, "block_queries": 600,
                     "vllm_commit": "pinned-sha"}
    rt, wt = "vllm:kv_offload_tiering_read_time", "vllm:kv_offload_tiering_write_time"
    block = kvscrape.derive_kv_metrics({h: 1000, q: 2000, rt: 5, wt: 2}, {h: 1734, q: 3000, rt: 17.5, wt: 5.25})
    assert (block["hit_rate"], block["read_time_total"], block["write_time_total"]) == (0.734, 12.5, 3.25)
    gh, gq = "vllm:gpu_prefix_cache_hits", "vllm:gpu_prefix_cache_queries"
    assert kvscrape.derive_kv_metrics({gh: 10, gq: 100}, {gh: 60, gq: 200})["hit_rate"] == 0.5
    assert kvscrape.derive_kv_metrics({}, {"vllm:gpu_prefix_cache_hit_rate": 0.42})["hit_rate"] == 0.42
    for start, end in (({q: 5}, {q: 5}), ({h: 0, q: 0}, {h: 10, q: 5}), ({h: 5, q: 10}, {h: 4, q: 20}),
                       ({}, {"other": 1})):
        with pytest.raises(kvscrape.ScrapeError):
            kvscrape.derive_kv_metrics(start, end)


def test_e16_scrape_from_the_test_server_and_a_404():
    async def go():
        async with OpenAITestServer() as server, client_for(server.url) as client:
            before = await kvscrape.scrape(client, server.url + "/metrics")
            text = "alpha " * 64
            for _ in range(2):
                await client.send(RequestSpec(prompt=text, output_len=1))
            after = await kvscrape.scrape(client, server.url + "/metrics")
            try:
                await kvscrape.scrape(client, server.url + "/nothing")
            except kvscrape.ScrapeError as e:
                missing = str(e)
            return kvscrape.derive_kv_metrics(before, after), missing
    block, missing = run(go())
    assert block["source"] == "gpu-prefix-cache-fallback" and block["hit_rate"] == 0.5  # second prompt hits fully
    assert "HTTP 404" in missing


def test_itl_path_default():
    from blis_jax.observe.records import itl_path

    assert itl_path("out/trace.csv", None) == "out/trace.itl.csv"
    assert itl_path("trace.data", None) == "trace.data.itl.csv"
    assert itl_path("t.csv", "x.csv") == "x.csv"
