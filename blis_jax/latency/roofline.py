"""Roofline step time (spec latency-models §1; BLIS ``roofline.go``).

The whole batch is one forward pass with a single compute/memory crossover. Every FLOP and
byte is divided by TP; no communication or overhead terms, no DP/EP, raw peak bandwidth.
"""

from typing import TYPE_CHECKING

import jax.numpy as jnp
from jaxtyping import Array, Float

from blis_jax.latency.features import BatchFeatures

if TYPE_CHECKING:
    from blis_jax.latency.model import LatencyModel


def step_time(m: "LatencyModel", f: BatchFeatures) -> Float[Array, ""]:
    """Step time in float µs before truncation; 0.0 for an empty batch."""
    f64 = jnp.float64
    pf, dc = f.prefill, f.decode
    # n new tokens after s history tokens; a decode always counts 1 token.
    n = jnp.where(pf, f.new_tokens, jnp.where(dc, 1, 0)).astype(f64)
    s = jnp.where(f.scheduled, f.progress, 0).astype(f64)
    ctx = jnp.where(n > 1, s + (n - 1.0) / 2.0, s)  # mean attention context of the chunk

    L, d, H, H_kv = m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads
    d_h = d / H  # float division here (trained-physics uses integer division)
    d_kv = H_kv * d_h
    is_moe = m.num_experts >= 2
    n_moe = jnp.where(
        is_moe & (m.interleave_step > 0),
        jnp.floor(L / (m.interleave_step + 1)),
        jnp.where(is_moe, L, 0.0),
    )
    n_dense = L - n_moe
    k = m.experts_per_tok
    f_moe, f_dense = m.moe_ffn_dim, m.dense_ffn_dim
    w, b, tp = m.weight_bytes_per_param, m.bytes_per_param, m.tp

    # FLOPs per request. The MLP counts 2 matrices (up + down), as llm-optimizer does.
    gemm = L * (2.0 * n * (d * d + 2.0 * d * d_kv) + 2.0 * n * d * d)
    scores = L * 4.0 * H * n * ctx * d_h
    vector = L * (5.0 * H * n * ctx + 2.0 * n * d)
    mlp = n_moe * 2.0 * n * (2.0 * d * f_moe) * k + n_dense * 2.0 * n * (2.0 * d * f_dense)
    flops = gemm + scores + vector + mlp

    fp8 = (w == 1.0) & (m.tflops_fp8 > 0)
    peak = jnp.where(fp8, m.tflops_fp8, m.tflops_peak) * 1e12  # FLOP/s
    t_compute = jnp.sum(
        jnp.where(pf, flops / (tp * peak * m.mfu_prefill), 0.0)
        + jnp.where(dc, flops / (tp * peak * m.mfu_decode), 0.0)
    )

    # Weights are read once per step; MoE weights count the expected distinct experts hit
    # by all B new tokens under uniform routing.
    total_tokens = jnp.sum(n)
    experts = jnp.where(is_moe, m.num_experts, 1.0)  # 1.0 keeps dense models NaN-free
    touched = jnp.where(is_moe, experts * (1.0 - ((experts - k) / experts) ** total_tokens), 0.0)
    weight_bytes = w * (
        L * (2.0 * d * d + 2.0 * d * d_kv)
        + n_moe * 2.0 * d * f_moe * touched
        + n_dense * 2.0 * d * f_dense
    )
    # KV write + KV read of history + activations, in activation bytes b (not w).
    dynamic = 2.0 * L * H_kv * d_h * b * n + 2.0 * L * H_kv * d_h * b * s + L * d * b * n
    dynamic = jnp.sum(jnp.where(f.scheduled, dynamic, 0.0))
    bw = m.bandwidth_tbs * 1e12  # bytes/s
    t_memory = (weight_bytes / tp + dynamic / tp) / bw

    step = 1e6 * jnp.maximum(t_compute, t_memory)
    return jnp.where(jnp.any(f.scheduled), step, 0.0)
