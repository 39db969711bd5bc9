"""Distribution workload, presets and RequestSet (spec §4.1, §4.2, §4.5, §4.14, §2.8)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from blis_jax.errors import ConfigError
from blis_jax.rng.go_rand import GoRand, go_round
from blis_jax.workload.distribution import (
    OUTPUT_DEFAULT,
    PROMPT_DEFAULT,
    DistributionWorkload,
    GaussianLength,
    arrival_times_us,
    constant_iat_us,
    generate_distribution,
)
from blis_jax.workload.go_samplers import length_sampler
from blis_jax.workload.presets import PRESETS, generate_preset, preset_workload
from blis_jax.workload.requests import RequestSet, make_request_set, slo_priority

from shared_data import BLIS_DIFF  # noqa: E402
from shared_data import needs_blis_diff as needs_reference  # noqa: E402


def _distribution_cases() -> list[Path]:
    if not BLIS_DIFF.is_dir():
        return []
    return [p for p in sorted(BLIS_DIFF.iterdir())
            if (p / "case.json").is_file() and "rate_rps" in json.loads((p / "case.json").read_text())["workload"]]


def _trace_column(case: Path, name: str) -> np.ndarray:
    with open(case / "trace.csv", newline="") as f:
        return np.array([int(row[name]) for row in csv.DictReader(f)], dtype=np.int64)


# ------------------------------------------------------------------------------ arrivals


@needs_reference
def test_a01_arrivals_match_trace_exactly():
    case = BLIS_DIFF / "A01_llama8b_h100_tp1_stable"
    requests = generate_distribution(DistributionWorkload(rate=9, num_requests=600), seed=42)
    np.testing.assert_array_equal(requests.arrival_us, _trace_column(case, "arrival_time_us"))
    np.testing.assert_array_equal(requests.deadline_us, _trace_column(case, "deadline_us"))
    assert requests.arrival_us[:2].tolist() == [111111, 222222]


@needs_reference
@pytest.mark.parametrize("case", _distribution_cases(), ids=lambda p: p.name[:3])
def test_constant_arrivals_match_every_distribution_case(case: Path):
    # IAT = int(1/(rate/1e6)): rate 10 gives 99999 µs, not 100000 (Go's float reciprocal).
    spec = json.loads((case / "case.json").read_text())["workload"]
    expected = _trace_column(case, "arrival_time_us")
    got = arrival_times_us(float(spec["rate_rps"]), int(spec["num_requests"]))
    np.testing.assert_array_equal(got, expected)


@needs_reference
def test_a03_timeout_25s_sets_deadlines():
    case = BLIS_DIFF / "A03_qwen25_7b_a100_overload_timeout"
    requests = generate_distribution(DistributionWorkload(rate=30, num_requests=1000, timeout_s=25), seed=42)
    np.testing.assert_array_equal(requests.deadline_us, _trace_column(case, "deadline_us"))


def test_iat_floor_semantics():
    assert constant_iat_us(9) == 111111
    assert constant_iat_us(10) == 99999
    assert constant_iat_us(200) == 5000
    assert constant_iat_us(1e9) == 1          # at least 1 µs
    assert constant_iat_us(1e-30) == int(1 / 1e-15)  # λ floored at 1e-15 per µs


def test_horizon_bounds_generation():
    # BLIS generates arrivals strictly before the horizon (blis-rng.md §5.3 step 3).
    assert arrival_times_us(9, 600, horizon_us=333334).tolist() == [111111, 222222, 333333]
    assert arrival_times_us(9, 600, horizon_us=333333).tolist() == [111111, 222222]
    assert arrival_times_us(9, 2, horizon_us=10**9).tolist() == [111111, 222222]
    horizon_only = generate_distribution(DistributionWorkload(rate=100, num_requests=0, horizon_us=1_000_000), seed=1)
    assert len(horizon_only) == 99 and horizon_only.arrival_us[-1] == 990_000


# ------------------------------------------------------------------------------- lengths


def _clamped_gaussian_moments(d: GaussianLength) -> tuple[float, float]:
    """Exact mean and std of round(clamp(N(mean, std), min, max)) (ties have measure 0)."""
    def cdf(x: float) -> float:
        return 0.5 * (1 + math.erf((x - d.mean) / (d.std * math.sqrt(2))))
    ks = np.arange(d.min, d.max + 1, dtype=np.float64)
    upper = np.array([cdf(k + 0.5) for k in ks])
    lower = np.array([cdf(k - 0.5) for k in ks])
    lower[0], upper[-1] = 0.0, 1.0   # clamping puts the tails on min and max
    p = upper - lower
    mean = float((p * ks).sum())
    return mean, float(math.sqrt((p * (ks - mean) ** 2).sum()))


def _gaussian_lengths(seed: int, d: GaussianLength, n: int) -> np.ndarray:
    """n lengths from BLIS's Gaussian sampler on one Go stream (blis-rng §3.2)."""
    sampler = length_sampler("gaussian", {"mean": d.mean, "std_dev": d.std, "min": d.min, "max": d.max})
    r = GoRand(seed)
    return np.array([sampler(r) for _ in range(n)], dtype=np.int64)


@pytest.mark.parametrize("dist", [PROMPT_DEFAULT, PRESETS["chatbot"].output], ids=["default", "chatbot-out"])
def test_clamped_gaussian_statistics(dist: GaussianLength):
    n = 10_000
    lengths = _gaussian_lengths(7, dist, n)
    mean, std = _clamped_gaussian_moments(dist)
    assert lengths.min() >= dist.min and lengths.max() <= dist.max
    assert abs(lengths.mean() - mean) < 4 * std / math.sqrt(n)
    assert abs(lengths.std() - std) < 0.03 * std


def test_clamping_creates_point_masses():
    tight = GaussianLength(mean=100, std=1000, min=50, max=150)
    lengths = _gaussian_lengths(3, tight, 2000)
    assert set(np.unique(lengths)) <= set(range(50, 151))
    # |N(0,1)| > 0.05 with probability ≈ 0.96: almost everything lands on a bound.
    assert np.mean((lengths == 50) | (lengths == 150)) > 0.9


def test_go_round_is_half_away_from_zero():
    assert [go_round(x) for x in (2.5, 3.5, -2.5, 0.2, 10.49)] == [3, 4, -3, 0, 10]


def test_same_seed_is_byte_identical_and_seeds_differ():
    w = DistributionWorkload(rate=5, num_requests=500)
    a, b, c = generate_distribution(w, 42), generate_distribution(w, 42), generate_distribution(w, 43)
    for field in ("arrival_us", "input_len", "output_len", "deadline_us"):
        assert getattr(a, field).tobytes() == getattr(b, field).tobytes()
    assert a.input_len.tobytes() != c.input_len.tobytes()
    assert a.output_len.tobytes() != c.output_len.tobytes()
    assert not np.array_equal(a.input_len, a.output_len)  # separate draws per request


def test_request_lengths_do_not_depend_on_request_count():
    short = generate_distribution(DistributionWorkload(rate=5, num_requests=50), 11)
    long = generate_distribution(DistributionWorkload(rate=5, num_requests=1500), 11)  # other size bucket
    np.testing.assert_array_equal(short.input_len, long.input_len[:50])
    np.testing.assert_array_equal(short.output_len, long.output_len[:50])


def test_prefix_tokens_make_shared_group():
    r = generate_distribution(DistributionWorkload(rate=5, num_requests=100, prefix_tokens=64), 42)
    assert r.prefix_group_names == ("shared",)
    assert (r.prefix_group == 0).all() and (r.prefix_len == 64).all()
    assert (r.input_len >= 64 + PROMPT_DEFAULT.min).all()
    plain = generate_distribution(DistributionWorkload(rate=5, num_requests=100), 42)
    # BLIS draws the 64 prefix token IDs from the workload-gen stream before the client seed,
    # so every length changes (blis-rng.md §4.1), while arrivals do not.
    assert (r.input_len - 64 != plain.input_len).any()
    np.testing.assert_array_equal(r.arrival_us, plain.arrival_us)
    assert (plain.prefix_group == -1).all() and (plain.prefix_len == 0).all()


def test_negative_timeout_disables_deadlines():
    r = generate_distribution(DistributionWorkload(rate=5, num_requests=10, timeout_s=-1), 42)
    assert (r.deadline_us == 0).all()
    assert (r.client_id == "distribution").all() and (r.priority == 1).all()


@pytest.mark.parametrize("kwargs, flag", [
    ({"rate": 0}, "--rate"), ({"rate": -3}, "--rate"), ({"rate": float("nan")}, "--rate"),
    ({"rate": float("inf")}, "--rate"), ({"num_requests": -1}, "--num-requests"),
    ({"num_requests": 0}, "--num-requests"), ({"timeout_s": 0}, "--timeout"),
    ({"horizon_us": 0}, "--horizon"), ({"prefix_tokens": -5}, "--prefix-tokens"),
    ({"prompt": GaussianLength(512, 256, 100, 50)}, "--prompt-tokens-min"),
    ({"output": GaussianLength(512, -1, 2, 7000)}, "--output-tokens-stdev"),
    ({"output": GaussianLength(512, 1, 0, 7000)}, "--output-tokens-min"),
    ({"prompt": GaussianLength(float("nan"), 1, 2, 10)}, "--prompt-tokens"),
])
def test_invalid_flags_name_the_flag(kwargs, flag):
    """With the CLI's names installed an error names the flag; without, the field's path."""
    from blis_jax.cli.scenario_flags import FLAG_OF_FIELD
    from blis_jax.naming import naming

    with naming(FLAG_OF_FIELD), pytest.raises(ConfigError, match=flag):
        DistributionWorkload(**kwargs)
    field = {flag_: path for path, flag_ in FLAG_OF_FIELD.items()}[flag.removesuffix("-min").removesuffix("-stdev")]
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        DistributionWorkload(**kwargs)


# ------------------------------------------------------------------------------- presets


def test_preset_figures_follow_spec_table():
    expected = {  # spec §4.2: prompt (mean, std, min, max), output (mean, std, min, max)
        "chatbot": ((256, 100, 2, 800), (256, 100, 1, 1024)),
        "contentgen": ((1024, 150, 10, 2048), (1024, 200, 10, 2048)),
        "summarization": ((4096, 500, 100, 8192), (512, 150, 10, 2048)),
        "multidoc": ((10240, 1200, 500, 20480), (1536, 300, 50, 4096)),
    }
    for name, (prompt, output) in expected.items():
        p = PRESETS[name]
        assert (p.prompt.mean, p.prompt.std, p.prompt.min, p.prompt.max) == prompt
        assert (p.output.mean, p.output.std, p.output.min, p.output.max) == output
        assert p.prefix_tokens == 0


def test_preset_generation_respects_bounds():
    r = generate_preset("summarization", seed=42, rate=2, num_requests=300)
    assert len(r) == 300 and r.arrival_us[0] == 500000
    assert r.input_len.min() >= 100 and r.input_len.max() <= 8192
    assert r.output_len.min() >= 10 and r.output_len.max() <= 2048
    assert preset_workload("chatbot", rate=3).output == PRESETS["chatbot"].output
    assert OUTPUT_DEFAULT == PROMPT_DEFAULT


def test_unknown_preset_lists_choices():
    with pytest.raises(ConfigError, match="chatbot"):
        preset_workload("chat-bot")


# ---------------------------------------------------------------------------- RequestSet


def _make(**overrides) -> RequestSet:
    columns = {"request_id": [0, 1, 2, 3], "arrival_us": [30, 10, 20, 10], "input_len": [100, 200, 300, 400],
               "output_len": [5, 6, 7, 8], "prefix_group": ["", "g2", "g1", "g2"], "prefix_len": [0, 50, 60, 50],
               "slo_class": ["critical", "", "batch", "mystery"]}
    columns.update(overrides)
    return make_request_set(**columns)


def test_make_request_set_sorts_stably_and_derives_fields():
    r = _make()
    assert r.request_id.tolist() == [1, 3, 2, 0]          # stable: 1 before 3 at t=10
    assert r.arrival_us.tolist() == [10, 10, 20, 30]
    assert r.prefix_group_names == ("g2", "g1")           # dense ids in sorted order
    assert r.prefix_group.tolist() == [0, 0, 1, -1]
    assert r.prefix_len.tolist() == [50, 50, 60, 0]
    assert r.priority.tolist() == [1, 1, 5, 0]            # '' and unknown → standard
    assert r.priority.dtype == np.int32 and r.arrival_us.dtype == np.int64
    with pytest.raises(ValueError):
        r.input_len[0] = 1                                 # arrays are read-only


def test_slo_priorities_follow_vllm_convention():
    assert [slo_priority(c) for c in ("critical", "standard", "", "batch", "sheddable", "background", "x")] \
        == [0, 1, 1, 5, 6, 7, 1]


@pytest.mark.parametrize("overrides, field", [
    ({"input_len": [100, -1, 300, 400]}, "input_len"),
    ({"input_len": [100, 0, 300, 400]}, "input_len"),
    ({"output_len": [5, -6, 7, 8]}, "output_len"),
    ({"arrival_us": [30, float("nan"), 20, 10]}, "arrival_us"),
    ({"arrival_us": [30, 10.5, 20, 10]}, "arrival_us"),
    ({"arrival_us": [30, -10, 20, 10]}, "arrival_us"),
    ({"request_id": [0, 1, 1, 3]}, "request_id"),
    ({"deadline_us": [0, -1, 0, 0]}, "deadline_us"),
    ({"prefix_len": [0, 500, 60, 50]}, "prefix_len"),
    ({"output_len": [5, 6, 7]}, "output_len"),
])
def test_request_set_validation_names_field(overrides, field):
    with pytest.raises(ConfigError, match=field):
        _make(**overrides)


def test_direct_construction_rejects_unsorted():
    r = _make()
    fields = {f: getattr(r, f) for f in ("request_id", "input_len", "output_len", "deadline_us", "prefix_group",
                                         "prefix_len", "priority", "slo_class", "tenant_id", "client_id",
                                         "session_id", "round_index", "model")}
    with pytest.raises(ConfigError, match="arrival_us"):
        RequestSet(arrival_us=r.arrival_us[::-1], prefix_group_names=r.prefix_group_names, **fields)
