"""Workload spec v2 → `RequestSet` (spec §4.6–4.9, blis-rng.md §4–§8).

`generate_workload` validates the spec (`resolve_clients`: cohort expansion, rates, samplers;
errors name the key), then generates exactly as BLIS does, from Go `math/rand` streams in
BLIS's draw order (`go_generator.py`): same (spec, seed) as a `blis run` → the same requests.
Inference-perf sections use BLIS's own expansion (normalized-exponential and Poisson factories),
except the blis-jax `open-loop` mode, which generates its `expand_inference_perf` clients.

**Rates** (blis-rng §3.4). Without lifecycles, λ_i = aggregate_rate·(f_i/Σf)/10⁶ per µs. With
lifecycles, the sum runs over the clients whose windows overlap i's (always-on clients overlap
everything), so in a phased workload each phase runs at the aggregate rate.

**Arrivals** (§5.3). A client's clock starts at 0; arrivals outside its windows draw nothing
more, generation stops past its last window or at the horizon (arrivals at or past the horizon
are never generated). If any window overrides `trace_rate`, `arrival` or a distribution, every
windowed client is generated window by window (§5.6): ⌈rate·duration⌉ IATs rescaled to span
the window, the last (on the window end) not emitted. Each client stops at 2·num_requests rows;
the merged list (stable sort by arrival) is cut to num_requests.

**Prefix groups** (§5.2): a group's prefix length is that of the first client using it (50 if
unset); `input_len` = prefix + sampled input. **Cohorts** expand into `<id>-<j>` members with
rate_fraction/population and diurnal / spike / drain lifecycles.

**Sessions** (§5.4, §6, §7). Open-loop multi-turn clients (`closed_loop: false`) are generated
in full: round r+1 arrives at round r's arrival + think time + its output length; `accumulate`
makes round r's input prefix + Σ_{r'<r}(input + output) + new input. Closed-loop sessions (the
default for multi-turn, and `concurrency` users) depend on completion times, which only the
engine knows: `sessions="error"` (default) raises a ConfigError naming the key;
`sessions="first_round"` returns the round-0 requests plus one `SessionPlan` per session with
its follow-up lengths drawn from its own Go stream (`workload.sessions.closed_loop_requests`).
A concurrency client's N users start at u·think/N (u = 0..N−1), one request each; the rest is
generated in the loop.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from blis_jax.errors import ConfigError
from blis_jax.workload.arrivals import ArrivalProcess, make_arrival
from blis_jax.workload.inference_perf import (
    expand_inference_perf,
    is_open_loop_multi_turn,
    label_open_loop_users,
)
from blis_jax.workload.lengths import LengthDistribution, make_length
from blis_jax.workload.requests import RequestSet, make_request_set
from blis_jax.workload.spec import (
    DEFAULT_PREFIX_LENGTH,
    DEFAULT_SEED,
    ArrivalSpec,
    ClientSpec,
    CohortSpec,
    DistSpec,
    LifecycleSpec,
    WindowSpec,
    WorkloadSpec,
    load_spec,
    parse_spec,
)

SESSION_DEFAULT_TIMEOUT_US = 300_000_000
SESSION_MODES = ("error", "first_round")
MODALITIES = ("image", "audio", "video")
DIURNAL_HOUR_US = 3_600_000_000
DRAIN_SEGMENTS = 10


# ------------------------------------------------------------------------------ results


@dataclasses.dataclass(frozen=True, eq=False)
class SessionPlan:
    """A closed-loop session whose round 0 is in the request set.

    The engine injects round r+1 at round r's completion + think time, up to `max_rounds`
    rounds (0 = unlimited: concurrency users, bounded by the global follow-up budget
    num_requests − initial requests, see workload/sessions.py). `fresh` / `output`: the new
    input and output lengths of rounds 1.., drawn from the session's own Go stream (BLIS's
    blueprint stream, blis-rng §6–§7); the input grows by the previous round's input and output
    when `context_growth == "accumulate"`.
    """

    session_id: str
    client_index: int
    request_id: int          # the round-0 request
    max_rounds: int
    think_time_us: int
    context_growth: str
    timeout_us: int          # applied to follow-ups (300 s when the client sets none)
    prefix_len: int
    fresh: np.ndarray
    output: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class ResolvedWindow:
    start_us: int
    end_us: int
    rate: float                            # req/s used for this window
    arrival: ArrivalProcess | None
    input: LengthDistribution | None
    output: LengthDistribution


@dataclasses.dataclass(frozen=True, eq=False)
class ResolvedClient:
    """A client after cohort expansion and rate allocation, with built samplers."""

    index: int
    path: str
    spec: ClientSpec
    rate: float                            # req/s after (per-phase) normalization
    arrival: ArrivalProcess | None         # None for concurrency clients
    input: LengthDistribution | None       # None when multimodal parts define the input
    output: LengthDistribution
    prefix_group: str
    prefix_len: int
    timeout_us: int                        # 0 = none
    windows: tuple[ResolvedWindow, ...]
    per_window: bool
    multimodal: Mapping[str, LengthDistribution] | None
    reason: LengthDistribution | None

    @property
    def last_end_us(self) -> float:
        return float(self.windows[-1].end_us) if self.windows else math.inf


@dataclasses.dataclass(frozen=True, eq=False)
class GeneratedWorkload:
    requests: RequestSet
    sessions: tuple[SessionPlan, ...]
    clients: tuple[ResolvedClient, ...]
    seed: int
    num_requests: int = 0          # the num_requests used (0 = none): bounds concurrency users' follow-ups


# --------------------------------------------------------------------------- public API


def generate_requests(spec: WorkloadSpec | Mapping | str | Path, seed: int | None = None, **kwargs) -> RequestSet:
    """Spec (object, parsed mapping or file path) → RequestSet. See `generate_workload`."""
    return generate_workload(spec, seed, **kwargs).requests


def generate_workload(spec: WorkloadSpec | Mapping | str | Path, seed: int | None = None, *,
                      num_requests: int | None = None, horizon_us: int | None = None,
                      timeout_s: float | None = None, sessions: str = "error",
                      synthesized: bool = False) -> GeneratedWorkload:
    """Generate the requests of a v2 spec exactly as BLIS does (Go streams, `go_generator`).

    `seed`, `num_requests`, `horizon_us` override the spec's values (BLIS `--seed`,
    `--num-requests`, `--horizon`); `timeout_s` (BLIS `--timeout`, seconds) overrides every
    client's timeout (< 0 disables), as does `synthesized` (a spec built from `run`'s flags,
    whose timeout BLIS always applies). `sessions`: "error" rejects closed-loop sessions,
    "first_round" returns their round 0 plus `SessionPlan`s.
    """
    from blis_jax.workload import go_generator as go

    if sessions not in SESSION_MODES:
        raise ConfigError(f"sessions: {sessions!r}; use one of {', '.join(SESSION_MODES)}")
    if isinstance(spec, (str, Path)):
        spec = load_spec(spec)
    elif not isinstance(spec, WorkloadSpec):
        spec = parse_spec(spec)
    if spec.servegen_data is not None:
        raise ConfigError("servegen_data: ServeGen import is not supported yet; convert the ServeGen data "
                          "into explicit clients with lifecycle windows")
    _check_sessions_supported(spec, sessions)
    seed = _pick_int("seed", seed, spec.seed if spec.seed is not None else DEFAULT_SEED)
    if is_open_loop_multi_turn(spec):
        expanded = expand_inference_perf(spec)
        expanded, go_clients = go.expand_clients(expanded, timeout_s, synthesized)
        for c in go_clients:
            c.draws_tokens = False
    else:
        expanded, go_clients = go.expand_clients(spec, timeout_s, synthesized)
    n = _pick_int("num_requests", num_requests, expanded.num_requests)
    horizon = _pick_int("horizon", horizon_us, expanded.horizon or 0) or None
    if n < 0 or (horizon is not None and horizon < 0):
        raise ConfigError("num_requests and horizon must be ≥ 0")
    clients = resolve_clients(expanded, timeout_s=timeout_s)   # validation, and the clients' labels
    if sessions == "error":
        for rc in clients:
            _reject_closed_loop(rc)
    if n == 0 and horizon is None:
        unbounded = [rc for rc in clients if _unbounded(rc)]
        if unbounded:
            raise ConfigError(f"num_requests: 0 and no horizon, but {unbounded[0].path} never stops "
                              "(always on); set num_requests or horizon")
    generated = _from_go(go.generate(expanded, go_clients, seed, n, horizon), clients, seed, n)
    return label_open_loop_users(generated) if is_open_loop_multi_turn(spec) else generated


def _from_go(gw, clients: tuple[ResolvedClient, ...], seed: int, n: int) -> GeneratedWorkload:
    """The engine's RequestSet and SessionPlans of a `go_generator.GoWorkload`."""
    rows = gw.rows
    total = len(rows)
    specs = [c.spec for c in gw.clients]

    def col(fn, dtype=np.int64):
        return np.array([fn(r) for r in rows], dtype=dtype) if total else np.zeros(0, dtype)

    def label(fn) -> np.ndarray:
        return np.array([fn(specs[r.client]) for r in rows], dtype=object).astype(str) if total \
            else np.zeros(0, dtype="<U1")

    owner = col(lambda r: r.client)
    used = sorted(set(owner.tolist()))
    trace_columns: dict[str, np.ndarray] = {}
    if any(specs[i].streaming for i in used):
        trace_columns["streaming"] = label(lambda c: "true" if c.streaming else "false")
    if any(specs[i].reasoning is not None for i in used):
        trace_columns["reason_ratio"] = np.array([_format_float(r.reason) for r in rows], dtype=object).astype(str)
    if any(specs[i].slo_target_us is not None for i in used):
        trace_columns["slo_target_us"] = label(lambda c: "" if c.slo_target_us is None else str(c.slo_target_us))
    if any(specs[i].adapter for i in used):
        trace_columns["adapter"] = label(lambda c: c.adapter)
    if any(r.parts is not None for r in rows):
        for k, part in enumerate(("text", "image", "audio", "video")):
            trace_columns[f"{part}_tokens"] = np.array(
                [str(r.parts[k]) if r.parts is not None else "0" for r in rows], dtype=object).astype(str)
    if any(r.group and not r.trace_group for r in rows):
        # BLIS leaves the prefix group of session rounds out of the trace (their tokens still
        # start with the group's prefix, which is what the engine's group models).
        trace_columns["prefix_group"] = np.array([r.group if r.trace_group else "" for r in rows],
                                                 dtype=object).astype(str)
        trace_columns["prefix_length"] = col(lambda r: r.prefix_len).astype(str)
    requests = make_request_set(
        request_id=np.arange(total, dtype=np.int64), arrival_us=col(lambda r: r.arrival),
        input_len=col(lambda r: r.prefix_len + r.fresh), output_len=col(lambda r: r.output),
        deadline_us=col(lambda r: r.deadline),
        prefix_group=np.array([r.group for r in rows], dtype=object).astype(str) if total else np.zeros(0, "<U1"),
        prefix_len=col(lambda r: r.prefix_len),
        slo_class=label(lambda c: c.slo_class), tenant_id=label(lambda c: c.tenant_id),
        client_id=label(lambda c: c.id), session_id=np.array([r.session for r in rows], dtype=object).astype(str)
        if total else np.zeros(0, "<U1"),
        round_index=col(lambda r: r.round_index), model=label(lambda c: c.model), trace_columns=trace_columns)
    plans = tuple(SessionPlan(
        session_id=rows[s.row].session, client_index=s.client, request_id=s.row, max_rounds=s.max_rounds,
        think_time_us=s.think_time_us, context_growth=s.context_growth, timeout_us=s.timeout_us,
        prefix_len=s.prefix_len, fresh=s.fresh, output=s.output)
        for s in gw.sessions)
    return GeneratedWorkload(requests=requests, sessions=plans, clients=clients, seed=seed, num_requests=n)


def _pick_int(name: str, override, default) -> int:
    value = default if override is None else override
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{name}: {value!r} must be an integer")
    return int(value)


def _check_sessions_supported(spec: WorkloadSpec, sessions: str) -> None:
    ip = spec.inference_perf
    if sessions == "error" and ip is not None and ip.shared_prefix.enable_multi_turn_chat \
            and not is_open_loop_multi_turn(spec):
        raise ConfigError("inference_perf.shared_prefix.enable_multi_turn_chat: multi-turn chat runs closed-loop "
                          "sessions (each round arrives a think time after the previous one completes), which "
                          "need engine support that is not implemented yet; use enable_multi_turn_chat: false, "
                          "or generate_workload(..., sessions='first_round') for round 0 plus session plans")


def _reject_closed_loop(rc: ResolvedClient) -> None:
    c = rc.spec
    if c.concurrency is not None:
        raise ConfigError(f"{rc.path}.concurrency: closed-loop users (next request a think time after the "
                          "previous completes) exist only while the engine runs; use `blis-jax run "
                          "--workload-spec`, or generate_workload(..., sessions='first_round') and "
                          "workload.sessions.closed_loop_requests")
    if c.is_closed_loop:
        raise ConfigError(f"{rc.path}.reasoning.multi_turn: closed-loop sessions (the default for multi-turn: each "
                          "round arrives a think time after the previous one completes) need engine support that "
                          "is not implemented yet; set closed_loop: false to pre-generate every round open-loop, "
                          "or generate_workload(..., sessions='first_round') for round 0 plus session plans")


def _unbounded(rc: ResolvedClient) -> bool:
    mt = rc.spec.multi_turn
    return (rc.spec.concurrency is None and not rc.per_window and not rc.windows
            and not (mt is not None and mt.single_session))


# ------------------------------------------------------------------------ client setup


def expand_cohorts(spec: WorkloadSpec) -> list[tuple[str, ClientSpec]]:
    """Explicit clients followed by every cohort's members `<id>-<j>` (spec §4.8)."""
    out = [(f"clients[{i}]", c) for i, c in enumerate(spec.clients)]
    for ci, cohort in enumerate(spec.cohorts):
        lifecycle = cohort_lifecycle(cohort)
        share = (cohort.rate_fraction or 0.0) / cohort.population
        for j in range(cohort.population):
            group = cohort.prefix_group
            if group and cohort.prefix_sharing == "per_member":
                group = f"{group}-{j}"
            out.append((f"cohorts[{ci}] (member {j})", ClientSpec(
                id=f"{cohort.id}-{j}", tenant_id=cohort.tenant_id, slo_class=cohort.slo_class,
                model=cohort.model, adapter=cohort.adapter, rate_fraction=share, arrival=cohort.arrival,
                input_distribution=cohort.input_distribution, output_distribution=cohort.output_distribution,
                prefix_group=group, prefix_length=cohort.prefix_length, streaming=cohort.streaming,
                network=cohort.network, lifecycle=lifecycle, multimodal=cohort.multimodal,
                reasoning=cohort.reasoning, timeout=cohort.timeout, slo_target_us=cohort.slo_target_us,
                closed_loop=cohort.closed_loop)))
    return out


def cohort_lifecycle(cohort: CohortSpec) -> LifecycleSpec | None:
    """Lifecycle windows of each member: diurnal duty cycle, spike, or drain ramp."""
    if cohort.diurnal is not None:
        d = cohort.diurnal
        windows = []
        for h in range(24):
            m = (1 + math.cos(2 * math.pi * (h - d.peak_hour) / 24)) / 2 * (1 - 1 / d.peak_to_trough_ratio) \
                + 1 / d.peak_to_trough_ratio
            active = max(1, min(int(DIURNAL_HOUR_US * m), DIURNAL_HOUR_US))   # BLIS truncates (blis-rng §9.1)
            windows.append(WindowSpec(h * DIURNAL_HOUR_US, h * DIURNAL_HOUR_US + active))
        return LifecycleSpec(tuple(windows))
    if cohort.spike is not None:
        s = cohort.spike
        return LifecycleSpec((WindowSpec(s.start_time_us, s.start_time_us + s.duration_us,
                                         trace_rate=s.trace_rate / cohort.population),))
    if cohort.drain is not None:
        d = cohort.drain
        windows = [WindowSpec(0, d.start_time_us)] if d.start_time_us > 0 else []
        for k in range(DRAIN_SEGMENTS):
            seg_start = d.start_time_us + round(k * d.ramp_duration_us / DRAIN_SEGMENTS)
            seg_len = round(d.ramp_duration_us / DRAIN_SEGMENTS * (1 - k / DRAIN_SEGMENTS))
            if seg_len > 0:
                windows.append(WindowSpec(seg_start, seg_start + seg_len))
        return LifecycleSpec(tuple(windows))
    return None


def allocate_rates(aggregate_rate: float, clients: list[ClientSpec]) -> np.ndarray:
    """Per-client req/s (spec §4.6); concurrency clients get 0.

    Without lifecycles: aggregate·f_i/Σf. With any lifecycle: aggregate·f_i/Σ_{co-active j} f_j.
    Clients with identical windows are grouped, so cohorts of 100k members stay cheap.
    """
    f = np.array([(c.rate_fraction or 0.0) if c.concurrency is None else 0.0 for c in clients], dtype=np.float64)
    rates = np.zeros(len(clients), dtype=np.float64)
    if not len(clients) or aggregate_rate <= 0:
        return rates
    if all(c.lifecycle is None for c in clients):
        total = f.sum()
        return aggregate_rate * f / total if total > 0 else rates
    sig = [None if c.lifecycle is None else tuple((w.start_us, w.end_us) for w in c.lifecycle.windows)
           for c in clients]
    groups: dict = {}
    for s, fi in zip(sig, f):
        groups[s] = groups.get(s, 0.0) + fi
    keys = list(groups)
    co_sum = {a: sum(groups[b] for b in keys if _overlap(a, b)) for a in keys}
    for i, s in enumerate(sig):
        if co_sum[s] > 0:
            rates[i] = aggregate_rate * f[i] / co_sum[s]
    return rates


def _overlap(a, b) -> bool:
    if a is None or b is None:
        return True
    # Both sorted and non-overlapping within themselves: a two-pointer sweep.
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i][0] < b[j][1] and b[j][0] < a[i][1]:
            return True
        if a[i][1] <= b[j][1]:
            i += 1
        else:
            j += 1
    return False


def resolve_clients(spec: WorkloadSpec, timeout_s: float | None = None) -> tuple[ResolvedClient, ...]:
    """Expand cohorts, allocate rates, fix prefix lengths and timeouts, build the samplers."""
    members = expand_cohorts(spec)
    rates = allocate_rates(spec.aggregate_rate, [c for _, c in members])
    group_len: dict[str, int] = {}
    for _, c in members:
        if c.prefix_group and c.prefix_group not in group_len:
            group_len[c.prefix_group] = DEFAULT_PREFIX_LENGTH if c.prefix_length is None else c.prefix_length
    if timeout_s is not None and (not isinstance(timeout_s, (int, float)) or math.isnan(timeout_s) or timeout_s == 0):
        raise ConfigError(f"--timeout: {timeout_s!r} s is invalid; use seconds > 0, or < 0 to disable")
    out = []
    for i, (path, c) in enumerate(members):
        out.append(_resolve_client(i, path, c, float(rates[i]), group_len, timeout_s))
    return tuple(out)


def _length(d: DistSpec | None, path: str) -> LengthDistribution | None:
    return None if d is None else make_length(d.type, d.params, path)


def _arrival(a: ArrivalSpec | None, rate: float, path: str) -> ArrivalProcess:
    a = a or ArrivalSpec()
    return make_arrival(a.process, rate, cv=a.cv, shape=a.shape, scale=a.scale, path=path)


def _resolve_client(i: int, path: str, c: ClientSpec, rate: float, group_len: Mapping[str, int],
                    timeout_s: float | None) -> ResolvedClient:
    if timeout_s is not None:
        timeout = round(timeout_s * 1e6) if timeout_s > 0 else 0
    elif c.timeout is not None:
        timeout = c.timeout
    else:
        timeout = SESSION_DEFAULT_TIMEOUT_US if c.is_session_client else 0
    input_dist = _length(c.input_distribution, f"{path}.input_distribution")
    output_dist = _length(c.output_distribution, f"{path}.output_distribution")
    multimodal = None
    if c.multimodal is not None:
        mm = c.multimodal
        multimodal = {"text": _length(mm.text_distribution, f"{path}.multimodal.text_distribution") or input_dist}
        for m in MODALITIES:
            tokens = getattr(mm, f"{m}_distribution")
            count = getattr(mm, f"{m}_count_distribution")
            if count is not None and tokens is None:
                raise ConfigError(f"{path}.multimodal.{m}_distribution: missing; {m}_count_distribution needs "
                                  f"a token distribution per {m}")
            if tokens is not None:
                multimodal[m] = _length(tokens, f"{path}.multimodal.{m}_distribution")
                if count is not None:
                    multimodal[f"{m}_count"] = _length(count, f"{path}.multimodal.{m}_count_distribution")
    arrival = None if c.concurrency is not None else _arrival(c.arrival, rate, f"{path}.arrival")
    windows: list[ResolvedWindow] = []
    per_window = c.lifecycle is not None and any(w.has_overrides for w in c.lifecycle.windows)
    for w_i, w in enumerate(c.lifecycle.windows if c.lifecycle is not None else ()):
        wpath = f"{path}.lifecycle.windows[{w_i}]"
        w_rate = w.trace_rate if w.trace_rate is not None else rate
        windows.append(ResolvedWindow(
            w.start_us, w.end_us, w_rate,
            _arrival(w.arrival or c.arrival, w_rate, f"{wpath}.arrival") if per_window else None,
            _length(w.input_distribution, f"{wpath}.input_distribution") or input_dist,
            _length(w.output_distribution, f"{wpath}.output_distribution") or output_dist))
    reason = None
    if c.reasoning is not None and c.reasoning.reason_ratio_distribution is not None:
        reason = _length(c.reasoning.reason_ratio_distribution, f"{path}.reasoning.reason_ratio_distribution")
    return ResolvedClient(
        index=i, path=path, spec=c, rate=rate, arrival=arrival, input=input_dist, output=output_dist,
        prefix_group=c.prefix_group, prefix_len=group_len.get(c.prefix_group, 0) if c.prefix_group else 0,
        timeout_us=timeout, windows=tuple(windows), per_window=per_window, multimodal=multimodal, reason=reason)


def _format_float(x: float) -> str:
    s = repr(float(x))
    return s.removesuffix(".0")
