"""BLIS's model autoscaler as array functions (blis-infra §4): collect → analyze (V2 token
saturation) → optimize (the unlimited engine) → stabilize, at every scaling tick.

Everything here is pure and jittable; the cluster loop calls `decide` at a ScalingTick event
and applies the decisions at the ScaleActuation event. Models and variants are small static
axes: `M` models (ids as in `ClusterParams.instance_model`, byte order) and `V` replica variants
(GPU type, TP) with their costs; each slot names its model and variant.

Sums are accumulated in BLIS's order (replicas in instance order into their variant, then
variants in (cost, type, TP) order), so the float64 figures are BLIS's to the bit.
"""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float64, Int32, Int64

from blis_jax.cluster.node_pools import Delay
from blis_jax.errors import ConfigError

# analyzer defaults, used for every parameter given as 0 (blis-infra §4.1)
DEFAULT_KV_CACHE_THRESHOLD = 0.8
DEFAULT_SCALE_UP_THRESHOLD = 0.8
DEFAULT_SCALE_DOWN_BOUNDARY = 0.4
DEFAULT_AVG_INPUT_TOKENS = 512.0
NO_TIMER = -1


@dataclasses.dataclass(frozen=True)
class AnalyzerConfig:
    """The V2 saturation analyzer's parameters (bundle `autoscaler.analyzer`; 0 = default)."""

    kv_cache_threshold: float = 0.0
    scale_up_threshold: float = 0.0
    scale_down_boundary: float = 0.0
    avg_input_tokens: float = 0.0

    def check(self, where: str = "autoscaler.analyzer") -> None:
        """BLIS's bundle rules, in its wording: each field 0 (the default) or finite and
        positive, kv at most 1, and the effective down boundary below the effective up
        threshold."""
        kv = self.kv_cache_threshold
        if not (kv == 0 or (math.isfinite(kv) and 0 < kv <= 1)):
            raise ConfigError(f"{where}.kv_cache_threshold must be 0 (default) or in (0, 1], got {kv:g}")
        for key in ("scale_up_threshold", "scale_down_boundary", "avg_input_tokens"):
            value = getattr(self, key)
            if not (value == 0 or (math.isfinite(value) and value > 0)):
                raise ConfigError(f"{where}.{key} must be 0 (default) or a finite number > 0, got {value:g}")
        up = self.scale_up_threshold or DEFAULT_SCALE_UP_THRESHOLD
        down = self.scale_down_boundary or DEFAULT_SCALE_DOWN_BOUNDARY
        if down >= up:
            raise ConfigError(f"{where}.scale_down_boundary ({down:g}) must be < effective scale_up_threshold ({up:g})")

    def effective(self) -> AnalyzerConfig:
        """Checked, with zeros replaced by the defaults."""
        self.check()
        return AnalyzerConfig(
            kv_cache_threshold=self.kv_cache_threshold or DEFAULT_KV_CACHE_THRESHOLD,
            scale_up_threshold=self.scale_up_threshold or DEFAULT_SCALE_UP_THRESHOLD,
            scale_down_boundary=self.scale_down_boundary or DEFAULT_SCALE_DOWN_BOUNDARY,
            avg_input_tokens=self.avg_input_tokens or DEFAULT_AVG_INPUT_TOKENS)


@dataclasses.dataclass(frozen=True)
class AutoscalerConfig:
    """The autoscaler (bundle section `autoscaler`, blis-infra §4.1): a tick every `interval_us`
    (0 = off), the stabilization windows, the HPA scrape delay between a tick and its
    actuation, and the analyzer's thresholds."""

    interval_us: float = 0.0
    scale_up_stabilization_window_us: float = 0.0
    scale_down_stabilization_window_us: float = 0.0
    hpa_scrape_delay: Delay = Delay()
    analyzer: AnalyzerConfig = AnalyzerConfig()

    def check(self, where: str = "autoscaler") -> None:
        """BLIS's bundle rules, in its wording (the analyzer's apply even when the interval is 0)."""
        for key in ("interval_us", "scale_up_stabilization_window_us", "scale_down_stabilization_window_us"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"{where}.{key} must be a finite number >= 0, got {value!r}")
        self.hpa_scrape_delay.check(f"{where}.hpa_scrape_delay")
        self.analyzer.check(f"{where}.analyzer")

    def validate(self, where: str = "autoscaler") -> AutoscalerConfig:
        """`check`, and the one rule blis-jax adds: BLIS truncates an interval below 1 µs to 0
        and re-ticks at the same time forever (blis-infra §4.10 hazard 5)."""
        self.check(where)
        if 0 < self.interval_us < 1:
            raise ConfigError(f"{where}.interval_us must be 0 (off) or >= 1 µs, got {self.interval_us!r}")
        return self


class AnalyzerParams(eqx.Module):
    """`AnalyzerConfig.effective()` as device scalars (sweepable without recompiling)."""

    kv_cache_threshold: Float64[Array, ""]
    scale_up_threshold: Float64[Array, ""]
    scale_down_boundary: Float64[Array, ""]
    avg_input_tokens: Float64[Array, ""]

    @classmethod
    def of(cls, config: AnalyzerConfig) -> AnalyzerParams:
        eff = config.effective()
        return cls(*(jnp.asarray(float(v), jnp.float64) for v in dataclasses.astuple(eff)))


class Variants(eqx.Module):
    """The replica variants (GPU type, TP): their costs and BLIS's two orders over them."""

    cost: Float64[Array, " V"]
    scale_up_order: Int32[Array, " V"]  # (cost, GPU type, TP) ascending: the cheapest first
    scale_down_order: Int32[Array, " V"]  # cost descending, then GPU type and TP ascending

    @classmethod
    def of(cls, variants: list[tuple[str, int, float]]) -> Variants:
        """From (GPU type, TP, cost) per variant id."""
        ids = range(len(variants))
        up = sorted(ids, key=lambda v: (variants[v][2], variants[v][0].encode(), variants[v][1]))
        down = sorted(ids, key=lambda v: (-variants[v][2], variants[v][0].encode(), variants[v][1]))
        return cls(cost=jnp.asarray([float(c) for _, _, c in variants], jnp.float64),
                   scale_up_order=jnp.asarray(up, jnp.int32), scale_down_order=jnp.asarray(down, jnp.int32))


class Replicas(eqx.Module):
    """What a tick collects, per instance slot (blis-infra §4.3)."""

    routable: Bool[Array, " I"]
    loading: Bool[Array, " I"]
    model: Int32[Array, " I"]
    variant: Int32[Array, " I"]
    capacity_tokens: Int64[Array, " I"]  # C: total KV blocks × block size (snapshot)
    used_tokens: Int64[Array, " I"]  # U: (total − free) blocks × block size (snapshot)
    queue_depth: Int64[Array, " I"]  # Q (snapshot)
    pending_tokens: Int64[Array, " I"]  # a Loading instance's configured capacity (live)


class Analysis(eqx.Module):
    """Per model: the analyzer's result and the per-variant aggregates the engine reads."""

    required: Float64[Array, " M"]
    spare: Float64[Array, " M"]
    supply: Float64[Array, "M V"]
    count: Int32[Array, "M V"]
    listed: Bool[Array, "M V"]  # variants in the result (those with a contributing replica)
    zero_capacity: Bool[Array, " I"]  # routable replicas excluded for C = 0 (BLIS warns about each)


def analyze(rep: Replicas, p: AnalyzerParams, variants: Variants, num_models: int) -> Analysis:
    """The V2 token-saturation analyzer for every model (blis-infra §4.4)."""
    num_variants = variants.cost.shape[0]
    k, u, d, a = p.kv_cache_threshold, p.scale_up_threshold, p.scale_down_boundary, p.avg_input_tokens
    contributes = rep.routable & (rep.capacity_tokens > 0)

    def one_model(m):
        def add(carry, i):
            supply, demand, count = carry
            on = contributes[i] & (rep.model[i] == m)
            v = rep.variant[i]
            s = rep.capacity_tokens[i].astype(jnp.float64) * k
            dem = rep.used_tokens[i].astype(jnp.float64) + rep.queue_depth[i].astype(jnp.float64) * a
            return (supply.at[v].add(jnp.where(on, s, 0.0)), demand.at[v].add(jnp.where(on, dem, 0.0)),
                    count.at[v].add(on.astype(jnp.int32))), None

        zeros = jnp.zeros(num_variants, jnp.float64)
        (supply, demand, count), _ = jax.lax.scan(add, (zeros, zeros, jnp.zeros(num_variants, jnp.int32)),
                                                  jnp.arange(rep.routable.shape[0]))

        def total(carry, v):
            s_tot, d_tot = carry
            return (s_tot + supply[v], d_tot + demand[v]), None

        (s_tot, d_tot), _ = jax.lax.scan(total, (jnp.float64(0), jnp.float64(0)), variants.scale_up_order)
        mine = rep.loading & (rep.model == m) & (rep.pending_tokens > 0)
        pending = jnp.sum(jnp.where(mine, rep.pending_tokens, 0)).astype(jnp.float64) * k
        replicas = jnp.sum(count)
        needed = d_tot / u - (s_tot + pending)
        spare = s_tot - d_tot / d
        per_replica = jnp.where(count > 0, supply / jnp.maximum(count, 1).astype(jnp.float64), -jnp.inf)
        n_minus_one = s_tot - jnp.max(per_replica) > d_tot / d
        some = replicas > 0   # no routable replica: all zero (no scale-up from zero)
        required = jnp.where(some & (needed > 0), needed, 0.0)
        spare = jnp.where(some & ~(needed > 0) & (replicas > 1) & (spare > 0) & n_minus_one, spare, 0.0)
        return required, spare, supply, count

    required, spare, supply, count = jax.vmap(one_model)(jnp.arange(num_models, dtype=jnp.int32))
    return Analysis(required=required, spare=spare, supply=supply, count=count, listed=count > 0,
                    zero_capacity=rep.routable & (rep.capacity_tokens <= 0))


class Decisions(eqx.Module):
    """At most one scaling decision per model: `delta` replicas (+ up, − down, 0 none) of
    `variant`."""

    delta: Int32[Array, " M"]
    variant: Int32[Array, " M"]


def optimize(an: Analysis, variants: Variants) -> Decisions:
    """The unlimited engine (blis-infra §4.5): scale up on the cheapest variant with replicas,
    scale down on the most expensive one; GPU inventory is not consulted."""

    def one_model(required, spare, supply, count, listed):
        def first(order, eligible):
            has = eligible[order]
            return order[jnp.argmax(has)], jnp.any(has)

        up_v, _ = first(variants.scale_up_order, listed)
        down_v, any_down = first(variants.scale_down_order, count > 0)
        p = jnp.where((count[up_v] > 0) & (supply[up_v] > 0), supply[up_v] / jnp.maximum(count[up_v], 1), 0.0)
        up = jnp.where(p <= 0, 1, jnp.maximum(1, jnp.ceil(required / jnp.where(p > 0, p, 1.0)))).astype(jnp.int32)
        n = count[down_v]
        per = supply[down_v] / jnp.maximum(n, 1)
        down = jnp.where(supply[down_v] <= 0, 1,
                         jnp.clip(jnp.floor(spare / jnp.where(per > 0, per, 1.0)), 1, n)).astype(jnp.int32)
        delta = jnp.where(required > 0, up, jnp.where((spare > 0) & any_down, -down, 0))
        return delta.astype(jnp.int32), jnp.where(required > 0, up_v, down_v).astype(jnp.int32)

    delta, variant = jax.vmap(one_model)(an.required, an.spare, an.supply, an.count, an.listed)
    return Decisions(delta=delta, variant=variant)


class Stabilizer(eqx.Module):
    """Per model, when a continuous scale-up (scale-down) signal started; NO_TIMER none."""

    up_since: Int64[Array, " M"]
    down_since: Int64[Array, " M"]

    @classmethod
    def empty(cls, num_models: int) -> Stabilizer:
        none = jnp.full(num_models, NO_TIMER, jnp.int64)
        return cls(up_since=none, down_since=none)


def stabilize(st: Stabilizer, dec: Decisions, now, up_window_us, down_window_us) -> tuple[Stabilizer, Decisions]:
    """The stabilization-window filter (blis-infra §4.6): a decision passes once its direction
    has been signalled for a whole window (at once when the window is 0); passing, or a tick
    without that direction's signal, clears the timer."""
    now = jnp.asarray(now, jnp.int64)
    up, down = dec.delta > 0, dec.delta < 0
    up_since = jnp.where(up, st.up_since, NO_TIMER)
    down_since = jnp.where(down, st.down_since, NO_TIMER)

    def filter_direction(signal, since, window):
        window = jnp.asarray(window, jnp.int64)
        fresh = signal & (since == NO_TIMER)
        start = jnp.where(fresh, now, since)
        passes = signal & jnp.where(fresh, window <= 0, now - start >= window)
        return passes, jnp.where(passes | ~signal, NO_TIMER, start)

    up_pass, up_since = filter_direction(up, up_since, up_window_us)
    down_pass, down_since = filter_direction(down, down_since, down_window_us)
    passed = Decisions(delta=jnp.where(up_pass | down_pass, dec.delta, 0).astype(jnp.int32), variant=dec.variant)
    return Stabilizer(up_since=up_since, down_since=down_since), passed
