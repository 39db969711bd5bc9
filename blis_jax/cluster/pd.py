"""Prefill/decode disaggregation: pools, the disaggregation decision and the KV transfer
time (blis-features §3.10).

* Pools by instance index: the first `prefill` slots are Prefill, the next `decode` Decode,
  the next `shared` serve both roles, the next `encode` Encode (sum <= instances; membership
  is fixed). Routing is decode-first: a decode slot is chosen over the decode-role mask, then
  the decider runs, then (if disaggregated) a prefill slot over the prefill-role mask.
* Deciders (`--pd-decider`): `never`, `always`, `prefix-threshold`: disaggregate iff the
  tokens not cached on the selected decode slot, `input_len - cached_blocks * block_size`,
  exceed `--pd-prefix-threshold` (default 16). `cached_blocks` comes from the cache signal
  (possibly stale, signals.py).
* KV transfer (`KVTransferStarted` → `KVTransferCompleted`), for the whole prompt:
  blocks = ceil(input_len / block_size);
  duration_us = max(1, ceil(base_ms * 1000 + blocks * block_size * kv_bytes_per_token
  / (bandwidth_GBps * 1000))), where kv_bytes_per_token is per GPU on the *prefill* pool's TP
  (`blis_jax.config.kv_capacity.kv_bytes_per_token`) and 1 GB/s = 1000 bytes/µs. With
  `--pd-transfer-contention` the bandwidth is divided by the number of transfers active when
  this one starts (this one included).
"""

from __future__ import annotations

import math

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float64, Int64

from blis_jax.cluster._numerics import exact_div, rounded
from blis_jax.errors import ConfigError

PD_DECIDERS = ("never", "always", "prefix-threshold")


class PDConfig(eqx.Module):
    decider: str = eqx.field(static=True)  # one of PD_DECIDERS
    contention: bool = eqx.field(static=True)  # --pd-transfer-contention
    prefix_threshold: Int64[Array, ""]  # tokens
    bandwidth_gbps: Float64[Array, ""]  # GB/s (10^9 bytes/s)
    base_latency_ms: Float64[Array, ""]  # ms


def make_pd_config(
    decider: str = "never", *, prefix_threshold: int = 16, transfer_bandwidth_gbps: float = 25.0,
    transfer_base_latency_ms: float = 0.05, contention: bool = False,
) -> PDConfig:
    """Validated PD settings (defaults are BLIS's flag defaults)."""
    if decider not in PD_DECIDERS:
        raise ConfigError(f"--pd-decider {decider!r} is not supported; use one of {', '.join(PD_DECIDERS)}")
    if isinstance(prefix_threshold, bool) or not isinstance(prefix_threshold, int) or prefix_threshold < 0:
        raise ConfigError(f"--pd-prefix-threshold must be an integer >= 0 tokens, got {prefix_threshold!r}")
    for flag, value, positive in (
        ("--pd-transfer-bandwidth", transfer_bandwidth_gbps, True),
        ("--pd-transfer-base-latency", transfer_base_latency_ms, False),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{flag} must be a finite number, got {value!r}")
        if value < 0 or (positive and value == 0):
            raise ConfigError(f"{flag} must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return PDConfig(
        decider=decider,
        contention=bool(contention),
        prefix_threshold=jnp.asarray(prefix_threshold, jnp.int64),
        bandwidth_gbps=jnp.asarray(float(transfer_bandwidth_gbps), jnp.float64),
        base_latency_ms=jnp.asarray(float(transfer_base_latency_ms), jnp.float64),
    )


def pool_masks(
    num_slots: int, *, prefill: int = 0, decode: int = 0, shared: int = 0, encode: int = 0,
    num_instances: int | None = None,
) -> tuple[Bool[Array, " I"], Bool[Array, " I"], Bool[Array, " I"]]:
    """(prefill-role, decode-role, encode) masks over `num_slots` padded slots; shared slots
    are in both role masks. `num_instances` (default `num_slots`) bounds the pool sizes."""
    n = num_slots if num_instances is None else num_instances
    sizes = {"--prefill-instances": prefill, "--decode-instances": decode,
             "--prefill-decode-instances": shared, "--encode-instances": encode}
    for flag, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"{flag} must be an integer >= 0, got {v!r}")
    if sum(sizes.values()) > n:
        raise ConfigError(
            f"pool sizes sum to {sum(sizes.values())} but --num-instances is {n}; reduce "
            "--prefill-instances/--decode-instances/--prefill-decode-instances/--encode-instances"
        )
    if n > num_slots:
        raise ConfigError(f"--num-instances {n} exceeds the {num_slots} padded instance slots")
    idx = jnp.arange(num_slots)
    a, b, c, d = prefill, prefill + decode, prefill + decode + shared, prefill + decode + shared + encode
    pf = idx < a
    dc = (idx >= a) & (idx < b)
    sh = (idx >= b) & (idx < c)
    en = (idx >= c) & (idx < d)
    return pf | sh, dc | sh, en


def disaggregate(
    cfg: PDConfig, input_len: Int64[Array, ""], cached_blocks: Int64[Array, ""], block_size: int,
) -> Bool[Array, ""]:
    """Decision for a request routed to a decode slot holding `cached_blocks` leading blocks
    of its prompt (from the cache signal of that slot)."""
    if cfg.decider == "never":
        return jnp.asarray(False)
    if cfg.decider == "always":
        return jnp.asarray(True)
    non_cached = jnp.asarray(input_len, jnp.int64) - jnp.asarray(cached_blocks, jnp.int64) * block_size
    return non_cached > cfg.prefix_threshold


def transfer_blocks(input_len: Int64[Array, ""], block_size: int) -> Int64[Array, ""]:
    """KV blocks moved for a disaggregated request: ceil(input_len / block_size)."""
    return (jnp.asarray(input_len, jnp.int64) + block_size - 1) // block_size


def transfer_time_us(
    cfg: PDConfig, input_len: Int64[Array, ""], block_size: int, kv_bytes_per_token: Float64[Array, ""],
    active_transfers: Int64[Array, ""] | None = None,
) -> Int64[Array, ""]:
    """KV transfer duration in µs (>= 1); `active_transfers` (this one included) only matters
    with contention."""
    tokens = transfer_blocks(input_len, block_size) * block_size
    nbytes = tokens.astype(jnp.float64) * jnp.asarray(kv_bytes_per_token, jnp.float64)
    bandwidth = cfg.bandwidth_gbps
    if cfg.contention:
        n = jnp.ones((), jnp.int64) if active_transfers is None else jnp.asarray(active_transfers, jnp.int64)
        bandwidth = exact_div(bandwidth, jnp.maximum(n, 1).astype(jnp.float64))
    us = rounded(cfg.base_latency_ms * 1000.0) + exact_div(nbytes, bandwidth * 1000.0)
    return jnp.maximum(jnp.ceil(us).astype(jnp.int64), 1)
