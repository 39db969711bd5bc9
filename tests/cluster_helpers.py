"""Shared builders for the cluster tests (routing and scorers; a hook on the cluster driver)."""

from __future__ import annotations

import contextlib
from unittest import mock

import jax
import jax.numpy as jnp
import pytest

from blis_jax.cluster import signals as sg


@pytest.fixture(autouse=True)
def strict_dtypes():
    # Implicit dtype promotion inside the cluster code would be a silent int/float mix-up.
    with jax.numpy_dtype_promotion("strict"):
        yield


def router_state(qd, bs, in_flight, kvu, active) -> sg.RouterState:
    """A RouterState from per-instance queue depths, batch sizes, in-flight counts and KV use."""
    n = len(qd)
    zi = jnp.zeros(n, jnp.int64)
    signals = sg.InstanceSignals(
        queue_depth=jnp.asarray(qd, jnp.int64), batch_size=jnp.asarray(bs, jnp.int64),
        kv_utilization=jnp.asarray(kvu, jnp.float64), free_kv_blocks=zi, kv_tokens_in_use=zi,
        kv_tokens_capacity=zi, cache_hit_rate=jnp.zeros(n, jnp.float64), preemption_count=zi,
    )
    return sg.RouterState(signals=signals, in_flight=jnp.asarray(in_flight, jnp.int64),
                          active=jnp.asarray(active, bool))


def mixed_requests(n: int, rate: float, seed: int, classes, tenants=None):
    """Poisson arrivals at `rate`, prompts of 50-399 and outputs of 20-149 tokens, SLO classes
    (and tenants) drawn uniformly from the given lists."""
    import numpy as np

    from blis_jax.workload.requests import make_request_set

    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1e6 / rate, n)).astype(np.int64)
    columns = dict(input_len=rng.integers(50, 400, n), output_len=rng.integers(20, 150, n),
                   slo_class=rng.choice(classes, n))
    if tenants is not None:
        columns["tenant_id"] = rng.choice(tenants, n)
    return make_request_set(request_id=np.arange(n), arrival_us=arrival, **columns)


@contextlib.contextmanager
def after_each_chunk(callback):
    """Call `callback(cluster state on the host)` after every chunk the cluster driver runs."""
    from blis_jax.cluster import simulate as csim

    advance = csim.advance_chunk

    def observed(*args):
        cs, done = advance(*args)
        callback(jax.device_get(cs))
        return cs, done

    with mock.patch.object(csim, "advance_chunk", observed):
        yield
