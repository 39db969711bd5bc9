"""Fitting trained-physics coefficients to observed mean latencies (`blis-jax fit`).

The loss (fit/observed.py) is a function of simulated *means*, and a simulation is piecewise
constant in the coefficients (integer µs, discrete batching), so there is no useful gradient
through the engine. The driver alternates two loops:

* **outer**: simulate every experiment at the current coefficients (`simulate_traced`) and keep
  its schedule (`ScheduleTrace`); the loss of these simulations is the only loss ever reported;
* **inner**: optax adam on the same loss formula, with each experiment's mean TTFT / E2E
  predicted on the frozen schedule: by `local.predict_latencies_local` (default; each request's
  wait is local to its own window) or `schedule.predict_latencies` (``--schedule-model
  chained``; step starts chained through busy periods, which overstates TTFT sensitivities
  under sustained load, see fit/local.py). Both are affine in (α, β) with the schedule fixed, so
  the means are exactly ``m_sim + J·(θ − θ_sim)``, J their Jacobian (one reverse pass per
  mean), plus ``Δα₃·(H·Δβ)`` when the first-token lag α₃ is used (α₃ multiplies the first-token
  step's duration, which is affine in β: H is the mean basis of those steps); thousands of adam
  steps then cost milliseconds. The proposal is checked once against
  the latency function itself.

Coefficients are optimized in a bounded transformed space: each free coefficient is
``lo + (hi − lo)·sigmoid(u)`` with [lo, hi] the user bounds (default [0, ∞)) intersected with a
trust region around the current value (a factor e^±r about lo). A proposal is re-simulated; if
its simulated loss is better it becomes the new point, otherwise r is halved and the search
restarts from the best point (whose schedule is kept). The fit stops after `outer` proposals or
`patience` consecutive proposals without improvement.

θ is the flat coefficient vector: α₀..α₃ then β slots 0..10 (15 values); α₃, blis-jax's
first-token lag (config/coefficients.py), is 0 for a BLIS start file, and betas beyond the start
file's count stay 0. Names accepted for coefficients: ``alpha0..alpha3``, ``beta0..beta10`` (the
slice index of the YAML list) and BLIS's names ``b1a b2a b3 b4 b5 b6 b7 b8 b1b b2b bEP`` (so
``beta2`` and ``b3`` are both weight loading; see the index map in fits/*.yaml).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from blis_jax.config.coefficients import NUM_ALPHA, Coefficients, padded_alpha
from blis_jax.errors import ConfigError, SimulationFailed
from blis_jax.fit.observed import ObservedExperiment, loss_terms
from blis_jax.naming import naming
from blis_jax.scenario import Deployment, EngineSettings, ResolvedScenario, ScenarioConfig, SpecWorkload, resolve
from blis_jax.scenario.resolve import Warn

NUM_BETA = 11
LAG = 3   # θ index of α₃, the first-token lag
NUM_COEFFS = NUM_ALPHA + NUM_BETA
BLIS_BETA_NAMES = ("b1a", "b2a", "b3", "b4", "b5", "b6", "b7", "b8", "b1b", "b2b", "bEP")
# An accepted step that realises this share of its predicted improvement doubles the trust
# radius again (up to --trust), as trust-region methods do.
GOOD_AGREEMENT = 0.75
LOAD_GENERATORS = ("blis", "open-loop")   # --load-generator: how inference-perf multi-turn chat is simulated
OUTPUT_LENGTHS = ("configured", "observed")   # --output-lengths: tokens each simulated request generates
MIN_FIT_BETAS = 10   # step time is linear in β only in the split modes (10 or 11 betas)
RELATIVE_CHECK = 1e-6  # affine model vs the fixed-schedule latencies at the proposal (relative)

Progress = Callable[[str], None]


# --------------------------------------------------------------------------- coefficient names


def coefficient_name(k: int) -> str:
    """Canonical name of flat index k: alpha0..3, beta0..10."""
    return f"alpha{k}" if k < NUM_ALPHA else f"beta{k - NUM_ALPHA}"


def coefficient_label(k: int) -> str:
    """Name with BLIS's beta name, for tables: 'beta2 (b3)'."""
    if k == LAG:
        return f"{coefficient_name(k)} (first-token lag)"
    return coefficient_name(k) if k < NUM_ALPHA else f"{coefficient_name(k)} ({BLIS_BETA_NAMES[k - NUM_ALPHA]})"


def _name_index(name: str, num_betas: int, flag: str) -> int:
    key = name.strip().lower()
    if m := re.fullmatch(r"alpha(\d+)", key):
        k = int(m.group(1))
        if k < NUM_ALPHA:
            return k
    elif m := re.fullmatch(r"beta(\d+)", key):
        k = NUM_ALPHA + int(m.group(1))
    elif key in (b.lower() for b in BLIS_BETA_NAMES):
        k = NUM_ALPHA + [b.lower() for b in BLIS_BETA_NAMES].index(key)
    else:
        k = -1
    if NUM_ALPHA <= k < NUM_ALPHA + num_betas:
        return k
    if NUM_ALPHA + num_betas <= k < NUM_COEFFS:
        raise ConfigError(f"{flag}: {name.strip()!r} is beta slot {k - NUM_ALPHA}, but the start coefficients "
                          f"have {num_betas} betas; use a start file with {k - NUM_ALPHA + 1} or more")
    raise ConfigError(f"{flag}: unknown coefficient {name.strip()!r}; use alpha0..alpha3, beta0..beta{num_betas - 1} "
                      f"(slice index) or BLIS's names {', '.join(BLIS_BETA_NAMES[:num_betas])}")


def parse_params(text: str | None, start: np.ndarray, num_betas: int, flag: str = "--params") -> list[int]:
    """Flat indices to fit. None: every coefficient of the mode that is non-zero in the start
    (a zero usually means the term is switched off); 'all': every coefficient of the mode, the
    first-token lag α₃ (a blis-jax extension) only if the start uses it; names: those."""
    mode = [k for k in range(NUM_ALPHA + num_betas) if k != LAG or start[LAG] != 0.0]
    if text is None:
        return [k for k in mode if start[k] != 0.0]
    names = [n for n in text.split(",") if n.strip()]
    if not names:
        raise ConfigError(f"{flag}: empty list; give coefficient names such as alpha0,beta2,b6 or 'all'")
    if [n.strip().lower() for n in names] == ["all"]:
        return mode
    out: list[int] = []
    for n in names:
        k = _name_index(n, num_betas, flag)
        if k in out:
            raise ConfigError(f"{flag}: {coefficient_name(k)} is listed twice ({n.strip()!r})")
        out.append(k)
    return sorted(out)


def parse_bounds(text: str | None, free: Sequence[int], num_betas: int,
                 flag: str = "--bounds") -> tuple[np.ndarray, np.ndarray]:
    """(lo[15], hi[15]): default [0, ∞) for every coefficient; 'name=LO:HI' entries (either side
    may be empty) narrow it. Only fitted coefficients may be bounded."""
    lo, hi = np.zeros(NUM_COEFFS), np.full(NUM_COEFFS, np.inf)
    if not text:
        return lo, hi
    for entry in (e for e in text.split(",") if e.strip()):
        name, sep, rng = entry.partition("=")
        lo_text, colon, hi_text = rng.partition(":")
        if not sep or not colon:
            raise ConfigError(f"{flag}: {entry.strip()!r} is not NAME=LO:HI (e.g. b3=0.5:3, alpha0=:20000)")
        k = _name_index(name, num_betas, flag)
        if k not in free:
            raise ConfigError(f"{flag}: {coefficient_name(k)} is not fitted; add it to --params or drop its bounds")
        for side, value, target in (("lower", lo_text, lo), ("upper", hi_text, hi)):
            if value.strip():
                try:
                    target[k] = float(value)
                except ValueError:
                    raise ConfigError(f"{flag}: {entry.strip()!r}: {side} bound {value.strip()!r} is not a number") from None
        if not (math.isfinite(lo[k]) and lo[k] >= 0):
            raise ConfigError(f"{flag}: {entry.strip()!r}: the lower bound must be a finite number >= 0 "
                              "(coefficients are non-negative)")
        if not hi[k] > lo[k]:
            raise ConfigError(f"{flag}: {entry.strip()!r}: the upper bound must exceed the lower bound")
    return lo, hi


def start_vector(coeffs: Coefficients, flag: str = "--start") -> tuple[np.ndarray, int]:
    """(θ[15], number of betas) of a coefficient file; the fit needs the linear (split) modes."""
    kind = coeffs.provenance.get("kind", "trained-physics")
    if kind != "trained-physics":
        raise ConfigError(f"{flag}: kind {kind!r}; only trained-physics coefficients can be fitted")
    nb = len(coeffs.beta)
    if nb < MIN_FIT_BETAS:
        raise ConfigError(f"{flag}: {nb} betas select the max-form prefill/decode mode, which the fixed-schedule "
                          f"model does not cover; give {MIN_FIT_BETAS} or 11 betas (append zeros for β1b/β2b)")
    theta = np.zeros(NUM_COEFFS)
    theta[:NUM_ALPHA] = padded_alpha(coeffs.alpha)
    theta[NUM_ALPHA:NUM_ALPHA + nb] = coeffs.beta
    if (theta < 0).any():
        k = int(np.flatnonzero(theta < 0)[0])
        raise ConfigError(f"{flag}: {coefficient_name(k)} = {theta[k]:g} is negative; the fit keeps coefficients >= 0")
    return theta, nb


def split(theta: np.ndarray, num_betas: int) -> tuple[list[float], list[float]]:
    """(alpha, beta) lists of θ in the coefficient-file layout: BLIS's three alphas while the
    first-token lag is 0 (the file stays BLIS-compatible), four otherwise."""
    alpha = [float(x) for x in theta[:NUM_ALPHA]]
    return alpha if alpha[LAG] != 0.0 else alpha[:LAG], [float(x) for x in theta[NUM_ALPHA:NUM_ALPHA + num_betas]]


# --------------------------------------------------------------------------- experiments


@dataclasses.dataclass(frozen=True, eq=False)
class Prepared:
    """An observed experiment and its scenario, resolved as `blis-jax run` would resolve its
    config (the coefficients of the scenario are the start's; `simulate` replaces them)."""

    obs: ObservedExperiment
    scenario: ResolvedScenario

    @property
    def id(self) -> str:
        return self.obs.id

    @property
    def model(self) -> str:
        return self.obs.model


def _fmt(values) -> str:
    return ",".join(repr(float(v)) for v in values)


# An observed experiment's fields by their name in the observed file, for resolution errors.
OBSERVED_FIELD_NAMES = {
    "deployment.model": "config.model", "deployment.hardware": "config.hardware", "deployment.tp": "config.tp",
    "deployment.total_kv_blocks": "config.total_kv_blocks", "engine.max_num_seqs": "config.max_num_seqs",
    "engine.max_num_batched_tokens": "config.max_num_batched_tokens", "workload.spec": "config.workload",
}


def observed_workload(workload: dict, load_generator: str = "blis", output_len: int | None = None) -> dict:
    """The workload spec to simulate for an observed experiment under `load_generator`.

    "blis": as recorded (BLIS's encoding: inference-perf multi-turn chat as closed-loop sessions).
    "open-loop": inference-perf multi-turn chat with `inference_perf.multi_turn_mode: open-loop`
    (Poisson arrivals at the stage rate, as inference-perf's generator sent them); workloads without
    multi-turn inference-perf chat are open-loop already and stay as recorded.
    `output_len` (None: as configured) replaces the configured output tokens per request."""
    if load_generator not in LOAD_GENERATORS:
        raise ConfigError(f"--load-generator {load_generator!r}: use one of {', '.join(LOAD_GENERATORS)}")
    ip = workload.get("inference_perf")
    shared = ip.get("shared_prefix") if isinstance(ip, dict) else None
    if output_len is not None:
        if not isinstance(shared, dict):
            raise ConfigError("--output-lengths observed: the workload has no inference_perf.shared_prefix "
                              "whose output_len could be set; use --output-lengths configured")
        shared = {**shared, "output_len": int(output_len)}
        ip = {**ip, "shared_prefix": shared}
        workload = {**workload, "inference_perf": ip}
    if load_generator == "blis" or not isinstance(shared, dict) or not shared.get("enable_multi_turn_chat"):
        return workload
    return {**workload, "inference_perf": {**ip, "multi_turn_mode": "open-loop"}}


def simulated_output_len(obs: ObservedExperiment, output_lengths: str) -> int | None:
    """The output tokens per request to simulate: None keeps the configured length; "observed"
    takes the run's observed mean (real runs stop short of the configured length, by ~20 % for
    Llama-2-7B, which a configured-length simulation reads as slower decoding)."""
    if output_lengths not in OUTPUT_LENGTHS:
        raise ConfigError(f"--output-lengths {output_lengths!r}: use one of {', '.join(OUTPUT_LENGTHS)}")
    if output_lengths == "configured":
        return None
    if obs.output_len_mean is None:
        raise ConfigError(f"--output-lengths observed: experiment {obs.id} has no observed.output_len_mean; "
                          "add it to the observed file or use --output-lengths configured")
    return max(1, round(obs.output_len_mean))


def scenario_config(obs: ObservedExperiment, workload: dict, alpha, beta) -> ScenarioConfig:
    """The scenario of an observed experiment with `workload` (see `observed_workload`) and
    trained-physics coefficients (alpha, beta); no seed: the workload spec's own is used."""
    return ScenarioConfig(
        deployment=Deployment(model=obs.model, hardware=obs.hardware, tp=obs.tp, latency_model="trained-physics",
                              alpha=tuple(alpha), beta=tuple(beta), total_kv_blocks=obs.total_kv_blocks),
        engine=EngineSettings(max_num_seqs=obs.max_num_seqs, max_num_batched_tokens=obs.max_num_batched_tokens),
        workload=SpecWorkload(spec=workload))


def prepare(experiments: Sequence[ObservedExperiment], theta: np.ndarray, num_betas: int,
            load_generator: str = "blis", output_lengths: str = "configured", *,
            warn: Warn | None = None) -> list[Prepared]:
    """Resolve each experiment with the start coefficients; `load_generator` as in
    `observed_workload`, `output_lengths` as in `simulated_output_len`, `warn` as in
    `scenario.resolve`. Errors name the experiment and its field in the observed file."""
    alpha, beta = split(theta, num_betas)
    out = []
    for o in experiments:
        workload = observed_workload(o.workload, load_generator, simulated_output_len(o, output_lengths))
        try:
            with naming(OBSERVED_FIELD_NAMES):
                scenario = resolve(scenario_config(o, workload, alpha, beta), warn=warn)
        except ConfigError as e:
            raise ConfigError(f"observed experiment {o.id}: {e}") from None
        out.append(Prepared(o, scenario))
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class SimResult:
    ttft_mean_ms: float
    e2e_mean_ms: float
    completed: int
    requests: int
    wall_s: float
    trace: object | None     # ScheduleTrace


def simulate(p: Prepared, theta: np.ndarray, *, with_trace: bool = True) -> SimResult:
    """Simulate one experiment at θ; the means are those `blis-jax run` reports."""
    from blis_jax.engine.simulate import simulate_traced
    from blis_jax.fit.schedule import schedule_trace
    from blis_jax.metrics import metrics_output

    nb = p.scenario.latency_model.num_betas
    sc = p.scenario.with_coefficients(alpha=np.asarray(theta[:NUM_ALPHA], np.float64),
                                      beta=np.asarray(theta[NUM_ALPHA:NUM_ALPHA + nb], np.float64))
    model = sc.latency_model
    t0 = time.perf_counter()
    final, out, trace = simulate_traced(sc.requests, sc.sessions, sc.params, model, block_size=sc.block_size,
                                        scheduler=sc.scheduler, preemption_policy=sc.preemption_policy)
    if out.result != 0:
        from blis_jax.engine import results as result_codes

        raise SimulationFailed(f"experiment {p.id}: the engine stopped early ({result_codes.describe(out.result)})")
    m = metrics_output(out, final)
    if m["completed_requests"] == 0:
        raise ConfigError(f"experiment {p.id}: no request completed with coefficients {_fmt(theta)}; "
                          "the loss needs completed requests")
    st = schedule_trace(final, out, trace, model) if with_trace else None
    return SimResult(ttft_mean_ms=float(m["ttft_mean_ms"]), e2e_mean_ms=float(m["e2e_mean_ms"]),
                     completed=int(m["completed_requests"]), requests=len(final),
                     wall_s=time.perf_counter() - t0, trace=st)


class Simulator:
    """Simulations with a cache of their means; traces are kept only for `keep` (the start
    point, shared by cross-validation folds) — a fit holds its own current traces."""

    def __init__(self, progress: Progress | None = None, keep: np.ndarray | None = None) -> None:
        self.progress = progress
        self.keep = None if keep is None else np.asarray(keep, np.float64).copy()
        self.cache: dict[tuple[str, bytes], SimResult] = {}
        self.runs = 0

    def __call__(self, p: Prepared, theta: np.ndarray, with_trace: bool = True) -> SimResult:
        theta = np.asarray(theta, np.float64)
        key = (p.id, theta.tobytes())
        hit = self.cache.get(key)
        if hit is not None and (hit.trace is not None or not with_trace):
            return hit
        r = simulate(p, theta, with_trace=with_trace)
        self.runs += 1
        if self.progress is not None:
            self.progress(f"  simulated {p.id} ({r.requests} requests) in {r.wall_s:.1f} s: "
                          f"TTFT {r.ttft_mean_ms:.2f} ms (obs {p.obs.ttft_mean_ms:.2f}), "
                          f"E2E {r.e2e_mean_ms:.1f} ms (obs {p.obs.e2e_mean_ms:.1f})")
        keep_trace = self.keep is not None and np.array_equal(theta, self.keep)
        self.cache[key] = r if keep_trace else dataclasses.replace(r, trace=None)
        return r


# --------------------------------------------------------------------------- evaluation


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """Simulated means of a set of experiments at θ, and their loss."""

    theta: np.ndarray
    ids: tuple[str, ...]
    ttft_ms: np.ndarray
    e2e_ms: np.ndarray
    obs_ttft_ms: np.ndarray
    obs_e2e_ms: np.ndarray
    ttft_rmse: float
    e2e_rmse: float
    loss: float

    def row(self, i: int) -> dict:
        return {"ttft_mean_ms": float(self.ttft_ms[i]), "e2e_mean_ms": float(self.e2e_ms[i]),
                "ttft_ape_pct": _ape(self.ttft_ms[i], self.obs_ttft_ms[i]),
                "e2e_ape_pct": _ape(self.e2e_ms[i], self.obs_e2e_ms[i])}


def _ape(pred, obs) -> float:
    return float(100.0 * abs(pred - obs) / obs)


def evaluation(theta, exps: Sequence[Prepared], ttft, e2e) -> Evaluation:
    obs_t = np.array([p.obs.ttft_mean_ms for p in exps])
    obs_e = np.array([p.obs.e2e_mean_ms for p in exps])
    t, e, loss = loss_terms(np.asarray(ttft), np.asarray(e2e), obs_t, obs_e)
    return Evaluation(theta=np.asarray(theta, np.float64).copy(), ids=tuple(p.id for p in exps),
                      ttft_ms=np.asarray(ttft, np.float64), e2e_ms=np.asarray(e2e, np.float64),
                      obs_ttft_ms=obs_t, obs_e2e_ms=obs_e, ttft_rmse=float(t), e2e_rmse=float(e), loss=float(loss))


def evaluate(exps: Sequence[Prepared], theta: np.ndarray, sim: Simulator, with_trace: bool = True):
    """(Evaluation, [SimResult]) of simulating every experiment at θ."""
    results = [sim(p, theta, with_trace) for p in exps]
    return evaluation(theta, exps, [r.ttft_mean_ms for r in results], [r.e2e_mean_ms for r in results]), results


# --------------------------------------------------------------------------- fixed-schedule model


SCHEDULE_MODELS = ("local", "chained")


def latency_predictor(schedule_model: str = "local") -> Callable:
    """(trace, alpha, beta) → per-request (TTFT, E2E) µs with the schedule fixed:
    `local.predict_latencies_local` ("local") or `schedule.predict_latencies` ("chained")."""
    if schedule_model == "local":
        from blis_jax.fit.local import predict_latencies_local as predict
    elif schedule_model == "chained":
        from blis_jax.fit.schedule import predict_latencies as predict
    else:
        raise ConfigError(f"--schedule-model {schedule_model!r}: use one of {', '.join(SCHEDULE_MODELS)}")
    return predict


def trace_means_ms(trace, alpha, beta, schedule_model: str = "local"):
    """(mean TTFT, mean E2E) in ms of the completed requests with the schedule fixed
    (`latency_predictor`)."""
    ttft, e2e = latency_predictor(schedule_model)(trace, alpha, beta)
    return jnp.stack([jnp.mean(ttft), jnp.mean(e2e)]) / 1000.0


def linearize(trace, theta: np.ndarray, schedule_model: str = "local") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(means[2] ms, Jacobian[2, 15] ms per unit, cross[2, 11] = ∂²means/∂α₃∂β) of
    `trace_means_ms` at θ. The means are affine in θ but for α₃·(first-token step, affine in β),
    so means(θ) = means + J·Δθ + Δα₃·(cross·Δβ) exactly."""
    alpha, beta = jnp.asarray(theta[:NUM_ALPHA]), jnp.asarray(theta[NUM_ALPHA:])

    def means_of(a, b):
        return trace_means_ms(trace, a, b, schedule_model)

    means, vjp = jax.vjp(means_of, alpha, beta)
    rows = [jnp.concatenate(vjp(jnp.eye(2)[i])) for i in range(2)]
    cross = jax.jacfwd(lambda b: jax.jacrev(means_of)(alpha, b)[:, LAG])(beta)
    return np.asarray(means), np.asarray(jnp.stack(rows)), np.asarray(cross)


def _means_at(means0, jac, cross, theta0, theta):
    """The fixed-schedule means at θ from `linearize`'s terms (exact: see there)."""
    delta = theta - theta0
    return (means0 + jnp.einsum("epk,k->ep", jac, delta)
            + delta[LAG] * jnp.einsum("epk,k->ep", cross, delta[NUM_ALPHA:]))


@dataclasses.dataclass(frozen=True)
class Linearization:
    """Per experiment, means at θ₀ (the simulation's) + J·(θ − θ₀) + Δα₃·(cross·Δβ)."""

    theta0: np.ndarray       # [15]
    means0: np.ndarray       # [E, 2] simulated means, ms
    jac: np.ndarray          # [E, 2, 15]
    obs: np.ndarray          # [E, 2]
    pred0: np.ndarray        # [E, 2] fixed-schedule means at θ₀ (completed requests only)
    cross: np.ndarray        # [E, 2, 11] ∂²means/∂α₃∂β (`linearize`)

    def means(self, theta):
        return _means_at(jnp.asarray(self.means0), jnp.asarray(self.jac), jnp.asarray(self.cross),
                         jnp.asarray(self.theta0), theta)

    def loss(self, theta):
        m = self.means(theta)
        return loss_terms(m[:, 0], m[:, 1], self.obs[:, 0], self.obs[:, 1])[2]


def trust_box(theta: np.ndarray, free: Sequence[int], lo: np.ndarray, hi: np.ndarray,
              radius: float) -> tuple[np.ndarray, np.ndarray]:
    """[lo_eff, hi_eff] of the free coefficients: the bounds intersected with lo + (θ − lo)·e^±r
    (a coefficient at its lower bound may move up to lo + e^r)."""
    free = np.asarray(free)
    gap = theta[free] - lo[free]
    base = np.where(gap > 0, gap, 1.0)
    lo_eff = np.where(gap > 0, lo[free] + gap * math.exp(-radius), lo[free])
    hi_eff = np.minimum(hi[free], lo[free] + base * math.exp(radius))
    return lo_eff, hi_eff


def _adam_fit(u0, means0, jac, cross, obs, theta0, free_idx, lo, width, lr, steps: int):
    """Adam over u (θ[free] = lo + width·sigmoid(u)); returns (best u, its loss)."""
    import optax  # here: every CLI command's parser imports this module, only `fit` optimises


    def objective(u):
        theta = theta0.at[free_idx].set(lo + width * jax.nn.sigmoid(u))
        m = _means_at(means0, jac, cross, theta0, theta)
        return loss_terms(m[:, 0], m[:, 1], obs[:, 0], obs[:, 1])[2]

    opt = optax.adam(optax.cosine_decay_schedule(lr, steps, alpha=1e-3))

    def step(carry, _):
        u, state, best_u, best = carry
        value, grad = jax.value_and_grad(objective)(u)
        better = value < best   # the loss is not smooth at its optimum: keep the best iterate
        best_u, best = jnp.where(better, u, best_u), jnp.where(better, value, best)
        updates, state = opt.update(grad, state, u)
        return (optax.apply_updates(u, updates), state, best_u, best), None

    (u, _, best_u, best), _ = jax.lax.scan(step, (u0, opt.init(u0), u0, objective(u0)), None, length=steps)
    final = objective(u)
    return jnp.where(final < best, u, best_u), jnp.minimum(final, best)


_adam_fit_jit = jax.jit(_adam_fit, static_argnames="steps")


def inner_fit(lin: Linearization, free: Sequence[int], lo_eff: np.ndarray, hi_eff: np.ndarray, *,
              steps: int, lr: float) -> tuple[np.ndarray, float]:
    """Adam on the fixed-schedule loss over the free coefficients in the box; (best θ, its loss)."""
    free = np.asarray(free, np.int64)
    width = hi_eff - lo_eff
    frac = np.clip((lin.theta0[free] - lo_eff) / width, 1e-6, 1 - 1e-6)
    u0 = np.log(frac) - np.log1p(-frac)
    best_u, best = _adam_fit_jit(jnp.asarray(u0), jnp.asarray(lin.means0), jnp.asarray(lin.jac),
                                 jnp.asarray(lin.cross),
                                 jnp.asarray(lin.obs), jnp.asarray(lin.theta0), jnp.asarray(free),
                                 jnp.asarray(lo_eff), jnp.asarray(width), jnp.float64(lr), steps=steps)
    theta = lin.theta0.copy()
    if not float(best) < float(lin.loss(jnp.asarray(theta))):
        return theta, float(best)   # no better point in the box: the current point, exactly
    theta[free] = np.clip(lo_eff + width * np.asarray(jax.nn.sigmoid(best_u)), lo_eff, hi_eff)
    return theta, float(best)


# --------------------------------------------------------------------------- the driver


@dataclasses.dataclass(frozen=True)
class FitSettings:
    free: tuple[int, ...]
    lo: np.ndarray
    hi: np.ndarray
    outer: int = 4
    steps: int = 1000
    lr: float = 0.05
    trust: float = 0.5
    patience: int = 2
    schedule_model: str = "local"   # fixed-schedule latency model (see trace_means_ms)


@dataclasses.dataclass(frozen=True)
class FitResult:
    start: Evaluation
    best: Evaluation
    history: list[dict]       # one entry per simulated point (outer 0 = start)
    simulations: int
    wall_s: float

    @property
    def theta(self) -> np.ndarray:
        return self.best.theta


def check_settings(theta0: np.ndarray, settings: FitSettings) -> None:
    """Something to fit, and a start inside the bounds."""
    if not settings.free:
        raise ConfigError("--params: no coefficient to fit (every coefficient of --start is 0; name them)")
    outside = [k for k in settings.free if not settings.lo[k] <= theta0[k] <= settings.hi[k]]
    if outside:
        k = outside[0]
        raise ConfigError(f"--bounds: the start value of {coefficient_name(k)} ({theta0[k]:g}) is outside "
                          f"[{settings.lo[k]:g}, {settings.hi[k]:g}]; widen the bounds or change --start")


def fit(exps: Sequence[Prepared], theta0: np.ndarray, settings: FitSettings, sim: Simulator,
        progress: Progress | None = None, label: str = "fit") -> FitResult:
    """Fit the free coefficients of θ to the observed means of `exps` (see the module docstring)."""
    say = progress or (lambda line: None)
    t_start = time.perf_counter()
    runs0 = sim.runs
    theta0 = np.asarray(theta0, np.float64)
    check_settings(theta0, settings)
    free = list(settings.free)
    say(f"{label}: simulating {len(exps)} experiment(s) at the start coefficients")
    start, results = evaluate(exps, theta0, sim)
    history = [{"outer": 0, "loss_pct": start.loss, "ttft_rmse_pct": start.ttft_rmse, "e2e_rmse_pct": start.e2e_rmse,
                "accepted": True, "trust": settings.trust, "fixed_schedule_loss_pct": None,
                "wall_s": time.perf_counter() - t_start}]
    say(f"{label}: outer 0/{settings.outer}: simulated loss {start.loss:.3f}% (TTFT RMSE {start.ttft_rmse:.2f}, "
        f"E2E RMSE {start.e2e_rmse:.2f}) [{time.perf_counter() - t_start:.0f} s]")
    best, best_results = start, results
    radius, misses = settings.trust, 0
    obs = np.stack([best.obs_ttft_ms, best.obs_e2e_ms], axis=1)
    for it in range(1, settings.outer + 1):
        pred0, jac, cross = map(np.stack, zip(*(linearize(r.trace, best.theta, settings.schedule_model)
                                                  for r in best_results)))
        means0 = np.stack([best.ttft_ms, best.e2e_ms], axis=1)
        lin = Linearization(theta0=best.theta, means0=means0, jac=jac, obs=obs, pred0=pred0, cross=cross)
        # a coefficient with no effect on any mean (e.g. bEP without expert parallelism) stays as is
        active = [k for k in free if np.any(jac[:, :, k] != 0.0)]
        idle = [k for k in free if k not in active]
        if idle and it == 1:
            say(f"{label}: {', '.join(coefficient_label(k) for k in idle)} has no effect on these experiments; "
                "kept at its start value")
        if not active:
            break
        lo_eff, hi_eff = trust_box(best.theta, active, settings.lo, settings.hi, radius)
        proposal, approx = inner_fit(lin, active, lo_eff, hi_eff, steps=settings.steps, lr=settings.lr)
        if np.array_equal(proposal, best.theta):
            say(f"{label}: outer {it}/{settings.outer}: the fixed-schedule optimum is the current point; stopping")
            break
        _check_affine(lin, best_results, proposal, settings.schedule_model, say)
        ev, results = evaluate(exps, proposal, sim)
        accepted = ev.loss < best.loss
        history.append({"outer": it, "loss_pct": ev.loss, "ttft_rmse_pct": ev.ttft_rmse, "e2e_rmse_pct": ev.e2e_rmse,
                        "accepted": bool(accepted), "trust": radius, "fixed_schedule_loss_pct": approx,
                        "wall_s": time.perf_counter() - t_start})
        say(f"{label}: outer {it}/{settings.outer}: simulated loss {ev.loss:.3f}% (fixed-schedule prediction "
            f"{approx:.3f}%), best {min(ev.loss, best.loss):.3f}%, trust e^±{radius:.3g}"
            f"{'' if accepted else ', rejected'} [{time.perf_counter() - t_start:.0f} s]")
        radius = next_radius(radius, settings.trust, best.loss, approx, ev.loss)
        if accepted:
            best, best_results, misses = ev, results, 0
        else:
            misses += 1
            if misses >= settings.patience:
                say(f"{label}: {misses} proposals without improvement; stopping")
                break
    return FitResult(start=start, best=best, history=history, simulations=sim.runs - runs0,
                     wall_s=time.perf_counter() - t_start)


def next_radius(radius: float, trust: float, loss: float, predicted: float, simulated: float) -> float:
    """The trust radius after a proposal from a point of loss `loss`, with the fixed-schedule
    model's `predicted` loss and the `simulated` one: halved if the proposal is no better;
    doubled (up to `trust`) if it realised at least GOOD_AGREEMENT of the predicted improvement,
    so that a rough start (an overloaded experiment) does not leave every later step tiny."""
    if not simulated < loss:
        return radius / 2.0
    if predicted < loss and simulated <= loss - GOOD_AGREEMENT * (loss - predicted):
        return min(2.0 * radius, trust)
    return radius


def _check_affine(lin: Linearization, results: Sequence[SimResult], theta: np.ndarray, schedule_model: str,
                  say: Progress) -> None:
    """The inner loop's model (affine, plus the α₃·β cross term) must agree with the
    fixed-schedule latencies at the proposal."""
    alpha, beta = jnp.asarray(theta[:NUM_ALPHA]), jnp.asarray(theta[NUM_ALPHA:])
    approx = np.asarray(lin.means(jnp.asarray(theta)))
    for e, r in enumerate(results):
        expected = lin.means0[e] + (np.asarray(trace_means_ms(r.trace, alpha, beta, schedule_model)) - lin.pred0[e])
        if not np.allclose(approx[e], expected, rtol=RELATIVE_CHECK, atol=1e-9):
            say(f"warning: fixed-schedule means of experiment {e} differ from the inner loop's model "
                f"({approx[e]} vs {expected}); the inner loop's model is only first-order")


# --------------------------------------------------------------------------- cross-validation


@dataclasses.dataclass(frozen=True)
class CVFold:
    held_out: tuple[str, ...]
    group: str                 # the experiment id (loeo) or model (lomo)
    train_start_loss: float
    train_fitted_loss: float
    theta: np.ndarray
    start: Evaluation          # held-out experiments at the start coefficients
    fitted: Evaluation         # held-out experiments at the fold's coefficients


@dataclasses.dataclass(frozen=True)
class CVResult:
    mode: str
    folds: list[CVFold]
    start: Evaluation          # every held-out experiment at the start (= the start loss)
    fitted: Evaluation         # every experiment predicted by the fold that did not see it


def cv_groups(exps: Sequence, mode: str) -> list[tuple[str, list]]:
    """Hold-out groups of experiments (anything with .id and .model: Prepared, ObservedExperiment)."""
    if mode == "loeo":
        groups = [(p.id, [p]) for p in exps]
    elif mode == "lomo":
        by_model: dict[str, list] = {}
        for p in exps:
            by_model.setdefault(p.model, []).append(p)
        groups = list(by_model.items())
    else:
        raise ConfigError(f"--cv {mode!r}: use loeo (leave one experiment out) or lomo (leave one model out)")
    if len(groups) < 2:
        raise ConfigError(f"--cv {mode}: needs at least 2 groups to hold out, the selected experiments form "
                          f"{len(groups)}; select more experiments")
    return groups


def cross_validate(exps: Sequence[Prepared], theta0: np.ndarray, settings: FitSettings, mode: str,
                   sim: Simulator, progress: Progress | None = None, *, jobs: int = 1,
                   rebuild: Callable[[], list[Prepared]] | None = None, stop=None) -> CVResult:
    """Fit on all but one group, evaluate the held-out group by simulation, for every group.

    ``jobs`` > 1 runs the folds in that many worker processes (spawned: each imports JAX and
    compiles for itself); each worker prepares the experiments with ``rebuild`` (picklable, giving
    `exps` again: a resolved scenario cannot be pickled) and prints its own progress to stderr
    when `progress` is set; a fold's error, or ``stop`` (a `threading.Event`) being set, ends the
    other workers at once. The folds are independent and deterministic, so the result is the same
    as with ``jobs=1``, which runs them here and shares `sim`'s start-point simulations."""
    say = progress or (lambda line: None)
    groups = cv_groups(exps, mode)
    if jobs < 1:
        raise ConfigError(f"cross-validation jobs = {jobs}: must be >= 1")
    if jobs == 1:
        folds = [_cv_fold(exps, groups, g, theta0, settings, mode, sim, say) for g in range(len(groups))]
    else:
        if rebuild is None:
            raise ValueError("cross_validate(jobs > 1) needs `rebuild`, which prepares the experiments in a worker")
        folds = _cv_folds_in_workers(rebuild, len(groups), theta0, settings, mode, jobs, say,
                                     verbose=progress is not None, stop=stop)
    held_ids = [i for f in folds for i in f.held_out]
    order = {p.id: p for p in exps}
    held = [order[i] for i in held_ids]

    def column(ev: str, what: str) -> list[float]:
        return [float(v) for f in folds for v in getattr(getattr(f, ev), what)]

    return CVResult(mode=mode, folds=folds,
                    start=evaluation(theta0, held, column("start", "ttft_ms"), column("start", "e2e_ms")),
                    fitted=evaluation(np.full(NUM_COEFFS, np.nan), held, column("fitted", "ttft_ms"),
                                      column("fitted", "e2e_ms")))


def _cv_fold(exps: Sequence[Prepared], groups: list[tuple[str, list]], g: int, theta0: np.ndarray,
             settings: FitSettings, mode: str, sim: Simulator, say: Progress) -> CVFold:
    """Fold g: fit on every experiment outside group g, simulate group g at the start and fitted θ."""
    name, held = groups[g]
    train = [p for p in exps if p not in held]
    say(f"cv {mode} fold {g + 1}/{len(groups)}: holding out {name} ({len(held)} experiment(s))")
    r = fit(train, theta0, settings, sim, say, label=f"cv {g + 1}/{len(groups)}")
    start_ev, _ = evaluate(held, theta0, sim, with_trace=False)
    fitted_ev, _ = evaluate(held, r.theta, sim, with_trace=False)
    say(f"cv {mode} fold {g + 1}/{len(groups)}: train loss {r.start.loss:.3f}% → {r.best.loss:.3f}%, held-out "
        f"loss {start_ev.loss:.3f}% → {fitted_ev.loss:.3f}%")
    return CVFold(held_out=tuple(p.id for p in held), group=name, train_start_loss=r.start.loss,
                  train_fitted_loss=r.best.loss, theta=r.theta, start=start_ev, fitted=fitted_ev)


def _cv_folds_in_workers(rebuild: Callable[[], list[Prepared]], count: int, theta0: np.ndarray,
                         settings: FitSettings, mode: str, jobs: int, say: Progress, *,
                         verbose: bool, stop=None) -> list[CVFold]:
    import concurrent.futures
    import multiprocessing

    # spawn, not fork: a forked child of a process that has started XLA's threads can deadlock
    context = multiprocessing.get_context("spawn")
    pool = concurrent.futures.ProcessPoolExecutor(max_workers=min(jobs, count), mp_context=context)
    folds: dict[int, CVFold] = {}
    try:
        futures = {pool.submit(_cv_fold_in_worker, rebuild, g, theta0, settings, mode, verbose): g
                   for g in range(count)}
        pending = set(futures)
        while pending:
            if stop is not None and stop.is_set():
                raise RuntimeError("cross-validation stopped: the main fit failed")
            done, pending = concurrent.futures.wait(pending, timeout=1.0,
                                                    return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                g = futures[future]
                folds[g] = future.result()        # a fold's error ends the others (finally)
                say(f"cv {mode}: fold {g + 1}/{count} ({folds[g].group}) done, {len(folds)} of {count}")
    finally:
        if len(folds) < count:   # an error here or in the caller: do not wait for the other folds
            # the executor has no public way to end running tasks: terminate its processes
            workers = list((getattr(pool, "_processes", None) or {}).values())
            pool.shutdown(wait=False, cancel_futures=True)
            for worker in workers:
                worker.terminate()
        else:
            pool.shutdown()
    return [folds[g] for g in range(count)]


def _cv_fold_in_worker(rebuild: Callable[[], list[Prepared]], g: int, theta0: np.ndarray, settings: FitSettings,
                       mode: str, verbose: bool) -> CVFold:
    import sys

    from blis_jax.cpu_backend import start_single_thread_cpu_backend

    start_single_thread_cpu_backend()   # as the CLI does for `fit`: a fresh process, one device

    def say(line: str) -> None:
        sys.stderr.write(f"blis-jax: [fold {g + 1}] {line}\n")
        sys.stderr.flush()

    exps = rebuild()
    progress = say if verbose else (lambda line: None)
    sim = Simulator(progress=say if verbose else None, keep=theta0)
    return _cv_fold(exps, cv_groups(exps, mode), g, theta0, settings, mode, sim, progress)
