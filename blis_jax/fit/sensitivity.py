"""Sensitivities of a run's metrics to its latency coefficients and scenario settings.

How each kind of input is differentiated:

* **coefficients** (α₀..α₂, β₀..β₁₀ of trained-physics): forward mode (`jax.jacfwd`) through
  the request-local fixed-schedule model of the whole run (`local.predict_latencies_local`):
  the simulated schedule (which requests run in which step) is held, step durations and α
  terms move. That model is affine in (α, β) and equals the simulated latencies at the
  simulated coefficients, so the derivative is the *direct* effect of a coefficient on every
  step and wait. What re-simulation adds on top — a different schedule (batch composition,
  which arrivals find the instance busy) — is left out; `check` measures the total by central
  differences of whole re-simulations.
* **rate**: central finite difference of whole simulations with the requests regenerated at
  rate·(1 ± h). Not the schedule model: with the schedule fixed, an arrival time enters a
  request's latency only through the residual of the step in progress at its enqueue (a
  sawtooth, −1 µs per µs inside a step and a jump at each boundary) and through idle gaps,
  while the effect of load is the schedule itself: larger batches, longer steps, more arrivals
  that wait. (The chained model would instead turn every arrival shift into queue growth
  across a busy period, which holds only for an overloaded instance.)
* **integer settings** (total KV blocks, max-num-seqs, max-num-batched-tokens): every metric
  is a step function of them, so they get a one-sided (forward) difference of whole
  simulations over Δ = max(1, round(h·N)), per unit.

Why request-local and not the chained model (`schedule.predict_latencies`), whose derivative is
exact for an infinitesimal change: under load a whole-run TTFT is a sawtooth of the
coefficients (the wait for the step in progress moves with every step since the busy stretch
began, until it wraps past a step boundary), so the chained slope holds only below one step's
worth of accumulated shift. Over a few percent, whole runs follow the local model: at 1.5 req/s
(tests/test_sensitivity.py's shape), mean TTFT per unit of b3 is 4.51 / 6.19 / 5.61 ms for
whole runs at 1 / 5 / 20 % steps, 4.48 local, 77.1 chained. With no arrival finding a step in
progress (0.8 req/s) the means agree with whole runs within 0.2 %.

The metrics are those `blis-jax run` prints (metrics.py), written as functions of the
fixed-schedule latencies:

* means: TTFT over the requests with a first token, E2E over completed requests;
* percentiles: BLIS's interpolation between the order statistics at rank p/100·(n − 1), in the
  order of the simulated values (differentiable wherever these are not tied);
* ITL mean: the pooled per-step samples d_k + α₂ of completed requests over their count (ITL
  percentiles are not offered: many steps share one µs value, so their order statistic has no
  derivative);
* throughput, output tokens / simulated duration: the run ends with its last step, i.e. with
  the completion of the requests in it, in the same request-local window as their E2E: for the
  earliest-enqueued of them, end = enq + ρ·d_{k₀} + Σ_{k₀ < k ≤ last} d_k.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from blis_jax.errors import ConfigError, SimulationFailed
from blis_jax.fit import fit as F
from blis_jax.fit.local import predict_latencies_local, request_windows
from blis_jax.fit.schedule import ScheduleTrace, schedule_trace
from blis_jax.naming import name as field_name
from blis_jax.scenario import ResolvedScenario, ScenarioConfig, SyntheticWorkload, resolve
from blis_jax.scenario.resolve import Warn

# --metrics name → (metrics_output key, unit)
METRICS: dict[str, tuple[str, str]] = {
    **{f"{kind}_{stat}": (f"{kind}_{stat}_ms", "ms")
       for kind in ("ttft", "e2e") for stat in ("mean", "p90", "p95", "p99")},
    "itl_mean": ("itl_mean_ms", "ms"),
    "throughput": ("tokens_per_sec", "tokens/s"),
}
DEFAULT_METRICS = ("ttft_mean", "ttft_p99", "e2e_mean", "itl_mean", "throughput")
SETTINGS = ("rate", "total_kv_blocks", "max_num_seqs", "max_num_batched_tokens")
INTEGER_SETTINGS = SETTINGS[1:]
SETTING_UNITS = {"rate": "req/s", "total_kv_blocks": "blocks", "max_num_seqs": "requests",
                 "max_num_batched_tokens": "tokens"}
DEFAULT_STEP = 0.05   # relative finite-difference step: big enough that µs truncation is noise
CONSISTENCY = 1e-9    # fixed-schedule metric vs the simulated one at the simulated coefficients

METHOD_FORWARD_MODE = "forward-mode (fixed schedule)"
METHOD_CENTRAL = "central difference (whole runs)"
METHOD_ONE_SIDED = "one-sided difference (whole runs)"

Progress = Callable[[str], None]


# --------------------------------------------------------------------------- names


def parse_metrics(text: str | None, flag: str = "--metrics") -> tuple[str, ...]:
    """Metric names of a comma list (a trailing `_ms` is accepted); None → the defaults."""
    if text is None:
        return DEFAULT_METRICS
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    if not names:
        raise ConfigError(f"{flag}: empty list; give metric names such as ttft_mean,e2e_p99")
    out: list[str] = []
    for name in names:
        key = name.removesuffix("_ms") if name.removesuffix("_ms") in METRICS else name
        if key not in METRICS:
            hint = ("; ITL percentiles are not offered (many steps share one µs value, so the order "
                    "statistic has no derivative): use itl_mean") if key.startswith("itl_p") else ""
            raise ConfigError(f"{flag}: unknown metric {name!r}{hint}; use {', '.join(METRICS)}")
        if key in out:
            raise ConfigError(f"{flag}: {key} is listed twice")
        out.append(key)
    return tuple(out)


def _setting_name(name: str) -> str | None:
    key = name.strip().lower().lstrip("-").replace("-", "_")
    key = {"kv_blocks": "total_kv_blocks", "max_num_running_reqs": "max_num_seqs",
           "max_num_scheduled_tokens": "max_num_batched_tokens"}.get(key, key)
    return key if key in SETTINGS else None


def parse_wrt(text: str | None, num_betas: int, flag: str = "--wrt") -> tuple[str, ...]:
    """Input names: `alpha`, `beta` (every coefficient of the group), alpha0..2, beta0..10 or
    BLIS's beta names, and the settings rate, total-kv-blocks, max-num-seqs,
    max-num-batched-tokens. None → every coefficient (α and the model's betas)."""
    text = "alpha,beta" if text is None else text
    names = [n for n in text.split(",") if n.strip()]
    if not names:
        raise ConfigError(f"{flag}: empty list; give e.g. alpha,beta,rate or alpha0,b3")
    out: list[str] = []

    def add(name: str, given: str) -> None:
        if name in out:
            raise ConfigError(f"{flag}: {name} is listed twice ({given.strip()!r})")
        out.append(name)

    for given in names:
        key = given.strip().lower()
        setting = _setting_name(key)
        if key == "alpha":
            group = [F.coefficient_name(k) for k in range(F.LAG)]   # BLIS's α; the lag α₃ by name
        elif key == "beta":
            group = [F.coefficient_name(F.NUM_ALPHA + k) for k in range(num_betas)]
        elif setting is not None:
            group = [setting]
        else:
            group = [F.coefficient_name(_coefficient(given, num_betas, flag))]
        for name in group:
            add(name, given)
    return tuple(out)


def _coefficient(name: str, num_betas: int, flag: str) -> int:
    """Flat θ index of alpha0..3, beta0..10 or a BLIS beta name (b1a .. bEP)."""
    key, k = name.strip().lower(), None
    blis = [b.lower() for b in F.BLIS_BETA_NAMES]
    if (m := re.fullmatch(r"alpha(\d+)", key)) and int(m.group(1)) < F.NUM_ALPHA:
        k = int(m.group(1))
    elif m := re.fullmatch(r"beta(\d+)", key):
        k = F.NUM_ALPHA + int(m.group(1))
    elif key in blis:
        k = F.NUM_ALPHA + blis.index(key)
    if k is not None and k < F.NUM_ALPHA + num_betas:
        return k
    if k is not None and k < F.NUM_COEFFS:
        raise ConfigError(f"{flag}: {name.strip()!r} is beta slot {k - F.NUM_ALPHA}, but the latency model has "
                          f"{num_betas} betas")
    raise ConfigError(f"{flag}: unknown input {name.strip()!r}; use alpha, beta, alpha0..alpha3, "
                      f"beta0..beta{num_betas - 1} or BLIS's names {', '.join(F.BLIS_BETA_NAMES[:num_betas])}, "
                      f"or a setting: {', '.join(s.replace('_', '-') for s in SETTINGS)}")


def coefficient_index(name: str) -> int | None:
    """Flat θ index of a canonical coefficient name (alpha0.., beta0..), None for a setting."""
    if name.startswith("alpha"):
        return int(name[5:])
    if name.startswith("beta"):
        return F.NUM_ALPHA + int(name[4:])
    return None


def input_label(name: str) -> str:
    k = coefficient_index(name)
    return F.coefficient_label(k) if k is not None else name.replace("_", "-")


# --------------------------------------------------------------------------- scenarios


def theta_of(scenario: ResolvedScenario) -> np.ndarray:
    """Flat coefficients [15] of the scenario's latency model: the 4 α slots then the 11 beta
    slots (zero-padded)."""
    model = scenario.latency_model
    return np.concatenate([np.asarray(model.alpha, np.float64), np.asarray(model.beta, np.float64)])


def with_theta(scenario: ResolvedScenario, theta: np.ndarray) -> ResolvedScenario:
    theta = np.asarray(theta, np.float64)
    return scenario.with_coefficients(alpha=theta[:F.NUM_ALPHA], beta=theta[F.NUM_ALPHA:])


Vary = Callable[[str, float], ResolvedScenario]   # (setting name, value) → the scenario with that setting changed


def base_settings(scenario: ResolvedScenario) -> dict[str, float]:
    """The settings whose sensitivities can be taken, at the scenario's values: the integer
    engine settings, and the rate of a synthetic workload."""
    settings: dict[str, float] = {setting: getattr(scenario, setting) for setting in INTEGER_SETTINGS}
    if isinstance(scenario.config.workload, SyntheticWorkload):
        settings["rate"] = float(scenario.config.workload.rate)
    return settings


def vary_params(scenario: ResolvedScenario) -> Vary:
    """A `Vary` for the integer engine settings only (the resolved values replaced as they are;
    `vary_config` re-resolves the scenario instead, as `run` would)."""
    def vary(setting: str, value: float) -> ResolvedScenario:
        if setting not in INTEGER_SETTINGS:
            raise ConfigError(f"--wrt {setting}: needs a way to regenerate the requests (a `vary` function)")
        return dataclasses.replace(scenario, **{setting: int(value)})
    return vary


def vary_config(config: ScenarioConfig, *, warn: Warn | None = None) -> Vary:
    """A `Vary` that resolves `config` again with one setting changed: a whole-run difference is
    then a difference of two `blis-jax run` commands (`warn` as in `scenario.resolve`)."""
    def vary(setting: str, value: float) -> ResolvedScenario:
        if setting == "rate":
            if not isinstance(config.workload, SyntheticWorkload):
                raise ConfigError(f"--wrt rate: the workload has no {field_name('workload.rate')} to vary (a spec's "
                                  "arrival rate is its aggregate_rate); drop rate from --wrt")
            changed = config.replace(workload=dataclasses.replace(config.workload, rate=value))
        elif setting == "total_kv_blocks":
            changed = config.replace(deployment=dataclasses.replace(config.deployment, total_kv_blocks=int(value)))
        elif setting in INTEGER_SETTINGS:
            changed = config.replace(engine=dataclasses.replace(config.engine, **{setting: int(value)}))
        else:
            raise ConfigError(f"--wrt {setting}: not a setting; use {', '.join(SETTINGS)}")
        return resolve(changed, warn=warn)
    return vary


@dataclasses.dataclass(frozen=True, eq=False)
class Simulated:
    """One simulation: the requests that existed, outputs, the metrics `run` prints, the trace."""

    scenario: ResolvedScenario
    requests: object        # settled RequestSet (rows aligned with `out`)
    out: object             # SimOutput
    metrics: dict
    trace: ScheduleTrace
    first_step: np.ndarray  # int64 [N] first-token step per request row (−1: none)


def simulate(scenario: ResolvedScenario) -> Simulated:
    """Simulate a single-instance scenario with the step trace (one compiled program for every
    re-simulation)."""
    from blis_jax.engine import results as result_codes
    from blis_jax.engine.simulate import simulate_traced
    from blis_jax.metrics import metrics_output

    s = scenario
    final, out, raw = simulate_traced(s.requests, s.sessions, s.params, s.latency_model, block_size=s.block_size,
                                      scheduler=s.scheduler, preemption_policy=s.preemption_policy)
    if out.result != result_codes.OK:
        raise SimulationFailed(f"the engine stopped early ({result_codes.describe(out.result)})")
    return Simulated(scenario=s, requests=final, out=out, metrics=metrics_output(out, final),
                     trace=schedule_trace(final, out, raw, s.latency_model), first_step=np.asarray(raw[3]))


def metric_values(sim: Simulated, metrics: Sequence[str]) -> np.ndarray:
    """The simulated metrics, in their --metrics units."""
    return np.array([float(sim.metrics[METRICS[m][0]]) for m in metrics])


# --------------------------------------------------------------------------- fixed-schedule metrics


def _percentile_weights(base: np.ndarray, p: float) -> tuple[np.ndarray, np.ndarray, int]:
    """(sample indices [2], weights [2], tied): BLIS's percentile as w·v[idx] in the order of
    the simulated values `base`. `tied` counts the samples that share the value of an order
    statistic when that makes the order ambiguous (0 otherwise): the derivative is then that of
    one order, one of several one-sided values."""
    n = base.shape[0]
    order = np.argsort(base, kind="stable")
    rank = p / 100.0 * float(n - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    frac = rank - float(lo)
    idx = order[[lo, hi]]
    sharing = int(np.isin(base, base[idx]).sum())
    pair_tied = lo != hi and base[idx[0]] == base[idx[1]]
    ambiguous = sharing > (1 if lo == hi else 2) or pair_tied
    return idx, np.array([1.0 - frac, frac]), sharing if ambiguous else 0


def _metric_name_parts(metric: str) -> tuple[str, str]:
    kind, stat = metric.split("_", 1)
    return kind, stat


def schedule_metrics(sim: Simulated, metrics: Sequence[str]) -> tuple[Callable, list[str]]:
    """(f, notes): f(θ[15]) → the metrics (--metrics units) with the schedule of `sim` fixed,
    equal to the simulated metrics at the simulated θ; notes say what the model holds fixed."""
    st, out = sim.trace, sim.out
    notes: list[str] = []
    done = np.flatnonzero(out.completed_mask() & (sim.first_step >= 0))   # the trace's requests, row order
    if done.shape[0] == 0:
        raise ConfigError("no request completed in the simulated run; the metrics have no derivative "
                          "(raise --num-requests or --horizon)")
    windows = request_windows(st)
    basis = jnp.asarray(st.basis)
    dur = jnp.asarray(st.duration_us, jnp.float64)

    # TTFT sample: every request with a first token (as metrics.py); E2E: completed requests
    ttft_rows = np.flatnonzero(out.ttft_us >= 0)
    e2e_rows = np.flatnonzero(out.completed_mask())
    held = ttft_rows.shape[0] - done.shape[0]
    if held and any(m.startswith("ttft") for m in metrics):
        notes.append(f"{held} request(s) with a first token did not complete (timed out or still running); "
                     "their TTFT is held at its simulated value")
    ttft_base, e2e_base = out.ttft_us[ttft_rows].astype(np.float64), out.e2e_us[e2e_rows].astype(np.float64)
    ttft_pos, e2e_pos = np.searchsorted(ttft_rows, done), np.searchsorted(e2e_rows, done)

    # ITL pool: per step, the completed requests that decoded in it (difference array over runs)
    steps = st.duration_us.shape[0]
    per_step = np.cumsum(np.bincount(st.run_first, minlength=steps + 1)
                         - np.bincount(st.run_last + 1, minlength=steps + 1))[:steps].astype(np.float64)
    itl_count = float(per_step.sum())

    # end of the run: the last step, as the completion of a request that finishes in it (see
    # the module docstring); of those, the earliest enqueued: it decoded in every step since
    # its admission, so its window holds the longest stretch of chained steps they all end with
    final_step = st.first_step.copy()
    np.maximum.at(final_step, st.run_request, st.run_last)
    ending = np.flatnonzero(final_step == steps - 1)
    last = int(ending[np.argmin(st.arrival_us[ending])]) if ending.shape[0] else int(np.argmax(st.arrival_us))
    k0_last, rho_last = int(windows[0][last]), float(windows[1][last])
    sim_end = int(np.max(out.sim_end_us))
    end_follows = steps > 0 and int(st.start_us[-1] + st.duration_us[-1]) == sim_end
    if not end_follows and "throughput" in metrics:
        notes.append(f"throughput: the run ends at {sim_end} µs, not with its last step (a horizon or a late "
                     "arrival); the duration is held fixed")
    tokens = float(sim.metrics["total_output_tokens"])

    for m in metrics:
        if m.endswith(("_p90", "_p95", "_p99")):
            kind, stat = _metric_name_parts(m)
            base = ttft_base if kind == "ttft" else e2e_base
            _, _, tied = _percentile_weights(base, float(stat[1:]))
            if tied:
                notes.append(f"{m}: {tied} samples share the simulated value of its order statistic(s); the "
                             "derivative is that of one order of them (one of several one-sided values)")

    def f(theta):
        alpha, beta = theta[:F.NUM_ALPHA], theta[F.NUM_ALPHA:]
        ttft, e2e = predict_latencies_local(st, alpha, beta, windows)
        samples = {"ttft": jnp.asarray(ttft_base).at[ttft_pos].set(ttft),
                   "e2e": jnp.asarray(e2e_base).at[e2e_pos].set(e2e)}
        delta_d = basis @ (beta - st.beta_sim)
        delta_a = alpha - st.alpha_sim
        values = []
        for m in metrics:
            if m == "itl_mean":
                itl = jnp.sum(jnp.asarray(per_step) * (dur + delta_d + st.alpha_us_sim[2] + delta_a[2]))
                values.append(itl / max(itl_count, 1.0) / 1000.0 if itl_count else jnp.zeros(()))
            elif m == "throughput":
                cum = jnp.concatenate([jnp.zeros(1), jnp.cumsum(delta_d)])
                residual = rho_last * delta_d[k0_last] if k0_last >= 0 else 0.0
                shift = delta_a[0] + residual + cum[steps] - cum[k0_last + 1]
                end_us = sim_end + (shift if end_follows else 0.0)
                values.append(tokens / (end_us / 1e6))
            else:
                kind, stat = _metric_name_parts(m)
                v = samples[kind]
                if stat == "mean":
                    values.append(jnp.sum(v) / v.shape[0] / 1000.0)
                else:
                    idx, w = _percentile_weights(ttft_base if kind == "ttft" else e2e_base, float(stat[1:]))[:2]
                    values.append(jnp.dot(v[jnp.asarray(idx)], jnp.asarray(w)) / 1000.0)
        return jnp.stack(values)

    return f, notes


def forward_mode(sim: Simulated, metrics: Sequence[str]) -> tuple[np.ndarray, list[str]]:
    """(Jacobian [M, 15] of the metrics with respect to θ by `jax.jacfwd` of the fixed-schedule
    model, notes). A note names any metric the model does not reproduce at the simulated θ."""
    f, notes = schedule_metrics(sim, metrics)
    theta = jnp.asarray(theta_of(sim.scenario))
    # one compiled program for values and Jacobian: op-by-op dispatch compiles every small op
    values, jac = jax.jit(lambda t: (f(t), jax.jacfwd(f)(t)))(theta)
    model_values, jac = np.asarray(values), np.asarray(jac)
    # an input without effect can come out as ±1e-16 (cancellation in the affine model): call it 0
    jac = np.where(np.abs(jac) < 1e-12 * np.max(np.abs(jac), axis=1, keepdims=True), 0.0, jac)
    simulated = metric_values(sim, metrics)
    off = np.abs(model_values - simulated) > CONSISTENCY * np.maximum(np.abs(simulated), 1.0)
    for m, a, b in zip(np.asarray(metrics)[off], model_values[off], simulated[off]):
        notes.append(f"{m}: the fixed-schedule model gives {a:.9g} at the simulated coefficients, the run "
                     f"{b:.9g}; its derivatives are those of the model")
    return jac, notes


# --------------------------------------------------------------------------- finite differences


@dataclasses.dataclass(frozen=True)
class Difference:
    """A finite-difference derivative of every metric with respect to one input."""

    derivative: np.ndarray   # [M], metric units per input unit
    step: float              # the absolute step h (Δ for integer settings)
    method: str              # METHOD_CENTRAL or METHOD_ONE_SIDED


def coefficient_step(theta: np.ndarray, k: int, step: float, slope: np.ndarray | None = None,
                     values: np.ndarray | None = None) -> tuple[float, bool]:
    """(h, central) of coefficient k: α₀..α₂ by whole µs (the engine truncates α terms to µs, so
    a fractional step would difference the truncation), β and the first-token lag α₃ by step·|x|;
    a zero coefficient goes forward (coefficients are ≥ 0) by the h the fixed-schedule slope says
    moves a metric by step·|metric| (1.0 when it has no effect)."""
    x = float(theta[k])
    if x != 0.0:
        h = step * abs(x)
        return (max(1.0, float(round(h))) if k < F.LAG else h), True
    if slope is not None and values is not None and np.any(slope != 0):
        moving = slope != 0
        h = float(np.min(step * np.maximum(np.abs(values[moving]), 1e-9) / np.abs(slope[moving])))
        return (max(1.0, float(round(h))) if k < F.LAG else h), False
    return 1.0, False


def coefficient_difference(base: Simulated, k: int, metrics: Sequence[str], step: float = DEFAULT_STEP,
                           slope: np.ndarray | None = None) -> Difference:
    """Finite difference of whole re-simulations with coefficient k moved (see `coefficient_step`)."""
    theta = theta_of(base.scenario)
    values = metric_values(base, metrics)
    h, central = coefficient_step(theta, k, step, slope, values)

    def at(delta: float) -> np.ndarray:
        moved = theta.copy()
        moved[k] += delta
        return metric_values(simulate(with_theta(base.scenario, moved)), metrics)

    if central:
        return Difference((at(h) - at(-h)) / (2 * h), h, METHOD_CENTRAL)
    return Difference((at(h) - values) / h, h, METHOD_ONE_SIDED)


def setting_difference(base: Simulated, name: str, value: float, vary: Vary, metrics: Sequence[str],
                       step: float = DEFAULT_STEP) -> Difference:
    """rate: central difference at rate·(1 ± step); integer settings: forward difference over
    Δ = max(1, round(step·N)), per unit."""
    if name == "rate":
        h = step * value
        up, down = (metric_values(simulate(vary(name, value + s * h)), metrics) for s in (1, -1))
        return Difference((up - down) / (2 * h), h, METHOD_CENTRAL)
    delta = max(1, round(step * value))
    up = metric_values(simulate(vary(name, int(value) + delta)), metrics)
    return Difference((up - metric_values(base, metrics)) / delta, float(delta), METHOD_ONE_SIDED)


# --------------------------------------------------------------------------- the table


@dataclasses.dataclass(frozen=True)
class Entry:
    metric: str
    input: str
    derivative: float               # metric units per input unit
    elasticity: float | None        # d ln metric / d ln input (None when the metric is 0)
    method: str
    step: float | None              # finite-difference step (absolute), None for forward mode
    check: float | None = None      # --check: finite difference of whole re-simulations
    check_step: float | None = None
    check_method: str | None = None

    @property
    def rel_diff(self) -> float | None:
        """|derivative − check| / max(|derivative|, |check|) (0 when both are 0)."""
        if self.check is None:
            return None
        scale = max(abs(self.derivative), abs(self.check))
        return abs(self.derivative - self.check) / scale if scale > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class Table:
    """Sensitivities of the metrics of one run: an entry per (metric, input)."""

    metrics: tuple[str, ...]
    inputs: tuple[str, ...]
    metric_values: dict[str, float]
    input_values: dict[str, float]
    entries: tuple[Entry, ...]
    step: float
    notes: tuple[str, ...]
    checked: bool

    def entry(self, metric: str, input: str) -> Entry:
        for e in self.entries:
            if e.metric == metric and e.input == input:
                return e
        raise KeyError((metric, input))

    def to_dict(self) -> dict:
        return {
            "metrics": {m: {"value": self.metric_values[m], "unit": METRICS[m][1]} for m in self.metrics},
            "inputs": {i: {"value": self.input_values[i], "unit": _input_unit(i), "label": input_label(i)}
                       for i in self.inputs},
            "fd_step": self.step,
            "checked": self.checked,
            "sensitivities": [_entry_dict(e) for e in self.entries],
            "notes": list(self.notes),
        }

    def format(self) -> str:
        head = ["metric", "value", "input", "input value", "d metric / d input", "elasticity", "method"]
        if self.checked:
            head += ["check (whole runs)", "rel diff"]
        rows, previous = [], None
        for e in self.entries:
            first = e.metric != previous   # the metric and its value once per group
            previous = e.metric
            row = [f"{e.metric} ({METRICS[e.metric][1]})" if first else "",
                   _num(self.metric_values[e.metric]) if first else "", input_label(e.input),
                   _num(self.input_values[e.input]), _num(e.derivative),
                   "-" if e.elasticity is None else f"{e.elasticity + 0.0:.4g}", _method_label(e.method, e.step)]
            if self.checked:
                rel = e.rel_diff
                row += ["-" if e.check is None else _num(e.check), "-" if rel is None else f"{100 * rel:.2f} %"]
            rows.append(row)
        widths = [max(len(r[c]) for r in [head, *rows]) for c in range(len(head))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [head, *rows]]
        lines.insert(1, "  ".join("-" * w for w in widths))
        legend = ["", "elasticity = d ln metric / d ln input (the % change of the metric per 1 % of the input)"]
        if any(e.method == METHOD_FORWARD_MODE for e in self.entries):
            legend.append("forward-mode: jax.jacfwd of the request-local fixed-schedule model of this run (exact for "
                          "the simulated schedule; leaves out schedule changes)")
        if any(e.method != METHOD_FORWARD_MODE for e in self.entries):
            legend.append(f"FD: differences of whole runs; rate central at ±{100 * self.step:g} %, integer settings "
                          f"one-sided over +max(1, round({self.step:g}·N)), per unit")
        if self.checked:
            legend.append(f"check: central differences of whole re-simulations at ±{100 * self.step:g} % of each "
                          "coefficient (α₀..α₂ by whole µs; a zero coefficient one-sided upward)")
        legend += [f"note: {n}" for n in self.notes]
        return "\n".join(lines + legend) + "\n"


def _input_unit(name: str) -> str | None:
    k = coefficient_index(name)
    if k is None:
        return SETTING_UNITS[name]
    return "us" if k < F.LAG else None   # α₃ is in steps; each beta has its own unit (fits/*.yaml)


def _entry_dict(e: Entry) -> dict:
    d = {"metric": e.metric, "input": e.input, "derivative": e.derivative, "elasticity": e.elasticity,
         "method": e.method, "step": e.step}
    if e.check is not None:
        d["check"] = {"derivative": e.check, "step": e.check_step, "method": e.check_method, "rel_diff": e.rel_diff}
    return d


def _num(x: float) -> str:
    return f"{x + 0.0:.6g}"   # + 0.0: no "-0"


def _method_label(method: str, step: float | None) -> str:
    if method == METHOD_FORWARD_MODE:
        return "forward-mode"
    if method == METHOD_CENTRAL:
        return f"central FD (h={step:.4g})"
    return f"one-sided FD (+{step:g})"


# --------------------------------------------------------------------------- entry point


def check_model(model, wrt: Sequence[str]) -> None:
    """Coefficient inputs need the linear trained-physics modes (10 or 11 betas)."""
    coeffs = [w for w in wrt if coefficient_index(w) is not None]
    if not coeffs or (model.kind == "trained-physics" and model.num_betas >= F.MIN_FIT_BETAS):
        return
    why = ("--latency-model roofline is not linear in coefficients" if model.kind != "trained-physics"
           else f"{model.num_betas} betas select the max-form prefill/decode mode, which is not linear in beta")
    raise ConfigError(f"--wrt: coefficients ({', '.join(coeffs[:3])}{', ...' if len(coeffs) > 3 else ''}) can be "
                      f"differentiated for trained-physics with {F.MIN_FIT_BETAS} or 11 betas only ({why}); give "
                      "settings only, e.g. --wrt rate,max-num-seqs")


def sensitivities(run: ResolvedScenario, metrics: Sequence[str] = DEFAULT_METRICS, wrt: Sequence[str] | None = None, *,
                  settings: Mapping[str, float] | None = None, vary: Vary | None = None, check: bool = False,
                  step: float = DEFAULT_STEP, base: Simulated | None = None,
                  progress: Progress | None = None) -> Table:
    """Derivatives of `metrics` (names of METRICS) of the scenario `run` (single instance) with
    respect to `wrt` (names as `parse_wrt` takes them; None: every coefficient). Settings take
    their base value from `settings`, else the scenario (`base_settings`), and are varied by
    `vary` (default `vary_params`: integer settings only; `vary_config(run.config)` re-resolves
    the scenario, rate included).
    `check` adds central differences of whole re-simulations for the coefficients. `base`
    reuses a simulation of `run`."""
    metrics = parse_metrics(",".join(metrics))                     # validated, canonical names
    num_betas = run.latency_model.num_betas
    wrt = parse_wrt(None if wrt is None else ",".join(wrt), num_betas)
    check_model(run.latency_model, wrt)
    coeffs = [w for w in wrt if coefficient_index(w) is not None]
    settings = {**base_settings(run), **(settings or {})}
    if vary is None:
        vary = vary_params(run)
    for w in wrt:
        if coefficient_index(w) is None and w not in settings:
            raise ConfigError(f"--wrt {w}: its base value is unknown for this run")
    if not (math.isfinite(step) and 0 < step < 1):
        raise ConfigError(f"--fd-step {step:g}: must be a fraction in (0, 1), e.g. 0.05")

    say = progress or (lambda _: None)
    if base is None:
        say("simulating the base run")
        base = simulate(run)
    simulated = metric_values(base, metrics)
    theta = theta_of(run)
    jac, notes = forward_mode(base, metrics) if coeffs else (None, [])
    if coeffs and base.scenario.sessions is not None and getattr(base.scenario.sessions, "num_sessions", 0):
        notes.append("closed-loop sessions: later rounds arrive when earlier ones complete; the forward-mode "
                     "derivatives hold those arrival times fixed")

    entries: list[Entry] = []
    input_values: dict[str, float] = {}
    for i, name in enumerate(wrt):
        k = coefficient_index(name)
        x = float(theta[k]) if k is not None else float(settings[name])
        input_values[name] = x
        if k is not None:
            deriv, method, h = jac[:, k], METHOD_FORWARD_MODE, None
            fd = None
            if check:
                say(f"checking {input_label(name)} by re-simulation ({i + 1}/{len(wrt)})")
                fd = coefficient_difference(base, k, metrics, step, slope=deriv)
        else:
            say(f"differencing {name} by re-simulation ({i + 1}/{len(wrt)})")
            d = setting_difference(base, name, x, vary, metrics, step)
            deriv, method, h, fd = d.derivative, d.method, d.step, None
        for j, m in enumerate(metrics):
            value = float(simulated[j])
            elasticity = float(deriv[j]) * x / value if value != 0 else None
            entries.append(Entry(metric=m, input=name, derivative=float(deriv[j]) + 0.0, elasticity=elasticity,
                                 method=method, step=h,
                                 check=None if fd is None else float(fd.derivative[j]),
                                 check_step=None if fd is None else fd.step,
                                 check_method=None if fd is None else fd.method))
    entries.sort(key=lambda e: metrics.index(e.metric))   # stable: inputs keep their order per metric
    return Table(metrics=metrics, inputs=wrt, metric_values=dict(zip(metrics, map(float, simulated))),
                 input_values=input_values, entries=tuple(entries), step=step, notes=tuple(notes), checked=check)
