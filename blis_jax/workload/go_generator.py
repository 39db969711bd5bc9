"""BLIS's request generator on Go streams (blis-rng.md §4–§8): seeded workloads identical to
`blis run`'s.

Draw order (all from Go `math/rand` v1 sources, `blis_jax.rng`):

1. the `workload-gen` stream (seed XOR fnv1a64("workload-gen")): the token IDs of every prefix
   group (first client of each group, in client order), then one `Int63` per client with a
   rate > 0 — that client's seed;
2. per client, its own stream: inference-perf factories first draw a sub-seed; then per
   arrival the inter-arrival time, then the input and output lengths, then the input and the
   output token IDs (`Intn(128000)` each, with Go's rejection step); sessions draw their id,
   and every round's lengths and tokens, even for closed-loop rounds that only run later;
3. merge: stable sort by arrival, truncate to `num_requests`;
4. closed-loop sessions keep round 0; each surviving session (ids sorted as strings, client
   by client) takes a seed from a master stream seeded with seed + 7919, and its follow-up
   lengths come from that stream (drawn here: they do not depend on timing);
5. concurrency users take two seeds each from a master stream seeded with seed + 10007.

Token IDs only matter through equality (shared prefixes), which the engine models with prefix
groups, so they are consumed (`skip_tokens`), not kept.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from blis_jax.errors import ConfigError
from blis_jax.rng.go_rand import GoRand
from blis_jax.rng.streams import WORKLOAD_GEN, PartitionedRNG, to_int64
from blis_jax.workload.go_samplers import (
    LengthSampler,
    arrival_sampler,
    length_sampler,
    normalized_exponential,
    poisson_sampler,
)
from blis_jax.workload.spec import ClientSpec, DistSpec, MultiTurnSpec, WorkloadSpec

NO_HORIZON = (1 << 63) - 1
DEFAULT_PREFIX_LENGTH = 50
SESSION_TIMEOUT_US = 300_000_000
BLUEPRINT_SEED_OFFSET = 7919
CONCURRENCY_SEED_OFFSET = 10007
MAX_GENERATED_REQUESTS = 50_000_000
MODALITIES = ("image", "audio", "video")


@dataclasses.dataclass
class GoClient:
    """One client after inference-perf / cohort expansion, with BLIS's generation settings."""

    spec: ClientSpec
    path: str
    windows: tuple[tuple[int, int], ...] = ()
    factory: tuple | None = None       # ("normexp", count, duration_us) | ("poisson", λ per µs)
    timeout: int | None = None          # µs; None = absent (BLIS defaults, §3.5)
    timeout_forced: bool = False        # set by --timeout / a synthesized spec (§4.3)
    # False only for blis-jax's open-loop inference-perf extension (not BLIS): no token IDs
    # are drawn, so its arrivals do not depend on the lengths (fits compare length settings
    # on the same arrivals).
    draws_tokens: bool = True

    @property
    def multi_turn(self) -> MultiTurnSpec | None:
        return self.spec.multi_turn

    @property
    def closed_loop(self) -> bool:
        c = self.spec
        return bool(c.closed_loop) if c.closed_loop is not None else c.multi_turn is not None


@dataclasses.dataclass(slots=True)
class Row:
    """A generated request (fields of BLIS's trace that generation fixes)."""

    arrival: int
    client: int
    fresh: int                 # input tokens beyond the prefix (the whole input of follow-ups)
    output: int
    prefix_len: int
    group: str                 # prefix group for KV sharing ("" none)
    trace_group: bool          # BLIS writes the group in the trace (single-shot rows only)
    deadline: int
    session: str = ""
    round_index: int = 0
    reason: float = 0.0
    parts: tuple[int, int, int, int] | None = None    # text, image, audio, video


@dataclasses.dataclass
class GoSession:
    """A closed-loop session (or concurrency user): its round-0 row and the follow-up lengths
    drawn from its own stream (rounds 1.. in order; unbounded users: a prefix of them)."""

    row: int                   # index of round 0 in the final request list
    client: int
    max_rounds: int            # 0 = unlimited (concurrency user)
    think_time_us: int
    context_growth: str
    timeout_us: int            # follow-up deadline relative to arrival (0 none)
    prefix_len: int            # blueprint prefix
    fresh: np.ndarray          # new input tokens of rounds 1..
    output: np.ndarray


@dataclasses.dataclass
class GoWorkload:
    rows: list[Row]
    sessions: list[GoSession]
    clients: list[GoClient]
    follow_up_budget: int | None   # None unlimited


def deadline(t: int, timeout: int | None, session: bool) -> int:
    """BLIS `computeDeadline` (§3.5)."""
    if timeout is None:
        return t + SESSION_TIMEOUT_US if session else 0
    return 0 if timeout == 0 else t + timeout


def client_rates(clients: list[GoClient], aggregate_rate: float) -> list[float]:
    """λ per µs of every client (§3.4), BLIS's float operations in BLIS's order."""
    fr = [c.spec.rate_fraction or 0.0 for c in clients]
    if not any(c.windows for c in clients):
        total = 0.0
        for f in fr:
            total += f
        if total == 0:
            return [0.0] * len(clients)
        return [aggregate_rate * (f / total) / 1e6 for f in fr]
    out = []
    for i, c in enumerate(clients):
        if fr[i] <= 0:
            out.append(0.0)
            continue
        co = 0.0
        for j, d in enumerate(clients):
            if fr[j] > 0 and _overlaps(c.windows, d.windows):
                co += fr[j]
        out.append(aggregate_rate * (fr[i] / co) / 1e6)
    return out


def _overlaps(a, b) -> bool:
    if not a or not b:
        return True
    return any(s1 < e2 and s2 < e1 for s1, e1 in a for s2, e2 in b)


def _sampler(d: DistSpec | None) -> LengthSampler | None:
    return None if d is None else length_sampler(d.type, d.params)


class _Multimodal:
    def __init__(self, c: ClientSpec):
        mm = c.multimodal
        self.text = _sampler(mm.text_distribution)
        self.items = []
        for m in MODALITIES:
            tokens, count = getattr(mm, f"{m}_distribution"), getattr(mm, f"{m}_count_distribution")
            self.items.append((_sampler(count), _sampler(tokens)) if tokens is not None and count is not None
                              else None)

    def sample(self, r: GoRand) -> tuple[int, tuple[int, int, int, int]]:
        text = self.text.sample(r) if self.text is not None else 0
        parts = [text]
        for item in self.items:
            total = 0
            if item is not None:
                for _ in range(item[0].sample(r)):
                    total += item[1].sample(r)
            parts.append(total)
        total = sum(parts)
        return (total if total > 0 else 1), tuple(parts)


def generate(spec: WorkloadSpec, clients: list[GoClient], seed: int, max_requests: int,
             horizon: int | None) -> GoWorkload:
    """§5–§6 for an expanded client list (`spec` supplies aggregate_rate)."""
    horizon = NO_HORIZON if horizon is None else int(horizon)
    seed = to_int64(seed)
    if horizon <= 0:
        return GoWorkload([], [], clients, None)
    wg = PartitionedRNG(seed).for_subsystem(WORKLOAD_GEN)
    rates = client_rates(clients, spec.aggregate_rate)
    prefixes: dict[str, int] = {}
    for c in clients:
        g = c.spec.prefix_group
        if g and g not in prefixes:
            n = c.spec.prefix_length if c.spec.prefix_length and c.spec.prefix_length > 0 else DEFAULT_PREFIX_LENGTH
            wg.skip_tokens(n)
            prefixes[g] = n
    cap = 2 * max_requests if max_requests > 0 else math.inf
    rows: list[Row] = []
    per_window = any(w.has_overrides for c in clients for w in (c.spec.lifecycle.windows if c.spec.lifecycle else ()))
    for i, c in enumerate(clients):
        if per_window:
            if c.windows:
                rows.extend(_window_rows(i, c, clients, spec.aggregate_rate, GoRand(wg.int63()), horizon))
            continue
        if rates[i] <= 0 or c.spec.concurrency is not None:
            continue
        rows.extend(_client_rows(i, c, rates[i], GoRand(wg.int63()), prefixes, horizon, cap, max_requests))
    rows.sort(key=lambda r: r.arrival)          # stable: ties keep generation order
    if max_requests > 0:
        del rows[max_requests:]
    if len(rows) > MAX_GENERATED_REQUESTS:
        raise ConfigError(f"num_requests / horizon: {len(rows)} requests would be generated (limit "
                          f"{MAX_GENERATED_REQUESTS}); set num_requests or a shorter horizon")
    rows, sessions = _closed_loop(clients, rows, seed, horizon)
    budget = None
    if any(c.spec.concurrency for c in clients):
        rows, sessions, budget = _concurrency(clients, rows, sessions, seed, prefixes, max_requests)
    return GoWorkload(rows, sessions, clients, budget)


def _client_rows(i: int, c: GoClient, rate: float, r: GoRand, prefixes: dict[str, int], horizon: int,
                 cap: float, max_requests: int) -> list[Row]:
    cs = c.spec
    if c.factory is not None:
        sub = GoRand(r.int63())
        if c.factory[0] == "normexp":
            iat = normalized_exponential(sub, c.factory[1], c.factory[2])
        else:
            iat = poisson_sampler(c.factory[1])
    else:
        a = cs.arrival
        iat = (arrival_sampler(a.process, rate, cv=a.cv, shape=a.shape, scale=a.scale) if a is not None
               else arrival_sampler("poisson", rate))
    inp = _sampler(cs.input_distribution)
    out = _sampler(cs.output_distribution)
    mm = _Multimodal(cs) if cs.multimodal is not None else None
    plen = prefixes.get(cs.prefix_group, 0) if cs.prefix_group else 0
    mt = cs.multi_turn
    windows = c.windows
    last_end = max(e for _, e in windows) if windows else None
    out_rows: list[Row] = []
    if mt is not None and mt.single_session:
        t = iat(r)
        if t == 0:
            return []
        start = windows[0][0] + t if windows else t
        if start >= horizon or (windows and not _in_windows(start, windows)):
            return []
        for row in _session(i, c, r, start, inp, out, plen, last=True):
            if row.arrival >= horizon:
                break
            if not windows or _in_windows(row.arrival, windows):
                out_rows.append(row)
        return out_rows
    t, count = 0, 0
    while t < horizon:
        if count >= cap:
            break
        step = iat(r)
        if step == 0:
            break
        t += step
        if t >= horizon:
            break
        if windows and not _in_windows(t, windows):
            if t >= last_end:
                break
            continue
        if mt is not None:
            for row in _session(i, c, r, t, inp, out, plen):
                count += 1
                if row.arrival < horizon and (not windows or _in_windows(row.arrival, windows)):
                    out_rows.append(row)
            continue
        parts = None
        if mm is not None:
            n, parts = mm.sample(r)
            o = out.sample(r)
            _skip(c, r, n, o)
        else:
            n, o = inp.sample(r), out.sample(r)
            _skip(c, r, n, o)
        out_rows.append(Row(t, i, n, o, plen, cs.prefix_group, True,
                            deadline(t, c.timeout, bool(cs.closed_loop)), parts=parts))
        count += 1
        # Rows of a single-shot client come in arrival order: past the first num_requests
        # none can survive the merge's truncation (the remaining draws are this client's own).
        if max_requests > 0 and len(out_rows) >= max_requests:
            break
    return out_rows


def _window_rate(c: GoClient, k: int, clients: list[GoClient], aggregate: float) -> float:
    """§5.6 rate (req/s) of window k of client c."""
    w = c.spec.lifecycle.windows[k]
    if aggregate == 0 and w.trace_rate is not None:
        return w.trace_rate
    own = w.trace_rate if w.trace_rate is not None else (c.spec.rate_fraction or 0.0)
    total = 0.0
    for d in clients:
        if not d.windows:
            total += d.spec.rate_fraction or 0.0
            continue
        for v in d.spec.lifecycle.windows:
            if v.start_us < w.end_us and w.start_us < v.end_us:
                total += v.trace_rate if v.trace_rate is not None else (d.spec.rate_fraction or 0.0)
                break
    return aggregate * (own / total) if total != 0 else 0.0


def _window_rows(i: int, c: GoClient, clients: list[GoClient], aggregate: float, r: GoRand,
                 horizon: int) -> list[Row]:
    """§5.6: a client with lifecycle windows when some window overrides rates or samplers."""
    cs = c.spec
    mt = cs.multi_turn
    rows: list[Row] = []
    for k, w in enumerate(cs.lifecycle.windows):
        if w.start_us >= horizon:
            continue
        start, end = w.start_us, min(w.end_us, horizon)
        a = w.arrival or cs.arrival
        inp = _sampler(w.input_distribution or cs.input_distribution)
        out = _sampler(w.output_distribution or cs.output_distribution)
        rate = _window_rate(c, k, clients, aggregate)
        count = math.ceil(rate * ((end - start) / 1e6))
        if count <= 0:
            continue
        lam = rate / 1e6
        iat = (arrival_sampler(a.process, lam, cv=a.cv, shape=a.shape, scale=a.scale) if a is not None
               else arrival_sampler("poisson", lam))
        iats = [iat(r) for _ in range(count)]
        f = (end - start) / sum(iats)
        scaled = [int(x * f) for x in iats]
        scaled[-1] += (end - start) - sum(scaled)
        if mt is not None:
            starts, t = [], start
            for x in scaled if not mt.single_session else scaled[:1]:
                t += x
                if t >= end:
                    break
                starts.append(t)
            for t0 in starts:
                for row in _session(i, c, r, t0, inp, out, 0):
                    if row.arrival < end:
                        row.group = ""
                        rows.append(row)
            continue
        t = start
        for x in scaled:
            t += x
            if t >= end:
                break
            n, o = inp.sample(r), out.sample(r)
            _skip(c, r, n, o)
            rows.append(Row(t, i, n, o, 0, "", True, deadline(t, c.timeout, False) if c.timeout_forced else 0))
    return rows


def _skip(c: GoClient, r: GoRand, n: int, o: int) -> None:
    """Tokens(r, n) then Tokens(r, o): the request's input and output token IDs."""
    if c.draws_tokens:
        r.skip_tokens(n)
        r.skip_tokens(o)


def _in_windows(t: int, windows) -> bool:
    return any(s <= t < e for s, e in windows)


def _session(i: int, c: GoClient, r: GoRand, t0: int, inp, out, plen: int, last: bool = False) -> list[Row]:
    """§5.4: every round of one reasoning session, drawn from the client's stream. `last`:
    nothing draws from the stream after this session (a single-session client)."""
    cs = c.spec
    mt = cs.multi_turn
    if mt.max_rounds <= 0:
        return []
    sid = f"sess_{r.int63()}"
    reason = _sampler(cs.reasoning.reason_ratio_distribution) if cs.reasoning is not None else None
    if last and not inp.draws and not out.draws and (reason is None or not reason.draws):
        # No later draw reads the stream: its token IDs cannot change anything (the golden
        # experiments' sessions draw millions of them).
        c = dataclasses.replace(c, draws_tokens=False)
    n, o = inp.sample(r), out.sample(r)
    rows, t, context = [], t0, 0
    group, think, accumulate, tokens = cs.prefix_group, mt.think_time_us, mt.context_growth == "accumulate", \
        c.draws_tokens
    timeout = SESSION_TIMEOUT_US if c.timeout is None else c.timeout      # deadline(t, timeout, True)
    for k in range(mt.max_rounds):
        if k:
            n, o = inp.sample(r), out.sample(r)
        if tokens:
            r.skip_tokens(n)
            r.skip_tokens(o)
        ratio = min(1.0, max(0.0, reason.sample(r) / 100)) if reason is not None else 0.0
        rows.append(Row(t, i, context + n, o, plen, group, False, t + timeout if timeout else 0, sid, k, ratio))
        if accumulate:
            context += n + o
        t = t + think + o
    return rows


def _closed_loop(clients: list[GoClient], rows: list[Row], seed: int, horizon: int):
    """§6.1: keep round 0 of closed-loop sessions; blueprint streams and follow-up lengths."""
    closed = {i for i, c in enumerate(clients) if c.closed_loop and c.multi_turn is not None}
    if not closed:
        return rows, []
    rows = [row for row in rows if row.client not in closed or row.round_index == 0]
    first_row: dict[str, int] = {}
    for k, row in enumerate(rows):
        if row.client in closed:
            first_row.setdefault(row.session, k)
    master = GoRand(to_int64(seed + BLUEPRINT_SEED_OFFSET))
    sessions = []
    for i in sorted(closed):
        c = clients[i]
        mt = c.multi_turn
        ids = sorted({rows[k].session for k in first_row.values() if rows[k].client == i})
        inp, out = _sampler(c.spec.input_distribution), _sampler(c.spec.output_distribution)
        bp_prefix = c.spec.prefix_length if c.spec.prefix_group and (c.spec.prefix_length or 0) > 0 else 0
        timeout = c.timeout if c.timeout is not None else SESSION_TIMEOUT_US
        for sid in ids:
            stream = GoRand(master.int63())
            fresh, output = _follow_ups(stream, inp, out, mt.max_rounds - 1)
            sessions.append(GoSession(first_row[sid], i, mt.max_rounds, mt.think_time_us, mt.context_growth,
                                      timeout, bp_prefix, fresh, output))
    return rows, sessions


def _follow_ups(stream: GoRand, inp: LengthSampler, out: LengthSampler, n: int) -> tuple[np.ndarray, np.ndarray]:
    """§7 step 5 for n follow-ups: lengths, then their token IDs (which only advance the
    session's own stream, so they are skipped when no later length draw needs them)."""
    fresh, output = np.zeros(n, np.int64), np.zeros(n, np.int64)
    draws = inp.draws or out.draws
    for k in range(n):
        a, b = inp.sample(stream), out.sample(stream)
        fresh[k], output[k] = a, b
        if draws:
            stream.skip_tokens(a)
            stream.skip_tokens(b)
    return fresh, output


def _concurrency(clients, rows, sessions, seed, prefixes, max_requests):
    """§6.2: concurrency users' first requests and follow-up streams."""
    kept = len(rows)
    master = GoRand(to_int64(seed + CONCURRENCY_SEED_OFFSET))
    users: list[tuple[Row, GoRand, int]] = []
    for i, c in enumerate(clients):
        n_users = c.spec.concurrency or 0
        think = c.spec.think_time_us or 0
        inp, out = _sampler(c.spec.input_distribution), _sampler(c.spec.output_distribution)
        plen = prefixes.get(c.spec.prefix_group, 0) if c.spec.prefix_group else 0
        for u in range(n_users):
            if max_requests > 0 and kept + len(users) >= max_requests:
                break
            user = GoRand(master.int63())
            a = u * think // n_users if think > 0 and n_users > 1 else 0
            n, o = inp.sample(user), out.sample(user)
            user.skip_tokens(n)
            user.skip_tokens(o)
            row = Row(a, i, n, o, plen, c.spec.prefix_group, True, deadline(a, c.timeout, True),
                      session=f"concurrency_{c.spec.id}_user_{u}")
            users.append((row, GoRand(master.int63()), i))
    total = kept + len(users)
    budget = max(0, max_requests - total) if max_requests > 0 and users else None
    merged = sorted([(row.arrival, 0, k, row) for k, row in enumerate(rows)]
                    + [(row.arrival, 1, k, row) for k, (row, _, _) in enumerate(users)],
                    key=lambda x: (x[0], x[1], x[2]))
    position = {(kind, k): pos for pos, (_, kind, k, _) in enumerate(merged)}
    for s in sessions:
        s.row = position[(0, s.row)]
    for k, (row, stream, i) in enumerate(users):
        c = clients[i]
        inp, out = _sampler(c.spec.input_distribution), _sampler(c.spec.output_distribution)
        # Unlimited rounds: draw as many follow-ups as the budget could give one user.
        n_follow = budget if budget is not None else 0
        fresh, output = _follow_ups(stream, inp, out, n_follow)
        timeout = c.timeout if c.timeout is not None else SESSION_TIMEOUT_US
        sessions.append(GoSession(position[(1, k)], i, 0, c.spec.think_time_us or 0, "", timeout,
                                  row.prefix_len, fresh, output))
    return [m[3] for m in merged], sessions, budget


# ------------------------------------------------------------------------------ expansion


def expand_clients(spec: WorkloadSpec, timeout_s: float | None = None,
                   synthesized: bool = False) -> tuple[WorkloadSpec, list[GoClient]]:
    """(spec with aggregate_rate / num_requests as generated, clients in BLIS's order): the
    spec's clients, then cohort members; or the inference-perf expansion (§8). Timeouts
    (§4.3): `timeout_s` (seconds, < 0 disables) overrides every client's when given or when
    the spec was synthesized from flags."""
    from blis_jax.workload.generate import expand_cohorts

    if spec.inference_perf is not None:
        spec, clients = _expand_inference_perf(spec)
    else:
        clients = [GoClient(c, path, _windows(c), timeout=c.timeout) for path, c in expand_cohorts(spec)]
    if timeout_s is not None or synthesized:
        t = None if timeout_s is None else (int(timeout_s * 1e6) if timeout_s > 0 else 0)
        for c in clients:
            c.timeout, c.timeout_forced = t, True
    return spec, clients


def _windows(c: ClientSpec) -> tuple[tuple[int, int], ...]:
    return tuple((w.start_us, w.end_us) for w in c.lifecycle.windows) if c.lifecycle is not None else ()


def _expand_inference_perf(spec: WorkloadSpec) -> tuple[WorkloadSpec, list[GoClient]]:
    from types import MappingProxyType

    from blis_jax.workload.spec import ArrivalSpec, LifecycleSpec, ReasoningSpec, WindowSpec

    ip = spec.inference_perf
    sp = ip.shared_prefix
    n_prompts, n_users = sp.num_unique_system_prompts, sp.num_users_per_system_prompt
    n = n_prompts * n_users
    multi_turn = sp.enable_multi_turn_chat
    if multi_turn and ip.multi_turn_mode != "closed-loop":
        raise ConfigError("inference_perf.multi_turn_mode: open-loop is a blis-jax extension that the BLIS-exact "
                          "generator does not reproduce; use closed-loop")
    const = lambda v: DistSpec("constant", MappingProxyType({"value": float(v)}))  # noqa: E731
    inp, out = const(sp.question_len), const(sp.output_len)
    reason = DistSpec("constant", MappingProxyType({"value": 0.0}))
    clients: list[GoClient] = []
    stages = ip.stages
    total_rate = 0.0
    for s in stages:
        total_rate += s.rate
    start_s = 0.0
    totals = []
    for si, stage in enumerate(stages):
        count = int(stage.rate * stage.duration)
        totals.append(count)
        end_s = start_s + stage.duration
        for k in range(n):
            p, u = divmod(k, n_users)
            share = count // n + (1 if k < count % n else 0)
            base = dict(tenant_id=f"prompt-{p}", slo_class="standard", input_distribution=inp,
                        output_distribution=out, prefix_group=f"prompt-{p}", prefix_length=sp.system_prompt_len)
            if multi_turn:
                think = int(n / stage.rate * 1e6)
                base["reasoning"] = ReasoningSpec(reason_ratio_distribution=reason, multi_turn=MultiTurnSpec(
                    max_rounds=share, think_time_us=think, single_session=True))
            if len(stages) == 1:
                cs = ClientSpec(id=f"prompt-{p}-user-{u}", rate_fraction=1.0 / n, arrival=ArrivalSpec("poisson"),
                                **base)
                factory = None if multi_turn else ("normexp", share, int(stage.duration * 1e6))
                clients.append(GoClient(cs, f"inference_perf (prompt {p}, user {u})", (), factory))
            else:
                window = (int(start_s * 1e6), int(end_s * 1e6))
                cs = ClientSpec(id=f"stage-{si}-prompt-{p}-user-{u}", rate_fraction=1.0,
                                lifecycle=LifecycleSpec((WindowSpec(*window),)), **base)
                clients.append(GoClient(cs, f"inference_perf (stage {si}, prompt {p}, user {u})", (window,),
                                        ("poisson", stage.rate / n / 1e6)))
        start_s = end_s
    aggregate = stages[0].rate if len(stages) == 1 else total_rate
    expanded = dataclasses.replace(spec, inference_perf=None, aggregate_rate=aggregate,
                                   clients=tuple(c.spec for c in clients), cohorts=(),
                                   num_requests=spec.num_requests or sum(totals))
    return expanded, clients
