"""PD disaggregation (blis-features §3.10): pools, deciders, KV transfer duration (checked
against BLIS's reported transfer durations in E05 / E07)."""

from __future__ import annotations

import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from shared_data import needs_blis_diff

from blis_jax.cluster import pd
from blis_jax.errors import ConfigError

LLAMA8B_KV_BYTES = 2 * 32 * 8 * 128 * 2  # K+V x layers x kv heads x head dim x bf16 = 131072


@pytest.fixture(autouse=True)
def _strict_dtypes():
    # Implicit dtype promotion inside the cluster code would be a silent int/float mix-up.
    with jax.numpy_dtype_promotion("strict"):
        yield


def i64(v):
    return jnp.asarray(v, jnp.int64)


def test_pool_masks_by_index():
    pf, dc, en = pd.pool_masks(8, prefill=2, decode=1, shared=2, encode=1, num_instances=7)
    # slots 0-1 prefill, 2 decode, 3-4 shared (both roles), 5 encode, 6 unassigned, 7 padding
    assert np.asarray(pf).tolist() == [1, 1, 0, 1, 1, 0, 0, 0]
    assert np.asarray(dc).tolist() == [0, 0, 1, 1, 1, 0, 0, 0]
    assert np.asarray(en).tolist() == [0, 0, 0, 0, 0, 1, 0, 0]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"prefill": 3, "decode": 2}, "sum to 5 but --num-instances is 4"),
        ({"prefill": -1}, "--prefill-instances"),
        ({"shared": 1.0}, "--prefill-decode-instances"),
    ],
)
def test_pool_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        pd.pool_masks(4, **kwargs)


def test_deciders():
    never, always = pd.make_pd_config("never"), pd.make_pd_config("always")
    assert not bool(pd.disaggregate(never, i64(10_000), i64(0), 16))
    assert bool(pd.disaggregate(always, i64(1), i64(1), 16))
    thr = pd.make_pd_config("prefix-threshold", prefix_threshold=16)
    # non-cached = input - cached_blocks * block_size; disaggregate iff > 16.
    assert bool(pd.disaggregate(thr, i64(100), i64(5), 16))  # 100 - 80 = 20
    assert not bool(pd.disaggregate(thr, i64(96), i64(5), 16))  # 96 - 80 = 16, not > 16
    assert not bool(pd.disaggregate(thr, i64(64), i64(5), 16))  # fully cached: negative
    assert bool(pd.disaggregate(thr, i64(17), i64(0), 16))


def test_bad_pd_flags():
    for kwargs, flag in (
        ({"decider": "sometimes"}, "--pd-decider"),
        ({"prefix_threshold": -1}, "--pd-prefix-threshold"),
        ({"transfer_bandwidth_gbps": 0}, "--pd-transfer-bandwidth"),
        ({"transfer_base_latency_ms": -0.1}, "--pd-transfer-base-latency"),
        ({"transfer_bandwidth_gbps": float("inf")}, "--pd-transfer-bandwidth"),
    ):
        with pytest.raises(ConfigError, match=flag):
            pd.make_pd_config(**kwargs)


def test_transfer_time_by_hand():
    cfg = pd.make_pd_config("always")  # 25 GB/s = 25,000 bytes/µs, base 0.05 ms = 50 µs
    # 512 tokens = 32 blocks: 50 + 512 * 131072 / 25000 = 2734.35... -> 2735 µs.
    assert int(pd.transfer_time_us(cfg, i64(512), 16, LLAMA8B_KV_BYTES)) == 2735
    # 513 tokens round up to 33 blocks = 528 tokens: 50 + 528 * 131072 / 25000 = 2818.24 -> 2819.
    assert int(pd.transfer_blocks(i64(513), 16)) == 33
    assert int(pd.transfer_time_us(cfg, i64(513), 16, LLAMA8B_KV_BYTES)) == 2819
    # Integral total: 50 + 25 * 16 * 1000 / 25000 = 66 exactly (ceil keeps it).
    assert int(pd.transfer_time_us(cfg, i64(400), 16, 1000.0)) == 66


def test_transfer_time_floor_and_contention():
    zero = pd.make_pd_config("always", transfer_base_latency_ms=0.0)
    assert int(pd.transfer_time_us(zero, i64(0), 16, LLAMA8B_KV_BYTES)) == 1  # at least 1 µs
    shared = pd.make_pd_config("always", transfer_base_latency_ms=0.0, contention=True)
    # 16 tokens * 1000 B = 16,000 B at 25,000 B/µs = 0.64 µs -> 1; with 4 transfers 2.56 -> 3.
    assert int(pd.transfer_time_us(shared, i64(16), 16, 1000.0, i64(1))) == 1
    assert int(pd.transfer_time_us(shared, i64(16), 16, 1000.0, i64(4))) == 3
    # Without contention the active count is ignored.
    assert int(pd.transfer_time_us(zero, i64(16), 16, 1000.0, i64(4))) == 1


def test_vmap_over_requests_matches_python_and_jit():
    cfg = pd.make_pd_config("always", transfer_bandwidth_gbps=7.3, transfer_base_latency_ms=0.031)
    lens = np.random.default_rng(0).integers(1, 20_000, 2_000)
    fn = jax.jit(jax.vmap(lambda n: pd.transfer_time_us(cfg, n, 16, 57344.0)))
    got = np.asarray(fn(jnp.asarray(lens)))
    # Reference in Python floats (Go's float64 operations, one rounding each).
    expected = [max(1, math.ceil(0.031 * 1000 + float(-(-n // 16) * 16) * 57344.0 / (7.3 * 1000))) for n in lens]
    assert got.tolist() == expected
    eager = [int(pd.transfer_time_us(cfg, i64(n), 16, 57344.0)) for n in lens[:20]]
    assert eager == expected[:20]


def test_no_retrace_when_numbers_change():
    @jax.jit
    @chex.assert_max_traces(n=1)
    def run(cfg, n):
        return pd.transfer_time_us(cfg, n, 16, 1000.0), pd.disaggregate(cfg, n, i64(1), 16)

    run(pd.make_pd_config("prefix-threshold"), i64(100))
    run(pd.make_pd_config("prefix-threshold", prefix_threshold=3, transfer_bandwidth_gbps=1.0), i64(7))


@needs_blis_diff
@pytest.mark.parametrize("case_id", ["E05", "E07"])
def test_blis_diff_transfer_durations(case_id):
    # With decider `always` every request is transferred once; BLIS's PD section reports the
    # mean and percentiles of the per-request transfer durations, which follow from the
    # prompt lengths, the prefill pool's KV bytes per token and the default 25 GB/s / 0.05 ms.
    from blis_diff import load_case

    from blis_jax.config.kv_capacity import kv_bytes_per_token
    from blis_jax.config.model import load_model

    case = load_case(case_id)
    assert case["other_flags"]["pd_decider"] == "always"
    cfg = pd.make_pd_config("always")
    kv_bytes = kv_bytes_per_token(load_model(case["model"]), case["tp"])
    lens = jnp.asarray([r.input_len for r in case.requests], jnp.int64)
    durations = np.asarray(jax.jit(jax.vmap(lambda n: pd.transfer_time_us(cfg, n, case["block_size"], kv_bytes)))(lens))
    stdout = (case.path / "stdout.txt").read_text()
    m = re.search(r"Disaggregated Requests: (\d+)", stdout)
    assert int(m.group(1)) == len(durations)
    m = re.search(r"KV Transfer Duration \(us\): mean=([\d.]+) p50=([\d.]+) p95=([\d.]+) p99=([\d.]+)", stdout)
    mean, p50, p95, p99 = (float(x) for x in m.groups())
    # BLIS prints one decimal; percentiles interpolate linearly at rank p/100 (n-1).
    assert round(float(durations.mean()), 1) == mean
    for p, want in ((50, p50), (95, p95), (99, p99)):
        assert round(float(np.percentile(durations, p)), 1) == want
