"""Dynamic engine settings: numbers that may change without recompiling."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Int64

from blis_jax.errors import ConfigError

INF_TIME = (1 << 62)  # "never" in int64 microseconds


class EngineParams(eqx.Module):
    max_num_seqs: Int64[Array, ""]
    max_num_batched_tokens: Int64[Array, ""]
    long_prefill_token_threshold: Int64[Array, ""]  # 0 = no per-request chunk cap
    max_model_len: Int64[Array, ""]  # 0 = unlimited
    total_kv_blocks: Int64[Array, ""]
    horizon_us: Int64[Array, ""]
    lora: object = None  # LoraParams (engine/lora.py) when adapters are configured
    cpu: object = None  # CpuTierParams (engine/cpu_tier.py) with a legacy CPU KV tier
    off: object = None  # OffloadParams (engine/offload.py) with a multi-tier KV offload chain


def make_engine_params(
    *,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 2048,
    long_prefill_token_threshold: int = 0,
    max_model_len: int = 0,
    total_kv_blocks: int,
    horizon_us: int | None = None,
) -> EngineParams:
    """Validate and convert engine settings to int64 arrays (errors name the BLIS flag)."""
    checks = {
        "--max-num-seqs": (max_num_seqs, 1),
        "--max-num-batched-tokens": (max_num_batched_tokens, 1),
        "--long-prefill-token-threshold": (long_prefill_token_threshold, 0),
        "--max-model-len": (max_model_len, 0),
        "--total-kv-blocks": (total_kv_blocks, 1),
    }
    for flag, (value, low) in checks.items():
        if not isinstance(value, (int,)) and not (hasattr(value, "is_integer") and value.is_integer()):
            raise ConfigError(f"{flag} must be an integer, got {value!r}")
        if value < low:
            raise ConfigError(f"{flag} must be >= {low}, got {value}")
    if horizon_us is not None and horizon_us <= 0:
        raise ConfigError(f"--horizon must be > 0 microseconds, got {horizon_us}")
    i64 = lambda v: jnp.asarray(int(v), dtype=jnp.int64)  # noqa: E731
    return EngineParams(
        max_num_seqs=i64(max_num_seqs),
        max_num_batched_tokens=i64(max_num_batched_tokens),
        long_prefill_token_threshold=i64(long_prefill_token_threshold),
        max_model_len=i64(max_model_len),
        total_kv_blocks=i64(total_kv_blocks),
        horizon_us=i64(INF_TIME if horizon_us is None else horizon_us),
    )
