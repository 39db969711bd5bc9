"""Latency models: spec worked numbers, BLIS goldens, and the JAX contract
(jit == eager, vmap == loop, gradients == finite differences, no retrace)."""

import dataclasses

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blis_jax import latency
from blis_jax.config import GPUSpec, ModelArch, load_coefficients, load_gpu, load_model
from blis_jax.errors import ConfigError
from blis_jax.latency import (
    BatchFeatures,
    build_latency_model,
    make_batch_features,
    output_token_time_float,
    output_token_time_us,
    post_decode_time_float,
    post_decode_time_us,
    queueing_time_float,
    queueing_time_us,
    truncate_us,
    with_coefficients,
)

# Jitted once per model structure and batch shape: eager op-by-op dispatch would dominate
# the test time. `test_jit_equals_eager` checks the un-jitted functions give the same.
step_time_float = jax.jit(latency.step_time_float)
step_time_us = jax.jit(latency.step_time_us)
trained_physics_basis = jax.jit(latency.trained_physics_basis)

SLOTS = 32  # one padded batch shape for every test: fewer compilations
LLAMA8B = "meta-llama/Llama-3.1-8B-Instruct"
SCOUT = "RedHatAI/Llama-4-Scout-17B-16E-Instruct-FP8-dynamic"


def batch(new_tokens, progress, input_len):
    """Requests → features padded to SLOTS (scheduled iff new_tokens > 0)."""
    return make_batch_features(new_tokens, progress, input_len, num_slots=SLOTS)


def prefill_512():
    """Spec §7 (a): one request, prompt 512, progress 0, 512 new tokens."""
    return batch([512], [0], [512])


def decode_32x1024():
    """Spec §7 (b): 32 decodes at ProgressIndex 1024 (prompt shorter than that)."""
    return batch([1] * 32, [1024] * 32, [512] * 32)


def us(model, feats) -> int:
    return int(step_time_us(model, feats))


# --------------------------------------------------------------------------- worked numbers


@pytest.mark.parametrize("tp, prefill, decode", [(1, 7965, 9470), (2, 4621, 5386)])
def test_spec7_llama8b_trained_physics(tp, prefill, decode):
    model = build_latency_model("trained-physics", load_model(LLAMA8B), load_gpu("H100"), tp)
    assert us(model, prefill_512()) == prefill
    assert us(model, decode_32x1024()) == decode


def test_spec7_basis_values():
    model = build_latency_model("trained-physics", load_model(LLAMA8B), load_gpu("H100"), 1)
    a = trained_physics_basis(model, prefill_512())
    b = trained_physics_basis(model, decode_32x1024())
    # spec §7 tables (4 decimals)
    assert float(a["pf_compute"]) == pytest.approx(7431.0096, abs=1e-4)
    assert float(a["pf_kv"]) == pytest.approx(20.0325, abs=1e-4)
    assert float(a["weight"]) == pytest.approx(4166.7593, abs=1e-4)
    assert float(a["tp_comm"]) == 0.0
    assert float(b["dc_compute"]) == pytest.approx(468.7786, abs=1e-4)
    assert float(b["dc_kv"]) == pytest.approx(1283.3318, abs=1e-4)
    assert float(step_time_float(model, prefill_512())) == pytest.approx(7965.2923, abs=1e-4)
    assert float(step_time_float(model, decode_32x1024())) == pytest.approx(9470.5351, abs=1e-4)
    tp2 = build_latency_model("trained-physics", load_model(LLAMA8B), load_gpu("H100"), 2)
    assert float(trained_physics_basis(tp2, prefill_512())["tp_comm"]) == pytest.approx(
        80.1300, abs=1e-4
    )
    assert float(trained_physics_basis(tp2, decode_32x1024())["tp_comm"]) == pytest.approx(
        5.0081, abs=1e-4
    )


def synthetic_dense():
    """BLIS INV BC-DP1 fixture: L32 d4096 H32 Hkv8 dff14336 bf16 (spec §5.5)."""
    return ModelArch(
        name="synthetic",
        hf_id="test/synthetic",
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        intermediate_size=14336,
        bytes_per_param=2.0,
        weight_bytes_per_param=2.0,
    )


H100_LIKE = GPUSpec(
    "H100-like",
    tflops_peak=989.0,
    tflops_fp8=0.0,
    hbm_bandwidth_tbs=3.35,
    mfu_prefill=0.55,
    mfu_decode=0.30,
)


def golden_batch():
    """3 prefills (input 128, progress 0, 128 new) + 5 decodes (input 256, progress 266)."""
    return batch([128] * 3 + [1] * 5, [0] * 3 + [266] * 5, [128] * 3 + [256] * 5)


@pytest.mark.parametrize("tp, expected", [(1, 7797), (2, 4538), (4, 2909), (8, 2094)])
def test_spec55_reference_golden(tp, expected):
    beta10 = load_coefficients().beta[:10]  # the golden uses the 10 iter29 betas
    model = build_latency_model("trained-physics", synthetic_dense(), H100_LIKE, tp, beta=beta10)
    assert model.num_betas == 10
    assert us(model, golden_batch()) == expected


def test_spec7_roofline_h100():
    model = build_latency_model("roofline", load_model(LLAMA8B), load_gpu("H100"), 1)
    assert us(model, prefill_512()) == 11884  # compute-bound
    assert us(model, decode_32x1024()) == 4330  # memory-bound
    assert float(step_time_float(model, prefill_512())) == pytest.approx(11884.95, abs=0.01)
    assert float(step_time_float(model, decode_32x1024())) == pytest.approx(4330.78, abs=0.01)


def test_spec7_scout_moe_check_case():
    # Not checked against the reference implementation by the spec; reproduced here.
    model = build_latency_model("trained-physics", load_model(SCOUT), load_gpu("H100"), 2)
    a = trained_physics_basis(model, batch([547], [0], [547]))
    assert float(a["pf_compute"]) == pytest.approx(3450.30, abs=0.01)  # FP8 rate (w = 1)
    assert float(a["weight"]) == pytest.approx(8563.89, abs=0.01)
    assert float(a["tp_comm"]) == pytest.approx(160.51, abs=0.01)  # incl. T_moe_reduce
    assert float(a["interleaved_moe_layers"]) == 24.0
    assert 481.8613888 * 24 == pytest.approx(11564.67, abs=0.01)
    assert us(model, batch([547], [0], [547])) == 25549
    assert us(model, decode_32x1024()) == 26922


def test_fp8_rate_only_for_one_byte_weights():
    scout, h100 = load_model(SCOUT), load_gpu("H100")
    feats = batch([547], [0], [547])
    fp8 = trained_physics_basis(build_latency_model("trained-physics", scout, h100, 2), feats)
    no_fp8_gpu = GPUSpec(**{**h100.__dict__, "tflops_fp8": 0.0})
    plain = trained_physics_basis(
        build_latency_model("trained-physics", scout, no_fp8_gpu, 2), feats
    )
    assert float(plain["pf_compute"] / fp8["pf_compute"]) == pytest.approx(
        1979.0 / 989.5, rel=1e-12
    )
    # 4-bit weights keep the 16-bit rate
    w4 = ModelArch(**{**scout.__dict__, "weight_bytes_per_param": 0.5})
    half = trained_physics_basis(build_latency_model("trained-physics", w4, h100, 2), feats)
    assert float(half["pf_compute"]) == pytest.approx(float(plain["pf_compute"]), rel=1e-12)


# --------------------------------------------------------------------------- semantics


def test_empty_batch_and_padding():
    tp_model = build_latency_model("trained-physics", load_model(LLAMA8B), load_gpu("H100"), 1)
    rf_model = build_latency_model("roofline", load_model(LLAMA8B), load_gpu("H100"), 1)
    empty = batch([0, 0], [5, 600], [512, 512])
    for model in (tp_model, rf_model):
        assert float(step_time_float(model, empty)) == 0.0
        assert us(model, empty) == 1
    # Padded slots hold junk but scheduled=False: they must contribute nothing.
    real = golden_batch()  # 8 requests padded to SLOTS
    n = 8

    def fill(x, values):
        x = np.array(x)
        x[n : n + len(values)] = values
        return jnp.asarray(x)

    junk = BatchFeatures(
        scheduled=real.scheduled,
        is_prefill=fill(real.is_prefill, [True, False, True, False]),
        new_tokens=fill(real.new_tokens, [999, 1, 7, 1]),
        progress=fill(real.progress, [0, 5000, 3, 77]),
        input_len=fill(real.input_len, [999, 10, 100, 7]),
    )
    for model in (tp_model, rf_model):
        assert float(step_time_float(model, junk)) == float(step_time_float(model, real))


def test_decode_counts_one_token_and_prefill_uses_full_prompt():
    model = build_latency_model("trained-physics", load_model(LLAMA8B), load_gpu("H100"), 1)
    rf = build_latency_model("roofline", load_model(LLAMA8B), load_gpu("H100"), 1)
    one = batch([1], [1024], [512])
    odd = batch([7], [1024], [512])  # decode with a junk NumNewTokens
    assert float(step_time_float(model, one)) == float(step_time_float(model, odd))
    assert float(step_time_float(rf, one)) == float(step_time_float(rf, odd))
    # Trained-physics prefill attention reads InputLen, not the chunk's progress.
    chunk_a = trained_physics_basis(model, batch([256], [0], [2048]))
    chunk_b = trained_physics_basis(model, batch([256], [1024], [2048]))
    assert float(chunk_a["pf_compute"]) == float(chunk_b["pf_compute"])


def test_alpha_terms():
    tp_model = build_latency_model("trained-physics", load_model(LLAMA8B), load_gpu("H100"), 1)
    # spec §2.4: α0 → 15563, α1 → 777, α2 → 45
    np.testing.assert_array_equal(queueing_time_us(tp_model, jnp.array([10, 5000])), [15563, 15563])
    assert int(post_decode_time_us(tp_model)) == 777
    assert int(output_token_time_us(tp_model)) == 45
    rf = build_latency_model(
        "roofline", load_model(LLAMA8B), load_gpu("H100"), 1, alpha=(1.5, 2.25, 3.9)
    )
    np.testing.assert_array_equal(
        queueing_time_us(rf, jnp.array([10, 3])), [24, 8]
    )  # trunc(1.5+2.25·n)
    assert int(output_token_time_us(rf)) == 3
    assert int(post_decode_time_us(rf)) == 0
    rf0 = build_latency_model("roofline", load_model(LLAMA8B), load_gpu("H100"), 1)
    assert int(queueing_time_us(rf0, 4000)) == 0  # CLI roofline: alpha defaults to zeros


def test_each_kind_is_its_own_final_class_and_the_base_is_abstract():
    arch, gpu = load_model(LLAMA8B), load_gpu("H100")
    tp_model = build_latency_model("trained-physics", arch, gpu, 1)
    rf = build_latency_model("roofline", arch, gpu, 1)
    assert type(tp_model) is latency.TrainedPhysicsModel and type(rf) is latency.RooflineModel
    assert (tp_model.kind, rf.kind) == ("trained-physics", "roofline")
    assert isinstance(tp_model, latency.LatencyModel) and isinstance(rf, latency.LatencyModel)
    # the kind is structure: two kinds never share a compiled program or a stacked pytree
    assert jax.tree.structure(tp_model) != jax.tree.structure(rf)
    fields = {f.name: getattr(rf, f.name) for f in dataclasses.fields(rf)}
    with pytest.raises(TypeError):
        latency.LatencyModel(**fields)
    # the decode-run shortcut equals one step per offset, for both kinds
    feats = decode_32x1024()
    for model in (tp_model, rf):
        run = latency.decode_run_step_times_us(model, feats, jnp.array([0, 1, 7]))
        one_by_one = [us(model, batch([1] * 32, [1024 + o] * 32, [512] * 32)) for o in (0, 1, 7)]
        assert run.tolist() == one_by_one


def test_truncation_like_go():
    x = jnp.array([2.9, -2.9, 0.0, jnp.nan, 1e30, -1e30])
    np.testing.assert_array_equal(truncate_us(x), [2, -2, 0, 2**63 - 1, 2**63 - 1, -(2**63)])


def test_beta_modes():
    arch, h100 = load_model(SCOUT), load_gpu("H100")
    feats = batch([300, 1, 1], [0, 900, 40], [300, 800, 20])
    beta = np.array(load_coefficients().beta)
    beta[1], beta[8] = 0.3, 0.2  # make every coefficient matter
    x = trained_physics_basis(build_latency_model("trained-physics", arch, h100, 2), feats)
    x = {k: float(v) for k, v in x.items()}

    def expected(n):
        b = beta[:n]
        pf = (
            b[0] * x["pf_compute"] + b[8] * x["pf_kv"]
            if n >= 9
            else b[0] * max(x["pf_compute"], x["pf_kv"])
        )
        dc = (
            b[1] * x["dc_compute"] + b[9] * x["dc_kv"]
            if n >= 10
            else b[1] * max(x["dc_compute"], x["dc_kv"])
        )
        ep = b[10] if n == 11 else b[3]
        moe = b[7] * x["interleaved_moe_layers"] if n >= 8 else 0.0
        return (
            pf
            + dc
            + b[2] * x["weight"]
            + b[3] * x["tp_comm"]
            + ep * x["moe_dispatch"]
            + b[4] * x["layers"]
            + b[5] * x["batch"]
            + b[6]
            + moe
        )

    for n in range(7, 12):
        model = build_latency_model("trained-physics", arch, h100, 2, beta=beta[:n])
        assert float(step_time_float(model, feats)) == pytest.approx(expected(n), rel=1e-12), n


def test_moe_dp_dispatch_families():
    mixtral, h100 = load_model("mistralai/Mixtral-8x7B-v0.1"), load_gpu("H100")
    feats = batch([64, 1], [0, 100], [64, 50])
    ag = trained_physics_basis(
        build_latency_model("trained-physics", mixtral, h100, 2, dp=2), feats
    )
    a2a = trained_physics_basis(
        build_latency_model(
            "trained-physics", mixtral, h100, 2, dp=2, moe_backend="deepep_low_latency"
        ),
        feats,
    )
    assert float(ag["moe_dispatch"]) > 0
    assert float(a2a["moe_dispatch"]) == pytest.approx(
        2 * float(ag["moe_dispatch"]), rel=1e-12
    )  # × k
    dp1 = trained_physics_basis(build_latency_model("trained-physics", mixtral, h100, 2), feats)
    assert float(dp1["moe_dispatch"]) == 0.0  # dispatch only with DP > 1
    # n_moe·x·d·b·2·(tp-1)/tp/W: dense attention + MoE reduce at DP 1 → V(2L, x) for uniform MoE
    x = 64 + 1
    v2l = 2 * 32 * x * 4096 * 2 * 2 * 0.5 / 3.35e6
    assert float(dp1["tp_comm"]) == pytest.approx(v2l, rel=1e-12)
    # Dense models ignore dp.
    llama = load_model(LLAMA8B)
    a = build_latency_model("trained-physics", llama, h100, 2)
    b = build_latency_model("trained-physics", llama, h100, 2, dp=4)
    assert float(step_time_float(a, feats)) == float(step_time_float(b, feats))


def test_roofline_moe_matches_spec_formula():
    # Mixtral (N 8, k 2) decode step on H100 TP2, computed from spec §1 by hand below.
    arch, h100 = load_model("mistralai/Mixtral-8x7B-v0.1"), load_gpu("H100")
    model = build_latency_model("roofline", arch, h100, 2)
    feats = batch([1] * 4, [700] * 4, [600] * 4)
    L, d, H, kvh, dff, N, k, b, w, tp = 32, 4096, 32, 8, 14336, 8, 2, 2, 2, 2
    dh = d / H
    dkv = kvh * dh
    n, s = 1, 700
    flops = (
        L * (2 * n * (d * d + 2 * d * dkv) + 2 * n * d * d)
        + L * 4 * H * n * s * dh
        + L * (5 * H * n * s + 2 * n * d)
        + L * 2 * n * (2 * d * dff) * k
    )
    compute = 4 * flops / (tp * 989.5e12 * 0.30)
    n_eff = N * (1 - ((N - k) / N) ** 4)
    weights = w * (L * (2 * d * d + 2 * d * dkv) + L * 2 * d * dff * n_eff)
    dynamic = 4 * (2 * L * kvh * dh * b * n + 2 * L * kvh * dh * b * s + L * d * b * n)
    memory = (weights / tp + dynamic / tp) / 3.35e12
    assert float(step_time_float(model, feats)) == pytest.approx(
        1e6 * max(compute, memory), rel=1e-12
    )


def test_roofline_zero_ffn_uses_4d():
    llama, h100 = load_model(LLAMA8B), load_gpu("H100")
    zero = ModelArch(**{**llama.__dict__, "intermediate_size": 0})
    four_d = ModelArch(**{**llama.__dict__, "intermediate_size": 4 * 4096})
    a = build_latency_model("roofline", zero, h100, 1)
    b = build_latency_model("roofline", four_d, h100, 1)
    assert float(step_time_float(a, prefill_512())) == float(step_time_float(b, prefill_512()))
    with pytest.raises(ConfigError, match="intermediate_size"):
        build_latency_model("trained-physics", zero, h100, 1)


def test_build_errors():
    llama, h100 = load_model(LLAMA8B), load_gpu("H100")
    with pytest.raises(ConfigError, match="num_heads 32 is not divisible by tp 3"):
        build_latency_model("trained-physics", llama, h100, 3)
    with pytest.raises(ConfigError, match="num_kv_heads 8 is not divisible by tp 16"):
        build_latency_model(
            "trained-physics", ModelArch(**{**llama.__dict__, "num_heads": 64}), h100, 16
        )
    with pytest.raises(ConfigError, match="7 to 11"):
        build_latency_model("trained-physics", llama, h100, 1, beta=[1.0] * 6)
    with pytest.raises(ConfigError, match=r"beta\[2\]"):
        build_latency_model("trained-physics", llama, h100, 1, beta=[1.0, 1.0, np.nan] + [1.0] * 7)
    with pytest.raises(ConfigError, match="roofline takes no beta"):
        build_latency_model("roofline", llama, h100, 1, beta=[1.0] * 10)
    with pytest.raises(ConfigError, match="kind"):
        build_latency_model("blackbox", llama, h100, 1)
    with pytest.raises(ConfigError, match="tp"):
        build_latency_model("trained-physics", llama, h100, 0)
    with pytest.raises(ConfigError, match="moe_backend"):
        build_latency_model("trained-physics", llama, h100, 1, moe_backend="carrier-pigeon")


# --------------------------------------------------------------------------- JAX contract


def _scout_dp2():
    # MoE + interleaved + TP + DP: every one of the 11 betas multiplies a nonzero basis.
    return build_latency_model("trained-physics", load_model(SCOUT), load_gpu("H100"), 2, dp=2)


def _mixed_batch():
    return batch([300, 1, 1, 0], [0, 900, 40, 0], [300, 800, 20, 0])


def _central_differences(fn, args, which, eps=1e-3):
    """d fn / d args[which][i] by central differences (fn is linear in coefficients)."""
    out = []
    for e in np.eye(args[which].shape[0]) * eps:
        plus, minus = list(args), list(args)
        plus[which], minus[which] = args[which] + e, args[which] - e
        out.append((float(fn(*plus)) - float(fn(*minus))) / (2 * eps))
    return np.array(out)


@pytest.mark.parametrize("kind", ["trained-physics", "roofline"])
def test_gradients_match_central_differences(kind):
    feats = _mixed_batch()
    input_len = jnp.array([300.0, 800.0])
    if kind == "trained-physics":
        model = _scout_dp2()
    else:
        model = build_latency_model(
            "roofline", load_model(SCOUT), load_gpu("H100"), 2, alpha=(5.0, 2.0, 1.0)
        )

    @jax.jit
    def total(alpha, beta):
        m = with_coefficients(model, alpha, beta)
        return (
            latency.step_time_float(m, feats)
            + jnp.sum(queueing_time_float(m, input_len))
            + output_token_time_float(m)
            + post_decode_time_float(m)
            + latency.first_token_lag_float(m, latency.step_time_float(m, feats))
        )

    alpha = np.asarray(model.alpha).copy()
    alpha[3] = 0.8   # a first-token lag, so its derivative (and its β cross term) is exercised
    args = (alpha, np.asarray(load_coefficients().beta))
    grads = jax.jit(jax.grad(total, argnums=(0, 1)))(*args)
    numeric = (_central_differences(total, args, 0), _central_differences(total, args, 1))
    chex.assert_trees_all_close(grads, numeric, rtol=1e-6, atol=1e-6)
    if kind == "trained-physics":
        assert bool(jnp.all(grads[1] != 0.0)), "every beta should matter in this batch"
        assert bool(jnp.all(grads[0] != 0.0))


def test_gradients_in_max_mode_match_central_differences():
    model = build_latency_model(
        "trained-physics", load_model(SCOUT), load_gpu("H100"), 2, beta=load_coefficients().beta[:7]
    )
    feats = _mixed_batch()
    f = jax.jit(lambda b: latency.step_time_float(with_coefficients(model, beta=b), feats))
    beta = np.asarray(model.beta)
    g = jax.jit(jax.grad(f))(beta)
    numeric = _central_differences(f, (beta,), 0)
    chex.assert_trees_all_close(g, numeric, rtol=1e-6, atol=1e-6)
    assert float(g[7]) == 0.0 and float(g[10]) == 0.0  # not part of the 7-beta form


def test_jit_equals_eager():
    feats = _mixed_batch()
    lagged = load_coefficients("fit-trainval15-open-loop-lag")   # with the first-token lag α₃
    for model in (
        _scout_dp2(),
        with_coefficients(_scout_dp2(), alpha=lagged.alpha, beta=lagged.beta),
        build_latency_model("roofline", load_model(SCOUT), load_gpu("H100"), 2),
    ):
        def times(m, f):
            step = latency.step_time_float(m, f)
            return (step, latency.step_time_us(m, f), latency.first_token_lag_float(m, step),
                    latency.first_token_lag_us(m, step))

        eager = times(model, feats)
        jitted = eqx.filter_jit(times)(model, feats)
        chex.assert_trees_all_close(eager, jitted, rtol=1e-14)
        assert int(eager[1]) == int(jitted[1]) and int(eager[3]) == int(jitted[3])
    assert float(times(with_coefficients(_scout_dp2(), alpha=lagged.alpha, beta=lagged.beta), feats)[2]) > 0


def test_vmap_over_coefficient_sets_equals_loop():
    model = _scout_dp2()
    feats = _mixed_batch()
    rng = np.random.default_rng(0)
    betas = jnp.asarray(np.array(load_coefficients().beta) * rng.uniform(0.5, 1.5, size=(64, 11)))
    alphas = jnp.asarray(np.array([1e4, 500.0, 50.0, 0.0]) * rng.uniform(0.5, 1.5, size=(64, 4))
                         + np.array([0.0, 0.0, 0.0, 1.0]) * rng.uniform(0.0, 1.5, size=(64, 1)))   # α₃ too

    def one(a, b):
        m = with_coefficients(model, alpha=a, beta=b)
        return latency.step_time_us(m, feats), latency.first_token_lag_us(m, latency.step_time_us(m, feats))

    one = jax.jit(one)
    batched = jax.jit(jax.vmap(one))(alphas, betas)
    looped = [jnp.stack(x) for x in zip(*(one(a, b) for a, b in zip(alphas, betas)))]
    np.testing.assert_array_equal(batched[0], looped[0])
    np.testing.assert_array_equal(batched[1], looped[1])
    assert batched[0].dtype == jnp.int64 and len(set(np.asarray(batched[1]).tolist())) > 1


def test_vmap_over_batches():
    model = build_latency_model("trained-physics", load_model(LLAMA8B), load_gpu("H100"), 1)
    a = batch([512], [0], [512])
    b = decode_32x1024()
    stacked = jax.tree.map(lambda x, y: jnp.stack([x, y]), a, b)
    batched = jax.jit(jax.vmap(latency.step_time_us, in_axes=(None, 0)))(model, stacked)
    np.testing.assert_array_equal(batched, [7965, 9470])


def test_new_values_do_not_retrace():
    @jax.jit
    @chex.assert_max_traces(n=1)
    def run(model, feats):
        return latency.step_time_us(model, feats)

    arch, gpu = load_model(LLAMA8B), load_gpu("H100")
    base = build_latency_model("trained-physics", arch, gpu, 1)
    run(base, prefill_512())
    run(with_coefficients(base, beta=base.beta * 1.1), prefill_512())
    run(with_coefficients(base, alpha=base.alpha + 1.0), prefill_512())
    # Other numbers (TP, hardware, architecture figures) are arrays too.
    run(build_latency_model("trained-physics", arch, gpu, 2), prefill_512())
    run(build_latency_model("trained-physics", arch, load_gpu("A100-80"), 4), prefill_512())
    run(build_latency_model("trained-physics", load_model("Qwen/Qwen3-14B"), gpu, 1), prefill_512())
