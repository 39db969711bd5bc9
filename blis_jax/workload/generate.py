"""Workload spec v2 → `RequestSet` (spec §4.6–4.9, §4.14).

Pipeline: inference-perf expansion → cohort expansion → per-client rates → per-client rows →
merge (stable sort by arrival, clients in spec order) → truncate to `num_requests` →
`make_request_set` (request ids 0..N-1 in arrival order).

**Rates** (§4.6). Without lifecycles, rate_i = aggregate_rate·f_i/Σf. With lifecycles,
rate_i = aggregate_rate·f_i/Σ_{j co-active with i} f_j, where j is co-active with i when one of
its windows overlaps one of i's ([start, end) intervals; always-on clients overlap everything).
So in a phased workload each phase runs at the aggregate rate.

**Arrivals.** A client's clock starts at 0; arrivals outside its windows are skipped and
generation stops at the end of its last window or at the horizon (arrivals at the horizon are
kept). A client with any window override (`trace_rate`, `arrival`, distributions) is generated
per window instead: count = ⌈rate·duration⌉ (rate = `trace_rate`, else the client's share),
IATs sampled from the window's process and rescaled to span the window, lengths from the
window's distributions. Each client is capped at 2·num_requests rows; the merged list is cut
to num_requests. Generation is time-bounded internally (grow a time bound T until N merged
arrivals fall before it), which gives exactly the rows of the "cap, merge, truncate" rule.

**Randomness**: `generate_workload` generates exactly as BLIS does, from Go `math/rand`
streams in BLIS's draw order (`go_generator.py`, blis-rng.md §4–§8): same (spec, seed) as a
`blis run` → the same requests. The keyed-JAX sampling functions below (`_generate`,
`_client_rows`, …) are the previous generator; only session plans without Go-drawn lengths
still reach them (`sessions.py`).

**Prefix groups** (§4.7): a group's prefix length is that of the first client using it (50 if
unset); `input_len` = prefix + sampled input. **Cohorts** (§4.8) expand into `<id>-<j>`
members with rate_fraction/population and diurnal / spike / drain lifecycles.

**Sessions** (§4.9). Open-loop multi-turn clients (`closed_loop: false`) are generated in
full: every arrival starts a session (only the first with `single_session`) whose round r
arrives at start + r·think_time + Σ_{r'<r} output_len_{r'} with fresh lengths; `accumulate`
makes round r's input prefix + Σ_{r'<r}(input + output) + new input. Closed-loop sessions
(the default for multi-turn, and `concurrency` users) depend on completion times, which only
the engine knows: `sessions="error"` (default) raises a ConfigError naming the key;
`sessions="first_round"` returns the round-0 requests plus one `SessionPlan` per session,
the data the engine needs to inject rounds 1.. later (`workload.sessions.closed_loop_requests`).
A concurrency client's N users start at u·think/N (u = 0..N−1), one request each; the rest is
generated in the loop.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path

import jax
import numpy as np

from blis_jax.errors import ConfigError
from blis_jax.workload.arrivals import (
    ArrivalProcess,
    fold,
    index_range,
    make_arrival,
    normalized_arrivals_us,
)
from blis_jax.workload.distribution import MAX_GENERATED_REQUESTS, workload_key
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
CLIENT_STREAM = 0x636C6E74          # ASCII "clnt"
# Sub-streams of a client (or window, or session-round) key.
ARRIVAL, INPUT, OUTPUT, REASON, TEXT = 0, 1, 2, 3, 4
MODALITIES = ("image", "audio", "video")
_MODALITY_STREAMS = {"image": (5, 6), "audio": (7, 8), "video": (9, 10)}   # (count, tokens)
WINDOW, ROUND, POOL = 64, 65, 66
MAX_ITEMS_PER_REQUEST = 4096
_MAX_IAT_US = 2**46                 # keeps int64 cumulative sums of a 64k chunk from overflowing
_MAX_CHUNK = 1 << 16
DIURNAL_HOUR_US = 3_600_000_000
DRAIN_SEGMENTS = 10


# ------------------------------------------------------------------------------ results


@dataclasses.dataclass(frozen=True, eq=False)
class SessionPlan:
    """A closed-loop session whose round 0 is in the request set.

    The engine injects round r+1 at round r's completion + think time, with lengths from
    `round_key(r + 1)` at index `start_index` (same sub-streams as round 0), the input growing
    by the previous round's input and output when `context_growth == "accumulate"`, up to
    `max_rounds` rounds (0 = unlimited: concurrency users, bounded by the global follow-up
    budget num_requests − initial requests; their follow-ups' lengths come from a pool per
    client, see workload/sessions.py).
    """

    session_id: str
    client_index: int
    request_id: int          # the round-0 request
    max_rounds: int
    think_time_us: int
    context_growth: str
    timeout_us: int          # applied to follow-ups (300 s when the client sets none)
    prefix_len: int
    start_index: int         # request index of the session start in its key's streams
    base_key: jax.Array      # client key, or window key for per-window clients
    input_dist: object = None   # length distributions of the session's client or window
    output_dist: object = None
    # Lengths of rounds 1.. drawn from the session's Go stream (BLIS's blueprint); concurrency
    # users: the follow-ups their stream would give, in order. None: drawn from `base_key`.
    fresh: np.ndarray | None = None
    output: np.ndarray | None = None

    def round_key(self, round_index: int) -> jax.Array:
        if round_index == 0:
            return self.base_key
        return fold(fold(self.base_key, ROUND), round_index)


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
        prefix_len=s.prefix_len, start_index=0, base_key=None, fresh=s.fresh, output=s.output)
        for s in gw.sessions)
    return GeneratedWorkload(requests=requests, sessions=plans, clients=clients, seed=seed, num_requests=n)


def client_key(seed: int, index: int) -> jax.Array:
    """Typed key of client `index` (position after cohort expansion) for `seed`."""
    return fold(fold(workload_key(seed), CLIENT_STREAM), index)


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
            active = max(1, round(DIURNAL_HOUR_US * m))
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


# ---------------------------------------------------------------------------- generation


@dataclasses.dataclass
class _Starts:
    """Arrival times of requests (or session starts) drawn from one key."""

    key: jax.Array
    times: np.ndarray              # int64 µs
    idx: np.ndarray                # int64 request index in `key`'s streams
    input: LengthDistribution | None
    output: LengthDistribution


@dataclasses.dataclass
class _Rows:
    arrival: np.ndarray
    fresh: np.ndarray              # input tokens beyond the shared prefix (context included)
    output: np.ndarray
    round_index: np.ndarray
    session: np.ndarray            # session ordinal within the client, -1 for single-turn rows
    reason: np.ndarray
    parts: dict[str, np.ndarray]   # text/image/audio/video tokens (multimodal clients)
    plan: np.ndarray               # index into the client's plans, -1 for none
    plans: list[dict]

    @staticmethod
    def concat(rows: list[_Rows]) -> _Rows:
        plans, plan_cols = [], []
        for r in rows:
            plan_cols.append(np.where(r.plan >= 0, r.plan + len(plans), -1))
            plans.extend(r.plans)
        keys = sorted({k for r in rows for k in r.parts})
        return _Rows(*(np.concatenate([getattr(r, f) for r in rows]) for f in
                       ("arrival", "fresh", "output", "round_index", "session", "reason")),
                     parts={k: np.concatenate([r.parts.get(k, np.zeros(len(r.arrival), np.int64)) for r in rows])
                            for k in keys},
                     plan=np.concatenate(plan_cols), plans=plans)

    def take(self, sel) -> _Rows:
        return _Rows(self.arrival[sel], self.fresh[sel], self.output[sel], self.round_index[sel], self.session[sel],
                     self.reason[sel], {k: v[sel] for k, v in self.parts.items()}, self.plan[sel], self.plans)


def _generate(clients: tuple[ResolvedClient, ...], seed: int, n: int, horizon: int | None) -> GeneratedWorkload:
    cap = 2 * n if n > 0 else MAX_GENERATED_REQUESTS
    hard = math.inf if horizon is None else float(horizon)
    keys = [client_key(seed, rc.index) for rc in clients]
    bound = _initial_bound(clients, n, hard)
    while True:
        per_client, more = [], False
        for rc, key in zip(clients, keys):
            rows, client_more = _client_rows(rc, key, bound, hard, cap)
            per_client.append(rows)
            more |= client_more
        in_bound = [r.arrival <= bound for r in per_client]
        total = sum(int(m.sum()) for m in in_bound)
        if total > MAX_GENERATED_REQUESTS:
            raise ConfigError(f"num_requests / horizon: {total} requests would be generated (limit "
                              f"{MAX_GENERATED_REQUESTS}); set num_requests or a shorter horizon")
        if not more or (n > 0 and total >= n):
            break
        bound *= 2
    return _assemble(clients, keys, [r.take(m) for r, m in zip(per_client, in_bound)], n, seed)


def _initial_bound(clients: tuple[ResolvedClient, ...], n: int, hard: float) -> float:
    if n == 0:
        return hard
    rate_per_us = sum(1.0 / rc.arrival.mean_iat_us for rc in clients
                      if rc.arrival is not None and not rc.per_window and rc.arrival.mean_iat_us > 0)
    if rate_per_us <= 0:
        guess = 1e9
    else:
        guess = 1.25 * n / rate_per_us + 10 * max(rc.arrival.mean_iat_us for rc in clients
                                                   if rc.arrival is not None and not rc.per_window)
    return min(max(guess, 1.0), hard)


def _client_rows(rc: ResolvedClient, key: jax.Array, bound: float, hard: float, cap: int) -> tuple[_Rows, bool]:
    """Rows of one client with arrival ≤ bound (complete up to it), and whether a larger
    bound could add rows."""
    c = rc.spec
    mt = c.multi_turn
    open_loop = mt is not None and not c.is_closed_loop
    rounds = mt.max_rounds if open_loop else 1
    max_starts = 1 if (mt is not None and mt.single_session) else -(-cap // rounds)
    if c.concurrency is not None:
        users = min(c.concurrency, cap)
        think = c.think_time_us or 0
        u = np.arange(users, dtype=np.int64)
        starts, more = [_Starts(key, u * think // c.concurrency, u, rc.input, rc.output)], False
    elif rc.per_window:
        starts, more = _window_starts(rc, key, hard, max_starts), False
    else:
        times, idx, more = _continuous_starts(rc, key, bound, min(hard, rc.last_end_us), max_starts)
        starts = [_Starts(key, times, idx, rc.input, rc.output)]
    segments, sessions_so_far = [], 0
    for s in starts:
        seg = _session_rows(rc, s, rounds, open_loop)
        seg.session = np.where(seg.session >= 0, seg.session + sessions_so_far, -1)   # ordinals across windows
        sessions_so_far += len(s.times)
        segments.append(seg)
    rows = _Rows.concat(segments) if segments else _empty_rows()
    if len(rows.arrival) > cap:            # the cap counts rows in generation order
        rows = rows.take(slice(0, cap))
        more = False
    return rows.take(rows.arrival <= hard), more


def _empty_rows() -> _Rows:
    e = np.zeros(0, dtype=np.int64)
    return _Rows(e, e, e, e, e, np.zeros(0), {}, e, [])


def _continuous_starts(rc: ResolvedClient, key: jax.Array, bound: float, hard: float,
                       max_starts: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """Arrivals of a continuous-mode client up to min(bound, hard), skipping those outside its
    windows; at most `max_starts`. Returns (times, indices, more_possible)."""
    proc = rc.arrival
    akey = fold(key, ARRIVAL)
    stop = min(bound, hard)
    w_start = np.array([w.start_us for w in rc.windows], dtype=np.int64)
    w_end = np.array([w.end_us for w in rc.windows], dtype=np.int64)
    span = stop if math.isfinite(stop) else proc.mean_iat_us * max_starts
    chunk = int(min(_MAX_CHUNK, max(64, 1 << int(1.1 * span / max(proc.mean_iat_us, 1e-9) + 16).bit_length())))
    t, i0, taken = 0, 0, 0
    times_out, idx_out = [], []
    while taken < max_starts:
        idx = index_range(i0, chunk)
        times = t + np.cumsum(np.minimum(proc.iats_us(akey, idx), _MAX_IAT_US))
        past = times > stop
        cut = int(np.argmax(past)) if past.any() else chunk
        tt, ii = times[:cut], idx[:cut]
        if len(rc.windows):
            w = np.searchsorted(w_start, tt, side="right") - 1
            active = (w >= 0) & (tt < w_end[np.maximum(w, 0)])
            tt, ii = tt[active], ii[active]
        take = min(len(tt), max_starts - taken)
        times_out.append(tt[:take])
        idx_out.append(ii[:take])
        taken += take
        if cut < chunk:
            return np.concatenate(times_out), np.concatenate(idx_out), bound < hard and taken < max_starts
        t, i0, chunk = int(times[-1]), i0 + chunk, min(chunk * 2, _MAX_CHUNK)
    return np.concatenate(times_out), np.concatenate(idx_out), False


def window_count(rate: float, duration_us: int) -> int:
    """⌈rate·duration⌉ requests of a window, robust to float noise (count/d·d is count)."""
    return math.ceil(rate * duration_us / 1e6 - 1e-9)


def _window_starts(rc: ResolvedClient, key: jax.Array, hard: float, max_starts: int) -> list[_Starts]:
    out, taken = [], 0
    for w_i, w in enumerate(rc.windows):
        if taken >= max_starts or w.start_us > hard:
            break
        full = window_count(w.rate, w.end_us - w.start_us)
        if full > MAX_GENERATED_REQUESTS:
            raise ConfigError(f"{rc.path}.lifecycle.windows[{w_i}]: {full} requests in one window "
                              f"(limit {MAX_GENERATED_REQUESTS}); lower its rate")
        count = min(full, max_starts - taken)
        wkey = fold(fold(key, WINDOW), w_i)
        times = normalized_arrivals_us(w.arrival, fold(wkey, ARRIVAL), full, w.start_us,
                                       w.end_us - w.start_us)[:count]
        keep = times <= hard
        out.append(_Starts(wkey, times[keep], index_range(0, count)[keep], w.input, w.output))
        taken += int(keep.sum())
    return out


def _sample_round(rc: ResolvedClient, starts: _Starts, base: jax.Array, idx: np.ndarray):
    """Fresh input tokens, output tokens, reason ratio and modality parts of requests `idx`."""
    parts: dict[str, np.ndarray] = {}
    if rc.multimodal is not None:
        mm = rc.multimodal
        text = mm["text"].sample(fold(base, TEXT), idx)
        parts = {"text": text}
        fresh = text.copy()
        for m in MODALITIES:
            if m not in mm:
                parts[m] = np.zeros(len(idx), dtype=np.int64)
                continue
            count_stream, token_stream = _MODALITY_STREAMS[m]
            count_dist = mm.get(f"{m}_count")
            counts = (count_dist.sample(fold(base, count_stream), idx, floor_at=0)
                      if count_dist is not None else np.ones(len(idx), dtype=np.int64))
            if counts.size and counts.max() > MAX_ITEMS_PER_REQUEST:
                raise ConfigError(f"{rc.path}.multimodal.{m}_count_distribution: a request drew {counts.max()} "
                                  f"items (limit {MAX_ITEMS_PER_REQUEST})")
            total = np.zeros(len(idx), dtype=np.int64)
            item_key = fold(base, token_stream)
            for item in range(int(counts.max()) if counts.size else 0):
                has = counts > item
                total[has] += mm[m].sample(fold(item_key, item), idx[has])
            parts[m] = total
            fresh += total
    else:
        fresh = starts.input.sample(fold(base, INPUT), idx)
    output = starts.output.sample(fold(base, OUTPUT), idx)
    reason = (rc.reason.sample(fold(base, REASON), idx) / 100.0 if rc.reason is not None
              else np.zeros(len(idx)))
    return fresh, output, reason, parts


def _session_rows(rc: ResolvedClient, starts: _Starts, rounds: int, open_loop: bool) -> _Rows:
    """Rows for the starts: single-turn, open-loop sessions (all rounds), or round 0 of
    closed-loop sessions (with plans)."""
    c = rc.spec
    mt = c.multi_turn
    is_session = mt is not None or c.concurrency is not None
    n = len(starts.times)
    cols = []
    context = np.zeros(n, dtype=np.int64)
    offset = np.zeros(n, dtype=np.int64)
    for r in range(rounds):
        base = starts.key if r == 0 else fold(fold(starts.key, ROUND), r)
        fresh, output, reason, parts = _sample_round(rc, starts, base, starts.idx)
        think = mt.think_time_us if mt is not None else 0
        arrival = starts.times + r * think + offset
        cols.append((arrival, context + fresh, output, reason, parts))
        offset = offset + output
        if mt is not None and mt.context_growth == "accumulate":
            context = context + fresh + output
    # Session-major order: all rounds of session 0, then session 1, ...
    def stack(values):
        return np.stack(values, axis=1).reshape(-1) if values else np.zeros(0, dtype=np.int64)
    part_keys = cols[0][4].keys() if cols else ()
    session = np.repeat(np.arange(n, dtype=np.int64), rounds) if is_session else np.full(n, -1, dtype=np.int64)
    plans: list[dict] = []
    plan = np.full(n * rounds, -1, dtype=np.int64)
    if is_session and not open_loop:
        think = c.think_time_us if c.concurrency is not None else mt.think_time_us
        plans = [{"max_rounds": 0 if c.concurrency is not None else mt.max_rounds, "think_time_us": think or 0,
                  "context_growth": mt.context_growth if mt is not None else "",
                  "start_index": int(starts.idx[j]), "base_key": starts.key,
                  "input_dist": starts.input, "output_dist": starts.output} for j in range(n)]
        plan = np.arange(n, dtype=np.int64)
    return _Rows(arrival=stack([x[0] for x in cols]), fresh=stack([x[1] for x in cols]),
                 output=stack([x[2] for x in cols]),
                 round_index=np.tile(np.arange(rounds, dtype=np.int64), n),
                 session=session, reason=stack([x[3] for x in cols]).astype(np.float64),
                 parts={k: stack([x[4][k] for x in cols]) for k in part_keys}, plan=plan, plans=plans)


def _format_float(x: float) -> str:
    s = repr(float(x))
    return s.removesuffix(".0")


def _assemble(clients: tuple[ResolvedClient, ...], keys: list[jax.Array], per_client: list[_Rows],
              n: int, seed: int) -> GeneratedWorkload:
    counts = [len(r.arrival) for r in per_client]
    owner = np.repeat(np.arange(len(clients), dtype=np.int64), counts)
    rows = _Rows.concat(per_client) if per_client else _empty_rows()
    # Global plan index → (client, plan); _Rows.concat already offsets plan ids per client.
    plan_owner = np.repeat(np.arange(len(clients)), [len(r.plans) for r in per_client])
    order = np.argsort(rows.arrival, kind="stable")
    if n > 0:
        order = order[:n]
    rows, owner = rows.take(order), owner[order]
    total = len(order)
    prefix_len = np.array([rc.prefix_len for rc in clients], dtype=np.int64)[owner] if total else np.zeros(0, np.int64)
    timeout = np.array([rc.timeout_us for rc in clients], dtype=np.int64)[owner] if total else np.zeros(0, np.int64)

    def label(fn) -> np.ndarray:
        values = np.array([fn(rc) for rc in clients] or [""], dtype=object)
        return values[owner].astype(str) if total else np.zeros(0, dtype="<U1")

    session_ids = np.array([f"session-{o}-{s}" if s >= 0 else "" for o, s in zip(owner, rows.session)],
                           dtype=object).astype(str) if total else np.zeros(0, dtype="<U1")
    trace_columns: dict[str, np.ndarray] = {}
    if any(rc.spec.streaming for rc in clients):
        trace_columns["streaming"] = label(lambda rc: "true" if rc.spec.streaming else "false")
    if any(rc.reason is not None for rc in clients):
        trace_columns["reason_ratio"] = np.array([_format_float(x) for x in rows.reason], dtype=object).astype(str) \
            if total else np.zeros(0, dtype="<U1")
    if any(rc.spec.slo_target_us is not None for rc in clients):
        trace_columns["slo_target_us"] = label(lambda rc: "" if rc.spec.slo_target_us is None
                                               else str(rc.spec.slo_target_us))
    if any(rc.spec.adapter for rc in clients):
        trace_columns["adapter"] = label(lambda rc: rc.spec.adapter)
    for part, values in rows.parts.items():
        trace_columns[f"{part}_tokens"] = values.astype(str)
    requests = make_request_set(
        request_id=np.arange(total, dtype=np.int64), arrival_us=rows.arrival,
        input_len=prefix_len + rows.fresh, output_len=rows.output,
        deadline_us=np.where(timeout > 0, rows.arrival + timeout, 0),
        prefix_group=label(lambda rc: rc.prefix_group), prefix_len=prefix_len,
        slo_class=label(lambda rc: rc.spec.slo_class), tenant_id=label(lambda rc: rc.spec.tenant_id),
        client_id=label(lambda rc: rc.spec.id), session_id=session_ids, round_index=rows.round_index,
        model=label(lambda rc: rc.spec.model), trace_columns=trace_columns)
    plans = []
    for row in np.flatnonzero(rows.plan >= 0):
        p = rows.plans[rows.plan[row]]
        rc = clients[int(plan_owner[rows.plan[row]])]
        plans.append(SessionPlan(
            session_id=str(session_ids[row]), client_index=rc.index, request_id=int(row),
            max_rounds=p["max_rounds"], think_time_us=p["think_time_us"], context_growth=p["context_growth"],
            timeout_us=rc.timeout_us or SESSION_DEFAULT_TIMEOUT_US, prefix_len=rc.prefix_len,
            start_index=p["start_index"], base_key=p["base_key"],
            input_dist=p["input_dist"], output_dist=p["output_dist"]))
    return GeneratedWorkload(requests=requests, sessions=tuple(plans), clients=clients, seed=seed, num_requests=n)
