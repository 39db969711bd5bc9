"""Trained-physics step time (spec latency-models §2; BLIS ``trained_physics_model.go``).

Physics basis functions in µs, combined linearly by ``beta`` (9/10/11-beta modes) or with
max() forms (7/8 betas). float64 throughout; truncation happens in `latency.model`.
"""

from typing import TYPE_CHECKING

import jax.numpy as jnp
from jaxtyping import Array, Float

from blis_jax.latency.features import BatchFeatures

if TYPE_CHECKING:
    from blis_jax.latency.model import LatencyModel


def _head_dim(m: "LatencyModel"):
    return jnp.floor(m.hidden_size / m.num_heads)  # integer division d/H; the explicit head_dim is ignored here


def batch_sums(m: "LatencyModel", f: BatchFeatures) -> dict[str, Float[Array, ""]]:
    """The batch aggregates the step time depends on (float64; exact for integer sums)."""
    f64 = jnp.float64
    pf, dc = f.prefill, f.decode
    # Prefill attention reads the FULL prompt length S_i (InputLen), not the chunk's context;
    # decode reads its context c_j = ProgressIndex.
    t = jnp.where(pf, f.new_tokens, 0).astype(f64)
    s = jnp.where(pf, f.input_len, 0).astype(f64)
    c = jnp.where(dc, f.progress, 0).astype(f64)
    return {
        "t_pf": jnp.sum(t),
        "t_dc": jnp.sum(dc).astype(f64),
        "ctx": jnp.sum(c),
        "batch": jnp.sum(f.scheduled).astype(f64),
        "attn_pf": jnp.sum(4.0 * (m.num_heads / m.tp) * t * (s + t / 2.0) * _head_dim(m)),
    }


def decode_sums(count, ctx) -> dict[str, Float[Array, "..."]]:
    """`batch_sums` of a decode-only batch of `count` requests with total context `ctx`
    (broadcasts: a run of decode steps at once)."""
    f64 = jnp.float64
    count, ctx = jnp.asarray(count, f64), jnp.asarray(ctx, f64)
    zero = jnp.zeros_like(ctx)
    return {"t_pf": zero, "t_dc": count + zero, "ctx": ctx, "batch": count + zero, "attn_pf": zero}


def basis(m: "LatencyModel", f: BatchFeatures) -> dict[str, Float[Array, ""]]:
    """The basis values of one batch: every term a beta multiplies (a pytree of float64
    scalars; the step time is linear in beta given these, handy for refitting)."""
    return basis_of_sums(m, batch_sums(m, f))


def basis_of_sums(m: "LatencyModel", sums: dict) -> dict[str, Float[Array, "..."]]:
    """`basis` from the batch aggregates (elementwise: any shape of aggregates)."""
    t_pf, t_dc, ctx, batch = sums["t_pf"], sums["t_dc"], sums["ctx"], sums["batch"]

    L, d, H, H_kv = m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads
    d_h = _head_dim(m)
    d_kv = H_kv * d_h
    tp = m.tp
    is_moe = m.num_experts >= 2
    interleaved = is_moe & (m.interleave_step > 0)
    n_moe = jnp.where(
        interleaved, jnp.floor(L / (m.interleave_step + 1)), jnp.where(is_moe, L, 0.0)
    )
    n_dense = L - n_moe
    dp = jnp.where(is_moe, m.dp, 1.0)  # DP only matters for MoE
    tau = tp * dp
    group = tau  # MoE expert group tp·dp (dense models: tp, and dp = 1 there)
    heads = H / tp  # per-GPU heads
    k = jnp.maximum(1.0, m.experts_per_tok)
    w, b = m.weight_bytes_per_param, m.bytes_per_param
    peak = peak_flops_per_us(m)
    bw = m.bandwidth_tbs * 1e6  # bytes/µs
    f_moe, f_sh, f_dense = m.moe_ffn_dim, m.shared_ffn_dim, m.dense_ffn_dim

    def proj(tokens):
        return L * 2.0 * tokens * d * (2.0 * d + 2.0 * d_kv) / tau

    def ffn(tokens):  # 3 SwiGLU matrices × 2 FLOP/MAC = 6
        return (
            n_moe * (tokens * k / group) * 6.0 * d * f_moe
            + n_moe * tokens * 6.0 * d * f_sh / tau
            + n_dense * tokens * 6.0 * d * f_dense / tau
        )

    attn_pf = (L / dp) * sums["attn_pf"]
    attn_dc = L * 4.0 * heads * ctx * d_h / dp
    # KV bytes use a hard-coded 2 bytes per element, whatever the dtype.
    kv_per_token = L * 2.0 * (d_kv / tau) * 2.0

    weight = (
        L * d * (2.0 * d + 2.0 * d_kv) * w / tp
        + n_moe * (m.num_experts / group) * 3.0 * d * f_moe * w
        + n_moe * 3.0 * d * f_sh * w / tp
        + n_dense * 3.0 * d * f_dense * w / tp
    ) / bw

    # TP all-reduce over HBM bandwidth (beta_4 absorbs the NVLink/HBM ratio).
    tokens = t_pf + t_dc

    def allreduce(units):
        return units * tokens * d * b * 2.0 * (tp - 1.0) / tp / bw

    tp_comm = (
        allreduce(L) / dp
        + allreduce(n_dense) / dp
        + jnp.where(is_moe & (dp == 1.0), allreduce(n_moe), 0.0)
    )
    dispatch = n_moe * (tokens / dp) * ((group - 1.0) / group) * 2.0 * d * b / bw
    if m.moe_comm == "all2all":
        dispatch = dispatch * k
    dispatch = jnp.where(is_moe & (dp > 1.0), dispatch, 0.0)

    return {
        "pf_compute": (proj(t_pf) + attn_pf + ffn(t_pf)) / peak,
        "pf_kv": kv_per_token * t_pf / bw,
        "dc_compute": (proj(t_dc) + attn_dc + ffn(t_dc)) / peak,
        "dc_kv": kv_per_token * (ctx + t_dc) / bw,
        "weight": weight,
        "tp_comm": tp_comm,
        "moe_dispatch": dispatch,
        "layers": L,
        "batch": batch,
        "interleaved_moe_layers": jnp.where(interleaved, n_moe, 0.0),
    }


def peak_flops_per_us(m: "LatencyModel") -> Float[Array, ""]:
    """FLOP/µs: the FP8 rate iff weights are exactly 1 byte/param and the GPU has one."""
    fp8 = (m.weight_bytes_per_param == 1.0) & (m.tflops_fp8 > 0)
    return jnp.where(fp8, m.tflops_fp8, m.tflops_peak) * 1e6


def step_time(m: "LatencyModel", f: BatchFeatures) -> Float[Array, ""]:
    """Step time in float µs before truncation; 0.0 for an empty batch."""
    return step_time_of_sums(m, batch_sums(m, f))


def step_time_of_sums(m: "LatencyModel", sums: dict) -> Float[Array, "..."]:
    """`step_time` from the batch aggregates (elementwise)."""
    x = basis_of_sums(m, sums)
    beta, mode = m.beta, m.num_betas
    # The number of betas (static) selects the form, as in the reference.
    if mode >= 9:
        prefill = beta[0] * x["pf_compute"] + beta[8] * x["pf_kv"]
    else:
        prefill = beta[0] * jnp.maximum(x["pf_compute"], x["pf_kv"])
    if mode >= 10:
        decode = beta[1] * x["dc_compute"] + beta[9] * x["dc_kv"]
    else:
        decode = beta[1] * jnp.maximum(x["dc_compute"], x["dc_kv"])
    beta_ep = beta[10] if mode >= 11 else beta[3]  # defaults to beta_4, not 0
    total = (
        prefill
        + decode
        + beta[2] * x["weight"]
        + beta[3] * x["tp_comm"]
        + beta_ep * x["moe_dispatch"]
        + beta[4] * x["layers"]
        + beta[5] * x["batch"]
        + beta[6]
    )
    if mode >= 8:
        total = total + beta[7] * x["interleaved_moe_layers"]
    return jnp.where(x["batch"] > 0, total, 0.0)


BASIS_ORDER = ("pf_compute", "dc_compute", "weight", "tp_comm", "layers", "batch", "step", "interleaved_moe_layers",
               "pf_kv", "dc_kv", "moe_dispatch")


def basis_vector(m: "LatencyModel", f: BatchFeatures) -> Float[Array, " 11"]:
    """Basis values in beta's slice order, so that step_time == beta @ basis_vector in the
    linear modes (10 or 11 betas); zeros for an empty batch. With fewer than 11 betas β_EP is
    β₄, so the MoE dispatch term is folded into slot 3."""
    x = basis(m, f)
    nonempty = (x["batch"] > 0).astype(jnp.float64)
    ep_own = m.num_betas >= 11
    v = jnp.stack([
        x["pf_compute"], x["dc_compute"], x["weight"],
        x["tp_comm"] + (0.0 if ep_own else x["moe_dispatch"]),
        x["layers"], x["batch"], jnp.float64(1.0),
        x["interleaved_moe_layers"] if m.num_betas >= 8 else jnp.float64(0.0),
        x["pf_kv"], x["dc_kv"],
        x["moe_dispatch"] if ep_own else jnp.float64(0.0),
    ])
    return v * nonempty
