"""Per-instance deployments: each instance slot's latency model, KV blocks and max-model-len.

With prefill/decode pools, a pool may run on other hardware or another TP than the rest of
the cluster (`--prefill-hardware`, `--prefill-tp`, `--decode-hardware`, `--decode-tp`,
blis-features §3.10). Its step times come from its own latency model, and its KV capacity
is re-derived from its own GPU and TP, unless `--total-kv-blocks` is explicit (as BLIS
does for instances placed on node pools). Its max-model-len is re-derived from that
capacity, unless `--max-model-len` is explicit.

The cluster loop always runs on stacked deployments (every leaf with a leading instance
axis), so clusters with and without overrides share one program when the latency models
have the same structure (kind, beta count, MoE family). Only the numbers differ per slot.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int64

from blis_jax.engine.params import EngineParams
from blis_jax.latency.model import per_slot_kinds


@dataclasses.dataclass(frozen=True)
class PoolDeployment:
    """A PD pool's own deployment (what its instances run on)."""

    latency_model: object  # LatencyModel
    total_kv_blocks: int
    max_model_len: int  # 0 = unlimited
    hardware: str
    tp: int
    kv_bytes_per_token: float  # per GPU at this pool's TP (sizes the KV transfers it sends)


class InstanceDeployments(eqx.Module):
    """Stacked per-slot deployments of one cluster (leading axis: instance slots)."""

    model: object  # LatencyModel, every leaf [I, ...]
    total_kv_blocks: Int64[Array, " I"]
    max_model_len: Int64[Array, " I"]


def stack_deployments(
    model, params: EngineParams, slots: int, prefill_role: np.ndarray, decode_role: np.ndarray,
    prefill: PoolDeployment | None = None, decode: PoolDeployment | None = None,
) -> InstanceDeployments:
    """Slot i runs the prefill pool's deployment if it is in that pool and the pool has one,
    else the decode pool's likewise (a slot in both roles uses the decode deployment, as BLIS's
    shared pods do), else the base (`model`, `params`)."""
    prefill_role = np.asarray(prefill_role, bool)
    decode_role = np.asarray(decode_role, bool)
    choice = np.zeros(slots, np.int64)  # 0 base, 1 prefill pool, 2 decode pool
    if prefill is not None:
        choice[prefill_role & ~decode_role] = 1
    if decode is not None:
        choice[decode_role] = 2
    options = [(model, int(params.total_kv_blocks), int(params.max_model_len))]
    for name, pool in (("prefill", prefill), ("decode", decode)):
        if pool is None:
            options.append(options[0])
            continue
        options.append((pool.latency_model, pool.total_kv_blocks, pool.max_model_len))
    # pools on another latency backend (--prefill-latency-model ...): one structure per slot
    models = per_slot_kinds([m for m, _, _ in options])
    options = [(m, *rest) for m, (_, *rest) in zip(models, options)]

    def per_slot(leaves):
        return jnp.stack([leaves[c] for c in choice])

    stacked = jax.tree.map(lambda *leaves: per_slot(leaves), *(m for m, _, _ in options))
    return InstanceDeployments(
        model=stacked,
        total_kv_blocks=jnp.asarray([options[c][1] for c in choice], jnp.int64),
        max_model_len=jnp.asarray([options[c][2] for c in choice], jnp.int64),
    )


def largest_kv_blocks(params: EngineParams, *pools: PoolDeployment | None) -> int:
    """The KV pool the compiled engine must hold: the largest of the deployments'."""
    return max([int(params.total_kv_blocks)] + [p.total_kv_blocks for p in pools if p is not None])


def lane_params(params: EngineParams, total_kv_blocks: Int64[Array, " I"],
                max_model_len: Int64[Array, " I"]) -> EngineParams:
    """Engine settings per slot (leading instance axis): the cluster's, with each slot's own
    KV blocks and max-model-len."""
    slots = total_kv_blocks.shape[0]
    stacked = jax.tree.map(lambda x: jnp.broadcast_to(x, (slots, *jnp.shape(x))), params)
    return dataclasses.replace(stacked, total_kv_blocks=total_kv_blocks, max_model_len=max_model_len)
