"""Instance warm-up (blis-infra §2.5), a library-only feature of BLIS (its bundle parser rejects
`warm_up_request_count` / `warm_up_ttft_factor`; blis-jax also exposes them as CLI extensions).

With a warm-up request count W > 0, an instance enters `WarmingUp` wherever it would become
`Active` (startup, warm start, end of loading, an autoscaler placement with no loading delay)
and becomes `Active` once W requests have *completed* on it (drops and timeouts do not count;
any request counts). Nothing reads the difference between the two states except the
autoscaler's scale-down (which drains `Active` instances only), so the promotion is applied at
every cluster event, after the instances have run up to it: exactly when BLIS's per-event
check could have been observed. An instance in `WarmingUp` has never served a request before
(it was Loading, or is new), so its completions so far are those of its warm-up.

Recording happens at routing: the first W requests routed to an instance (standard routing
or the PD non-disaggregated path, whatever the instance's state) are its warm-up requests.
After the run their cluster-level TTFT is multiplied by the factor f when f > 1
(`adjusted_ttft`): cluster JSON TTFT figures, per-request records, per-SLO, per-model and
goodput read it; per-instance blocks and scheduling do not.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int32

from blis_jax.cluster import lifecycle as lc
from blis_jax.errors import ConfigError
from blis_jax.naming import name


def check(count, factor) -> None:
    """BLIS's validator rules: W >= 0; f = 0 or a finite f >= 1."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ConfigError(f"{name('cluster.warm_up_request_count')} must be an integer >= 0 (0 = no warm-up), "
                          f"got {count!r}")
    if (isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor)
            or (factor != 0 and factor < 1)):
        raise ConfigError(f"{name('cluster.warm_up_ttft_factor')} must be 0 (= 1, no penalty) or a finite number "
                          f">= 1, got {factor!r}")


class WarmUp(eqx.Module):
    """Per instance, the warm-up request IDs recorded so far; per request, how often it was
    recorded (once, or again by the instance it was redirected to)."""

    requests: Int32[Array, ""]  # W (dynamic: changing it never recompiles)
    recorded: Int32[Array, " I"]
    marks: Int32[Array, " N"]


def empty(count, instances: int, requests: int) -> WarmUp:
    return WarmUp(requests=jnp.asarray(count, jnp.int32), recorded=jnp.zeros(instances, jnp.int32),
                  marks=jnp.zeros(requests, jnp.int32))


def ready_state(count):
    """The state an instance enters instead of `Active`: `WarmingUp` when W > 0."""
    return jnp.where(jnp.asarray(count) > 0, lc.WARMING_UP, lc.ACTIVE).astype(jnp.int32)


def record(wu: WarmUp, target, r, on) -> WarmUp:
    """Request r routed to instance `target` (-1: nowhere): one of its warm-up requests while
    it has recorded fewer than W (the list length decides, not the state)."""
    i = jnp.maximum(target, 0)
    take = on & (target >= 0) & (wu.recorded[i] < wu.requests)
    slots, n = wu.recorded.shape[0], wu.marks.shape[0]
    return WarmUp(requests=wu.requests,
                  recorded=wu.recorded.at[jnp.where(take, i, slots)].add(1, mode="drop"),
                  marks=wu.marks.at[jnp.where(take, r, n)].add(1, mode="drop"))


def completed(instances) -> Int32[Array, " I"]:
    """Requests completed on each instance so far (completed or length-capped): of the requests
    that left it, those neither dropped nor timed out (the engine's three exits), from its
    counters, so the cost per event does not grow with the number of requests."""
    return (instances.finished - instances.dropped - instances.timed_out).astype(jnp.int32)


def promote(life: lc.Lifecycle, wu: WarmUp, done_per_instance, on) -> lc.Lifecycle:
    """WarmingUp → Active for every instance with W completions."""
    up = on & (life.state == lc.WARMING_UP) & (done_per_instance >= wu.requests)
    return lc.Lifecycle(state=jnp.where(up, lc.ACTIVE, life.state).astype(life.state.dtype), loaded_at=life.loaded_at,
                        gpus=life.gpus, gpu_owner=life.gpu_owner)


def adjusted_ttft(ttft_us: np.ndarray, marks: np.ndarray, factor: float) -> np.ndarray | None:
    """The cluster-level TTFTs after BLIS's post-hoc penalty (float64 µs, as BLIS's merged map):
    τ·f for every recorded request with a TTFT (f applied once per recording); None when
    nothing changes (f <= 1 or no recorded request has a TTFT). The cluster TTFT sum BLIS
    adds trunc(τ·f − τ) to equals Σ trunc(value) over these values (τ is an integer)."""
    factor = float(factor)
    marks = np.asarray(marks, np.int64)
    hit = (np.asarray(ttft_us) >= 0) & (marks > 0)
    if factor <= 1.0 or not hit.any():
        return None
    out = np.asarray(ttft_us, np.float64).copy()
    for _ in range(int(marks.max())):
        again = hit & (marks > 0)
        out[again] = out[again] * factor
        marks = marks - 1
    return out
