"""Shared builders for the cluster decision tests (routing and scorers)."""

from __future__ import annotations

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
