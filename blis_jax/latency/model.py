"""`LatencyModel`: numbers as float64 arrays, structure as static fields and the class.

`LatencyModel` is abstract; its two final kinds, `TrainedPhysicsModel` and `RooflineModel`,
differ only in their methods (the same fields, so one builder fills both). Changing any number (coefficients, architecture or hardware figures, TP) never retraces;
the model vmaps over coefficient sets and differentiates w.r.t. them. The ``*_float``
functions are the differentiable values; the ``*_us`` functions truncate to int64 µs
exactly as BLIS does (Go ``int64(x)``; NaN and overflow clamp to MaxInt64).
"""

import abc
import dataclasses
import functools
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int

from blis_jax.config.coefficients import (
    BLIS_NUM_ALPHA,
    NUM_ALPHA,
    check_alpha,
    check_beta,
    load_coefficients,
    padded_alpha,
)
from blis_jax.config.hardware import GPUSpec
from blis_jax.config.model import ModelArch
from blis_jax.errors import ConfigError
from blis_jax.latency import roofline, trained_physics
from blis_jax.latency.features import BatchFeatures

NUM_BETA_SLOTS = 11
# MoE dispatch/combine backends → volume family (spec latency-models §2.2).
_ALLGATHER = ("naive", "allgather_reducescatter")
_ALL2ALL = ("pplx", "mori", "flashinfer_all2allv")  # and every deepep_*
_INT64_MAX = 2**63 - 1
_INT64_MIN = -(2**63)


class LatencyModel(eqx.Module):
    """Step-time model of one instance (model × GPU × TP/DP) with its coefficients.

    Abstract: `build_latency_model` makes a `TrainedPhysicsModel` or a `RooflineModel`. The
    float methods are the differentiable values before truncation; the module-level ``*_us``
    functions truncate them as BLIS does."""

    kind: ClassVar[str]  # the --latency-model name
    # Structure (static; the class is structure too): changing these retraces.
    num_betas: int = eqx.field(static=True)  # betas given (7..11) → mode; 0 for roofline
    moe_comm: str = eqx.field(static=True)  # "allgather" | "all2all"
    # Architecture (float64 scalars; FFN dims already resolved for this kind).
    num_layers: Float[Array, ""]
    hidden_size: Float[Array, ""]
    num_heads: Float[Array, ""]
    num_kv_heads: Float[Array, ""]
    moe_ffn_dim: Float[Array, ""]
    dense_ffn_dim: Float[Array, ""]
    shared_ffn_dim: Float[Array, ""]
    num_experts: Float[Array, ""]  # 0 for dense models
    experts_per_tok: Float[Array, ""]
    interleave_step: Float[Array, ""]
    bytes_per_param: Float[Array, ""]  # b: activations and KV
    weight_bytes_per_param: Float[Array, ""]  # w: weights
    # Hardware.
    tflops_peak: Float[Array, ""]
    tflops_fp8: Float[Array, ""]
    bandwidth_tbs: Float[Array, ""]
    mfu_prefill: Float[Array, ""]
    mfu_decode: Float[Array, ""]
    # Deployment.
    tp: Float[Array, ""]
    dp: Float[Array, ""]
    # Coefficients.
    alpha: Float[Array, "4"]  # α₀ α₁ α₂ (BLIS) and the first-token lag α₃ (0: BLIS's behaviour)
    beta: Float[Array, "11"]  # zero-padded; the unused tail is ignored by `num_betas`

    @abc.abstractmethod
    def step_time(self, feats: BatchFeatures) -> Float[Array, ""]:
        """Step time in µs before truncation (0.0 for an empty batch)."""

    @abc.abstractmethod
    def decode_run_step_times(self, feats: BatchFeatures, offsets: Int[Array, " K"]) -> Float[Array, " K"]:
        """`step_time` of the decode-only batch `feats` with every context grown by each offset
        (0.0 for an empty batch)."""

    @abc.abstractmethod
    def queueing_time(self, input_len: Float[Array, "..."]) -> Float[Array, "..."]:
        """Arrival → enqueue delay in µs before truncation."""

    @abc.abstractmethod
    def post_decode_time(self) -> Float[Array, ""]:
        """Added once to E2E, in µs before truncation."""


class TrainedPhysicsModel(LatencyModel):
    """BLIS's trained-physics model (latency-models §2): physics basis functions weighted by β;
    α₀ delays enqueue, α₁ is added once to E2E."""

    kind: ClassVar[str] = "trained-physics"

    def step_time(self, feats):
        return trained_physics.step_time(self, feats)

    def decode_run_step_times(self, feats, offsets):
        # It depends on the batch only through integer sums: O(K), not O(K x slots).
        count = jnp.sum(feats.decode).astype(jnp.int64)
        ctx = jnp.sum(jnp.where(feats.decode, feats.progress, 0)) + offsets * count
        x = trained_physics.step_time_of_sums(self, trained_physics.decode_sums(count, ctx))
        return jnp.where(count > 0, x, 0.0)

    def queueing_time(self, input_len):
        return jnp.broadcast_to(self.alpha[0], input_len.shape)

    def post_decode_time(self):
        return self.alpha[1]


class RooflineModel(LatencyModel):
    """BLIS's roofline model (latency-models §1): one compute/memory crossover per step;
    enqueue waits α₀ + α₁·input_len, and nothing is added to E2E."""

    kind: ClassVar[str] = "roofline"

    def step_time(self, feats):
        return roofline.step_time(self, feats)

    def decode_run_step_times(self, feats, offsets):
        # Per-request float sums: each step on its own, as a single step would be (a vectorized
        # [K, slots] evaluation may round its sums differently).
        return jax.lax.map(lambda o: self.step_time(dataclasses.replace(feats, progress=feats.progress + o)), offsets)

    def queueing_time(self, input_len):
        return self.alpha[0] + self.alpha[1] * input_len

    def post_decode_time(self):
        return jnp.zeros((), jnp.float64)


_CLASS_OF_KIND = {cls.kind: cls for cls in (TrainedPhysicsModel, RooflineModel)}
KINDS = tuple(_CLASS_OF_KIND)


class PerSlotKindModel(LatencyModel):
    """A cluster whose PD pools use different backends (`--prefill-latency-model roofline`
    with a trained-physics decode pool, blis-features §3.10): one structure for every slot, so
    the slots still stack and vmap; `roofline` picks each slot's backend. Both backends are
    evaluated and one is kept, so only such clusters pay for the other."""

    kind: ClassVar[str] = "per-slot"
    roofline: Array  # bool scalar: this slot runs the roofline backend

    def step_time(self, feats):
        return jnp.where(self.roofline, roofline.step_time(self, feats), trained_physics.step_time(self, feats))

    def decode_run_step_times(self, feats, offsets):
        physics = TrainedPhysicsModel.decode_run_step_times(self, feats, offsets)
        rl = jax.lax.map(lambda o: roofline.step_time(self, dataclasses.replace(feats, progress=feats.progress + o)),
                         offsets)
        return jnp.where(self.roofline, rl, physics)

    def queueing_time(self, input_len):
        return jnp.where(self.roofline, self.alpha[0] + self.alpha[1] * input_len,
                         jnp.broadcast_to(self.alpha[0], input_len.shape))

    def post_decode_time(self):
        return jnp.where(self.roofline, 0.0, self.alpha[1])


def per_slot_kinds(models: list[LatencyModel]) -> list[LatencyModel]:
    """`models` (one per deployment option) with one structure: unchanged when they share one,
    else each as a `PerSlotKindModel`. Only the backend may differ (the model's MoE family and
    a trained-physics beta count are structure shared by every slot)."""
    if len({jax.tree.structure(m) for m in models}) == 1:
        return models
    betas = {m.num_betas for m in models if m.kind == "trained-physics"}
    if len(betas) > 1 or len({m.moe_comm for m in models}) > 1 or any(
            m.kind not in KINDS for m in models):
        raise ConfigError("the PD pools' latency models differ in more than their backend (trained-physics "
                          "beta count or MoE family); give every pool the same coefficients")
    num_betas = betas.pop() if betas else 0
    out = []
    for m in models:
        fields = {f.name: getattr(m, f.name) for f in dataclasses.fields(m)}
        fields.update(num_betas=num_betas, roofline=jnp.asarray(m.kind == "roofline"))
        out.append(PerSlotKindModel(**fields))
    return out


def _f64(x) -> Float[Array, ""]:
    return jnp.asarray(x, dtype=jnp.float64)


def _moe_family(backend: str) -> str:
    if backend in _ALLGATHER:
        return "allgather"
    if backend in _ALL2ALL or backend.startswith("deepep_"):
        return "all2all"
    raise ConfigError(
        f"moe_backend {backend!r} is unknown; use one of {', '.join(_ALLGATHER + _ALL2ALL)} "
        "or deepep_*"
    )


def build_latency_model(
    kind: str,
    arch: ModelArch,
    gpu: GPUSpec,
    tp: int = 1,
    alpha=None,
    beta=None,
    dp: int = 1,
    moe_backend: str = "allgather_reducescatter",
) -> LatencyModel:
    """Turn validated config objects into a `LatencyModel`.

    Trained-physics takes a missing alpha or beta from the default coefficient file
    (`config.coefficients.default_coefficient_path`); roofline defaults alpha to zeros and takes no
    beta. Equal arguments give the same (immutable) model: a sweep builds it once, not once per
    scenario.
    """
    if kind == "trained-physics" and (alpha is None or beta is None):
        # resolved before the cache: the default can change ($BLIS_JAX_COEFFICIENTS)
        default = load_coefficients()
        alpha = default.alpha if alpha is None else alpha
        beta = default.beta if beta is None else beta
    args = (kind, arch, gpu, tp, None if alpha is None else tuple(alpha), None if beta is None else tuple(beta),
            dp, moe_backend)
    # types too: True == 1 == 1.0, but only some of them are valid
    types = tuple(map(type, args)) + tuple(type(c) for c in (*(args[4] or ()), *(args[5] or ())))
    try:
        hash(args)
    except TypeError:  # unhashable coefficients (nested lists): validated and built uncached
        return _build_latency_model(kind, arch, gpu, tp, alpha, beta, dp, moe_backend)
    return _cached_latency_model(args, types)


@functools.lru_cache(maxsize=64)
def _cached_latency_model(args, types) -> LatencyModel:
    return _build_latency_model(*args)


def _build_latency_model(kind, arch, gpu, tp, alpha, beta, dp, moe_backend) -> LatencyModel:
    if kind not in KINDS:
        raise ConfigError(f"latency model kind {kind!r} is unknown; use one of {KINDS}")
    for label, value in (("tp", tp), ("dp", dp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{label} = {value!r} must be an integer >= 1")
    moe_comm = _moe_family(moe_backend)

    if kind == "trained-physics":
        alpha, beta = check_alpha(alpha), check_beta(beta)
        for label, heads in (("num_heads", arch.num_heads), ("num_kv_heads", arch.num_kv_heads)):
            if heads % tp:
                raise ConfigError(
                    f"model {arch.hf_id!r}: {label} {heads} is not divisible by tp {tp}; "
                    "trained-physics needs whole heads per GPU (choose a tp that divides it)"
                )
        if arch.intermediate_size <= 0:
            raise ConfigError(
                f"model {arch.hf_id!r}: intermediate_size is 0 or missing; trained-physics "
                "needs the FFN dimension (add intermediate_size to the config)"
            )
        ffn = arch.intermediate_size
        num_betas = len(beta)
    else:
        if beta is not None:
            raise ConfigError(
                "roofline takes no beta coefficients (they are trained-physics only); "
                "pass beta=None"
            )
        alpha = check_alpha(alpha if alpha is not None else (0.0,) * NUM_ALPHA)
        beta = ()
        num_betas = 0
        ffn = arch.intermediate_size or 4 * arch.hidden_size  # roofline's 4d fallback

    moe_ffn = arch.moe_intermediate_size or ffn
    return _CLASS_OF_KIND[kind](
        num_betas=num_betas,
        moe_comm=moe_comm,
        num_layers=_f64(arch.num_layers),
        hidden_size=_f64(arch.hidden_size),
        num_heads=_f64(arch.num_heads),
        num_kv_heads=_f64(arch.num_kv_heads),
        moe_ffn_dim=_f64(moe_ffn),
        dense_ffn_dim=_f64(arch.intermediate_size_mlp or ffn),
        shared_ffn_dim=_f64(arch.shared_ffn_dim),  # trained-physics only
        num_experts=_f64(arch.num_experts if arch.is_moe else 0),
        experts_per_tok=_f64(arch.num_experts_per_tok),
        interleave_step=_f64(arch.interleave_moe_layer_step),
        bytes_per_param=_f64(arch.bytes_per_param),
        weight_bytes_per_param=_f64(arch.weight_bytes_per_param),
        tflops_peak=_f64(gpu.tflops_peak),
        tflops_fp8=_f64(gpu.tflops_fp8),
        bandwidth_tbs=_f64(gpu.hbm_bandwidth_tbs),
        mfu_prefill=_f64(gpu.mfu_prefill),
        mfu_decode=_f64(gpu.mfu_decode),
        tp=_f64(tp),
        dp=_f64(dp),
        alpha=_f64(padded_alpha(alpha)),
        beta=_f64(np.pad(np.asarray(beta, dtype=np.float64), (0, NUM_BETA_SLOTS - len(beta)))),
    )


def with_coefficients(model: LatencyModel, alpha=None, beta=None) -> LatencyModel:
    """A copy with new coefficient arrays (traceable: use it inside jit/vmap/grad).

    ``beta`` may have ``model.num_betas`` or 11 entries; shorter ones are zero-padded.
    The mode (``num_betas``) is structure and does not change.
    """
    if alpha is not None:
        alpha = jnp.asarray(alpha, dtype=jnp.float64)
        if alpha.shape == (BLIS_NUM_ALPHA,):  # no first-token lag
            alpha = jnp.pad(alpha, (0, NUM_ALPHA - BLIS_NUM_ALPHA))
        if alpha.shape != (NUM_ALPHA,):
            raise ConfigError(f"alpha must have shape (3,) or (4,), got {alpha.shape}")
        model = eqx.tree_at(lambda m: m.alpha, model, alpha)
    if beta is not None:
        beta = jnp.asarray(beta, dtype=jnp.float64)
        if beta.ndim != 1 or beta.shape[0] > NUM_BETA_SLOTS:
            raise ConfigError(f"beta must be a vector of at most 11 values, got {beta.shape}")
        beta = jnp.pad(beta, (0, NUM_BETA_SLOTS - beta.shape[0]))
        model = eqx.tree_at(lambda m: m.beta, model, beta)
    return model


# ---------------------------------------------------------------------------------------
# Float (differentiable) values


def step_time_float(model: LatencyModel, feats: BatchFeatures) -> Float[Array, ""]:
    """Step time in µs before truncation (0.0 for an empty batch)."""
    return model.step_time(feats)


def queueing_time_float(model: LatencyModel, input_len: ArrayLike) -> Float[Array, "..."]:
    """Arrival → enqueue delay: α0 (trained-physics) or α0 + α1·input_len (roofline)."""
    return model.queueing_time(jnp.asarray(input_len).astype(jnp.float64))


def output_token_time_float(model: LatencyModel) -> Float[Array, ""]:
    """α2: added to TTFT and to every ITL sample."""
    return model.alpha[2]


def first_token_lag_float(model: LatencyModel, step_us: ArrayLike) -> Float[Array, "..."]:
    """α₃·(step µs): how long after the step that produced it the first token reaches the client
    (later tokens keep their ITLs, so E2E = TTFT + ITLs + α₁ shifts by the same lag). BLIS
    stamps TTFT at that step's end (α₃ = 0). vLLM hands outputs to a separate API-server process
    that detokenises and streams them while the engine runs the next step, so the observed TTFT
    is about one step longer (README, fit)."""
    return model.alpha[3] * jnp.asarray(step_us).astype(jnp.float64)


def post_decode_time_float(model: LatencyModel) -> Float[Array, ""]:
    """Added once to E2E: α1 (trained-physics) or 0 (roofline)."""
    return model.post_decode_time()


# ---------------------------------------------------------------------------------------
# Integer µs (parity with BLIS)


def truncate_us(x: Float[Array, "..."]) -> Int[Array, "..."]:
    """Go ``int64(x)``: truncate toward zero; NaN and overflow clamp to MaxInt64."""
    high = jnp.isnan(x) | (x >= 2.0**63)
    low = x < -(2.0**63)
    safe = jnp.where(high | low, 0.0, x)
    out = jnp.trunc(safe).astype(jnp.int64)
    out = jnp.where(high, jnp.int64(_INT64_MAX), out)
    return jnp.where(low, jnp.int64(_INT64_MIN), out)


def step_time_us(model: LatencyModel, feats: BatchFeatures) -> Int[Array, ""]:
    """Step time as BLIS reports it: max(1, trunc(µs)); an empty batch gives 1."""
    return jnp.maximum(jnp.int64(1), truncate_us(step_time_float(model, feats)))


def decode_run_step_times_us(model: LatencyModel, feats: BatchFeatures, offsets) -> Int[Array, " K"]:
    """`step_time_us` of the decode-only batch `feats` with every context grown by each of
    `offsets` [K] (the steps of a decode run; engine/coast.py)."""
    x = model.decode_run_step_times(feats, jnp.asarray(offsets, jnp.int64))
    return jnp.maximum(jnp.int64(1), truncate_us(x))


def queueing_time_us(model: LatencyModel, input_len: ArrayLike) -> Int[Array, "..."]:
    """trunc(α0) for trained-physics, trunc(α0 + α1·input_len) for roofline."""
    return truncate_us(queueing_time_float(model, input_len))


def output_token_time_us(model: LatencyModel) -> Int[Array, ""]:
    """trunc(α2)."""
    return truncate_us(output_token_time_float(model))


def first_token_lag_us(model: LatencyModel, step_us: ArrayLike) -> Int[Array, "..."]:
    """trunc(α₃·step_us): 0 with BLIS's coefficients."""
    return truncate_us(first_token_lag_float(model, step_us))


def post_decode_time_us(model: LatencyModel) -> Int[Array, ""]:
    """trunc(α1) for trained-physics, 0 for roofline."""
    return truncate_us(post_decode_time_float(model))
