"""Closed-loop sessions as engine input (blis-features §4.9).

`closed_loop_requests(workload)` turns a workload generated with `sessions="first_round"` into
the request set the engine runs: the static requests (every request whose arrival is known,
round 0 of each session included) followed by every later round of every closed-loop session,
with its lengths drawn now (they do not depend on timing) and its arrival left to the engine,
plus `SessionLinks` (next round, think time, follow-up timeout, session slot) per row.

After the run, `settle_sessions` keeps the rounds that were generated (a timeout, a drop or the
horizon ends a session early), sets their arrival and deadline, and re-sorts by arrival, so
metrics and outputs see exactly the requests that existed.

Context growth `accumulate` appends each round's input and output to the next prompt using the
drawn output lengths; a length-capped round (its output truncated at max_model_len) would make
the next prompt shorter in BLIS, which the engine reports instead of simulating silently.

Concurrency users (`concurrency: N`, `think_time_us`) are sessions with unlimited rounds: each
completion brings the user's next request a think time later, until the global follow-up
budget num_requests − (initial requests) is spent (so at most num_requests requests in all),
the horizon interrupts the user, or a request of the user times out or is dropped (that ends
the user, as it cancels a multi-turn session: BLIS runs both through one session manager).
Which user takes the k-th follow-up depends on completion order, so each concurrency client
gets a pool of `budget` rows whose lengths are fixed now: pool row j holds follow-up j // U of
user j mod U, from that user's own Go stream (blis-rng §6.2); the loop gives the k-th follow-up
generated to pool row k of the completing user's client and records the user
(engine/sessions.py). BLIS draws each user's follow-ups in that user's order, so lengths match
BLIS's only as far as users complete in turn (a known approximation; multi-turn sessions are
exact). `settle_sessions` maps the pool rows that were used back
to their users (session id, round index); unused rows (budget not spent) never existed.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from blis_jax.errors import ConfigError
from blis_jax.workload.distribution import MAX_GENERATED_REQUESTS
from blis_jax.workload.requests import RequestSet, make_request_set

# placeholder arrival of a follow-up row: after every real arrival, so rows stay sorted
FOLLOW_UP_ARRIVAL = (1 << 62) - 1


@dataclasses.dataclass(frozen=True, eq=False)
class SessionLinks:
    """Per request row (aligned with the RequestSet the engine runs)."""

    follow_up: np.ndarray       # bool: arrival set by the engine
    next_round: np.ndarray      # int64 row of the next round, -1 none
    think_time_us: np.ndarray   # int64 completion → next round's arrival
    timeout_us: np.ndarray      # int64 follow-up deadline relative to its arrival, 0 none
    session_slot: np.ndarray    # int64 session index, -1 none (and for pool rows)
    num_sessions: int
    # concurrency users and their follow-up pool rows: first row of the client's pool, -1 none
    # (None: no concurrency users)
    pool_base: np.ndarray | None = None

    @staticmethod
    def none(n: int) -> SessionLinks:
        return SessionLinks(np.zeros(n, bool), np.full(n, -1, np.int64), np.zeros(n, np.int64),
                            np.zeros(n, np.int64), np.full(n, -1, np.int64), 0)

    def pool_rows(self) -> np.ndarray:
        return self.pool_base if self.pool_base is not None else np.full(len(self.follow_up), -1, np.int64)


def closed_loop_requests(workload) -> tuple[RequestSet, SessionLinks]:
    """(requests with every round, links) from a `GeneratedWorkload` with session plans."""
    from blis_jax.workload import generate as g

    base = workload.requests
    plans = workload.sessions
    users = [p for p in plans if p.max_rounds == 0]
    if users:
        if len(users) != len(plans):
            rc = workload.clients[users[0].client_index]
            raise ConfigError(f"{rc.path}.concurrency: concurrency clients cannot be mixed with closed-loop "
                              "multi-turn sessions; split them into two specs")
        return _concurrency_requests(workload)
    n0 = len(base)
    slot = np.full(n0, -1, np.int64)
    think = np.zeros(n0, np.int64)
    for s, p in enumerate(plans):
        slot[p.request_id], think[p.request_id] = s, p.think_time_us
    rows = _follow_up_rows(workload, plans)
    src = rows["src"]
    m = len(src)
    if m == 0:
        return base, dataclasses.replace(SessionLinks.none(n0), session_slot=slot, think_time_us=think,
                                         num_sessions=len(plans))
    columns = dict(base.trace_columns)
    if "reason_ratio" in columns:
        columns["reason_ratio"] = np.concatenate(
            [columns["reason_ratio"], np.array([g._format_float(x) for x in rows["reason"]], dtype=object).astype(str)])
    for k, v in list(columns.items()):
        if k != "reason_ratio":
            columns[k] = np.concatenate([v, v[src]])
    if "prefix_group" in columns:   # BLIS's trace labels: follow-ups carry no prefix (blis-rng §7)
        columns["prefix_group"] = np.concatenate([base.trace_columns["prefix_group"], np.full(m, "")])
        columns["prefix_length"] = np.concatenate([base.trace_columns["prefix_length"], np.full(m, "0")])
    requests = _with_follow_ups(base, src, rows["input"], rows["output"], rows["round"], columns)
    # each round links to the next round of its session (row n0 + k is follow-up k)
    next_round = np.full(n0 + m, -1, np.int64)
    starts = np.flatnonzero(rows["round"] == 1)
    next_round[src[starts]] = n0 + starts
    later = np.flatnonzero(rows["round"][1:] > 1)  # follow-up k + 1 continues follow-up k
    next_round[n0 + later] = n0 + later + 1
    plan_of = rows["plan"]
    links = SessionLinks(
        follow_up=np.concatenate([np.zeros(n0, bool), np.ones(m, bool)]),
        next_round=next_round,
        think_time_us=np.concatenate([think, [plans[k].think_time_us for k in plan_of]]).astype(np.int64),
        timeout_us=np.concatenate([np.zeros(n0, np.int64), [plans[k].timeout_us for k in plan_of]]).astype(np.int64),
        session_slot=np.concatenate([slot, plan_of]).astype(np.int64),
        num_sessions=len(plans),
    )
    return requests, links


def _follow_up_rows(workload, plans) -> dict[str, np.ndarray]:
    """Rounds 1.. of every session, session by session: the lengths drawn from the session's
    Go stream (`SessionPlan.fresh` / `output`), the input growing by the context (`accumulate`:
    earlier rounds' fresh input and output)."""
    base = workload.requests
    rounds = np.array([max(p.max_rounds - 1, 0) for p in plans], np.int64)
    plan_of = np.repeat(np.arange(len(plans)), rounds)
    first_row = np.concatenate([[0], np.cumsum(rounds)[:-1]]).astype(np.int64) if len(plans) else rounds
    round_of = np.arange(len(plan_of)) - np.repeat(first_row, rounds) + 1
    m = len(plan_of)
    fresh, output, reason = np.zeros(m, np.int64), np.zeros(m, np.int64), np.zeros(m)  # follow-ups: reason 0
    for k, p in enumerate(plans):
        at = np.arange(first_row[k], first_row[k] + rounds[k])
        fresh[at], output[at] = p.fresh[:rounds[k]], p.output[:rounds[k]]
    prefix = np.array([p.prefix_len for p in plans], np.int64)
    accumulate = np.array([p.context_growth == "accumulate" for p in plans], bool)
    first = np.array([p.request_id for p in plans], np.int64)
    # context before round 1: round 0's input without its prefix, and its output; then each
    # round adds its own (BLIS's buffer starts with the blueprint prefix, blis-rng §7 step 6)
    context0 = np.where(accumulate, base.input_len[first] - base.prefix_len[first] + base.output_len[first], 0)
    before = np.concatenate([[0], np.cumsum(fresh + output)])  # over all earlier rows
    grown = before[:-1] - np.repeat(before[first_row], rounds)  # over the earlier rounds of the session
    context = np.repeat(context0, rounds) + np.where(accumulate[plan_of], grown, 0)
    return {"input": np.repeat(prefix, rounds) + context + fresh, "output": output, "reason": reason,
            "src": first[plan_of], "round": round_of, "plan": plan_of}


def _concurrency_requests(workload) -> tuple[RequestSet, SessionLinks]:
    """Concurrency users: their first requests (static) plus a pool of follow-up rows per client."""
    from blis_jax.workload import generate as g

    base, plans = workload.requests, workload.sessions
    n0 = len(base)
    if workload.num_requests <= 0:
        rc = workload.clients[plans[0].client_index]
        raise ConfigError(f"num_requests: concurrency users ({rc.path}.concurrency) run until the follow-up budget "
                          "num_requests − initial requests is spent; set num_requests > 0")
    budget = max(0, workload.num_requests - n0)
    slot, think = np.full(n0, -1, np.int64), np.zeros(n0, np.int64)
    pool_base = np.full(n0, -1, np.int64)
    by_client: dict[int, list[int]] = {}
    for s, p in enumerate(plans):
        slot[p.request_id], think[p.request_id] = s, p.think_time_us
        by_client.setdefault(p.client_index, []).append(s)
    if budget * len(by_client) > MAX_GENERATED_REQUESTS:
        raise ConfigError(f"num_requests: {budget} follow-ups for each of {len(by_client)} concurrency clients "
                          f"exceed the limit of {MAX_GENERATED_REQUESTS} rows; lower num_requests")
    if budget == 0:
        return base, dataclasses.replace(SessionLinks.none(n0), session_slot=slot, think_time_us=think,
                                         num_sessions=len(plans))
    src, inputs, outputs, reasons, links_think, links_timeout, links_base = [], [], [], [], [], [], []
    parts: dict[str, list] = {}
    for k, (ci, slots) in enumerate(sorted(by_client.items())):
        p = plans[slots[0]]
        first = n0 + k * budget
        pool_base[[plans[s].request_id for s in slots]] = first
        # Pool row j: follow-up j // U of user j mod U, from that user's Go stream (BLIS gives
        # each user its own sequence; which user takes a pool row is decided in the loop).
        users = [plans[s] for s in slots]
        fresh = np.array([users[j % len(users)].fresh[j // len(users)] for j in range(budget)], np.int64)
        output = np.array([users[j % len(users)].output[j // len(users)] for j in range(budget)], np.int64)
        reason, drawn = np.zeros(budget), {}
        src.append(np.full(budget, p.request_id, np.int64))
        inputs.append(p.prefix_len + fresh)
        outputs.append(output)
        reasons.append(reason)
        for name, values in drawn.items():
            parts.setdefault(name, []).append(values)
        links_think.append(np.full(budget, p.think_time_us, np.int64))
        links_timeout.append(np.full(budget, p.timeout_us, np.int64))
        links_base.append(np.full(budget, first, np.int64))
    src = np.concatenate(src)
    m = len(src)
    columns = {}
    for name, values in base.trace_columns.items():
        if name == "reason_ratio":
            pool = np.array([g._format_float(x) for x in np.concatenate(reasons)], dtype=object).astype(str)
        elif name.endswith("_tokens") and name.removesuffix("_tokens") in parts:
            pool = np.concatenate(parts[name.removesuffix("_tokens")]).astype(str)
        else:
            pool = values[src]
        columns[name] = np.concatenate([values, pool])
    # the user and round of a pool row are known after the run (settle_sessions)
    requests = _with_follow_ups(base, src, np.concatenate(inputs), np.concatenate(outputs), np.ones(m, np.int64),
                                columns)
    links = SessionLinks(
        follow_up=np.concatenate([np.zeros(n0, bool), np.ones(m, bool)]),
        next_round=np.full(n0 + m, -1, np.int64),
        think_time_us=np.concatenate([think, *links_think]),
        timeout_us=np.concatenate([np.zeros(n0, np.int64), *links_timeout]),
        session_slot=np.concatenate([slot, np.full(m, -1, np.int64)]),
        num_sessions=len(plans),
        pool_base=np.concatenate([pool_base, *links_base]),
    )
    return requests, links


def settle_sessions(requests: RequestSet, links: SessionLinks, arrival_us: np.ndarray,
                    pool_user: np.ndarray | None = None, follow_seq: np.ndarray | None = None):
    """(rows kept, final RequestSet) after a run: generated rounds get their arrival and
    deadline; rounds never generated are dropped; rows re-sorted in BLIS's cluster-arrival
    order and numbered by it, as its trace export does (blis-rng §12): by arrival, static rows
    before follow-ups of the same tick, follow-ups of one tick in generation order
    (`follow_seq`, EngineState.follow_seq; without it, in row order). `pool_user`: the session
    slot the engine gave each concurrency pool row it generated (EngineState.pool_user); such a
    row takes its user's session id and the next round index."""
    arrival_us = np.asarray(arrival_us, np.int64)
    keep = ~links.follow_up | (arrival_us >= 0)
    session_id, round_index = requests.session_id, requests.round_index
    pooled = np.flatnonzero(keep & links.follow_up & (links.pool_rows() >= 0))
    if len(pooled):
        if pool_user is None:
            raise ValueError("settle_sessions: concurrency pool rows were generated; pass the engine's pool_user")
        user = np.asarray(pool_user, np.int64)[pooled]
        if (user < 0).any():
            raise ValueError("settle_sessions: a generated pool row has no user")
        first = np.full(links.num_sessions, -1, np.int64)
        static = np.flatnonzero(~links.follow_up & (links.session_slot >= 0))
        first[links.session_slot[static]] = static
        # a user's rounds in generation order: the pool rows of a client are taken in row order
        order = np.lexsort((pooled, user))
        grouped = user[order]
        starts = np.r_[0, np.flatnonzero(np.diff(grouped)) + 1]
        rank = np.arange(len(order)) - np.repeat(starts, np.diff(np.r_[starts, len(order)]))
        session_id, round_index = session_id.copy(), round_index.copy()
        session_id[pooled[order]] = requests.session_id[first[grouped]]
        round_index[pooled[order]] = requests.round_index[first[grouped]] + 1 + rank
    rows = np.flatnonzero(keep)
    follow = links.follow_up[rows]
    tie = rows if follow_seq is None else np.where(follow, np.asarray(follow_seq, np.int64)[rows], rows)
    rows = rows[np.lexsort((tie, follow, arrival_us[rows]))]
    ids = np.arange(len(rows), dtype=np.int64)
    deadline = np.where(links.follow_up & (links.timeout_us > 0), arrival_us + links.timeout_us, requests.deadline_us)
    settled = make_request_set(
        request_id=ids, arrival_us=arrival_us[rows], input_len=requests.input_len[rows],
        output_len=requests.output_len[rows], deadline_us=deadline[rows],
        prefix_group=np.array([requests.prefix_group_names[g] if g >= 0 else "" for g in requests.prefix_group[rows]],
                              dtype=object).astype(str) if len(rows) else np.zeros(0, "<U1"),
        prefix_len=requests.prefix_len[rows], slo_class=requests.slo_class[rows], tenant_id=requests.tenant_id[rows],
        client_id=requests.client_id[rows], session_id=session_id[rows],
        round_index=round_index[rows], model=requests.model[rows],
        trace_columns={k: v[rows] for k, v in requests.trace_columns.items()})
    return rows, settled


def _with_follow_ups(base: RequestSet, src: np.ndarray, input_len, output_len, round_index, columns) -> RequestSet:
    """`base` plus one row per later request: lengths and round given, arrival a placeholder the
    loop overwrites, labels copied from the session's first request `src`."""
    m = src.shape[0]
    copied = {name: np.concatenate([getattr(base, name), getattr(base, name)[src]])
              for name in ("prefix_group", "prefix_len", "priority", "slo_class", "tenant_id", "client_id",
                           "session_id", "model")}
    return RequestSet(
        request_id=np.arange(len(base) + m, dtype=np.int64),
        arrival_us=np.concatenate([base.arrival_us, np.full(m, FOLLOW_UP_ARRIVAL, np.int64)]),
        input_len=np.concatenate([base.input_len, input_len]),
        output_len=np.concatenate([base.output_len, output_len]),
        deadline_us=np.concatenate([base.deadline_us, np.zeros(m, np.int64)]),
        round_index=np.concatenate([base.round_index, round_index]),
        prefix_group_names=base.prefix_group_names,
        trace_columns=columns,
        **copied,
    )
