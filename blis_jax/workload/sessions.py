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
BLIS draws user u's k-th follow-up from u's own Go stream whatever order the users complete in
(blis-rng §6.2, §7 step 5), and any one user may take the whole budget, so each user gets a
chain of `budget` rows (row k: its round k + 1, lengths drawn now) linked like a multi-turn
session's rounds; the loop counts follow-ups against the budget (`SessionLinks.follow_budget`,
engine/sessions.py). Rows beyond what the run generated never existed (`settle_sessions`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from blis_jax import limits
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
    session_slot: np.ndarray    # int64 session index, -1 none
    num_sessions: int
    # follow-ups the loop may generate in all (concurrency users' budget, blis-rng §6.2), -1 no limit
    follow_budget: int = -1

    @staticmethod
    def none(n: int) -> SessionLinks:
        return SessionLinks(np.zeros(n, bool), np.full(n, -1, np.int64), np.zeros(n, np.int64),
                            np.zeros(n, np.int64), np.full(n, -1, np.int64), 0)


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
    rows = _follow_up_rows(workload, plans, np.array([max(p.max_rounds - 1, 0) for p in plans], np.int64))
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
    return requests, _chain_links(plans, rows, slot, think)


def _chain_links(plans, rows, slot, think, follow_budget: int = -1) -> SessionLinks:
    """Links of the static rows (`slot`, `think`) and the follow-up rows after them (row n0 + k
    is follow-up k): each round links to the next round of its session."""
    n0, src, m = len(slot), rows["src"], len(rows["src"])
    next_round = np.full(n0 + m, -1, np.int64)
    starts = np.flatnonzero(rows["round"] == 1)
    next_round[src[starts]] = n0 + starts
    later = np.flatnonzero(rows["round"][1:] > 1)  # follow-up k + 1 continues follow-up k
    next_round[n0 + later] = n0 + later + 1
    plan_of = rows["plan"]
    return SessionLinks(
        follow_up=np.concatenate([np.zeros(n0, bool), np.ones(m, bool)]),
        next_round=next_round,
        think_time_us=np.concatenate([think, [plans[k].think_time_us for k in plan_of]]).astype(np.int64),
        timeout_us=np.concatenate([np.zeros(n0, np.int64), [plans[k].timeout_us for k in plan_of]]).astype(np.int64),
        session_slot=np.concatenate([slot, plan_of]).astype(np.int64),
        num_sessions=len(plans),
        follow_budget=follow_budget,
    )


def _follow_up_rows(workload, plans, rounds: np.ndarray) -> dict[str, np.ndarray]:
    """Rounds 1 … rounds[k] of every session k, session by session: the lengths drawn from the
    session's Go stream (`SessionPlan.fresh` / `output`), the input growing by the context
    (`accumulate`: earlier rounds' fresh input and output)."""
    base = workload.requests
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
    """Concurrency users: their first requests (static) plus a chain of `budget` follow-up rows
    per user, whose lengths are the user's own (`SessionPlan.fresh` / `output`, as many as the
    budget, go_generator._concurrency)."""
    from blis_jax.workload import generate as g

    base, plans = workload.requests, workload.sessions
    n0 = len(base)
    if workload.num_requests <= 0:
        rc = workload.clients[plans[0].client_index]
        raise ConfigError(f"num_requests: concurrency users ({rc.path}.concurrency) run until the follow-up budget "
                          "num_requests − initial requests is spent; set num_requests > 0")
    budget = max(0, workload.num_requests - n0)
    slot, think = np.full(n0, -1, np.int64), np.zeros(n0, np.int64)
    for s, p in enumerate(plans):
        slot[p.request_id], think[p.request_id] = s, p.think_time_us
    if budget * len(plans) > MAX_GENERATED_REQUESTS:
        raise ConfigError(f"num_requests: {budget} follow-ups for each of {len(plans)} concurrency users "
                          f"exceed the limit of {MAX_GENERATED_REQUESTS} rows; lower num_requests")
    # every user has a row for every follow-up the budget allows (any one user may take them all)
    limits.check_requests(n0 + budget * len(plans), f"lower num_requests ({budget} follow-up rows for each of "
                          f"{len(plans)} concurrency users)")
    if budget == 0:
        return base, dataclasses.replace(SessionLinks.none(n0), session_slot=slot, think_time_us=think,
                                         num_sessions=len(plans))
    rows = _follow_up_rows(workload, plans, np.full(len(plans), budget, np.int64))
    src, m = rows["src"], len(rows["src"])
    reason = np.array([g._format_float(x) for x in rows["reason"]], dtype=object).astype(str)
    # the other labels are the user's first request's
    columns = {name: np.concatenate([values, reason if name == "reason_ratio" else values[src]])
               for name, values in base.trace_columns.items()}
    requests = _with_follow_ups(base, src, rows["input"], rows["output"], rows["round"], columns)
    return requests, _chain_links(plans, rows, slot, think, follow_budget=budget)


def settle_sessions(requests: RequestSet, links: SessionLinks, arrival_us: np.ndarray,
                    follow_seq: np.ndarray | None = None):
    """(rows kept, final RequestSet) after a run: generated rounds get their arrival and
    deadline; rounds never generated are dropped; rows re-sorted in BLIS's cluster-arrival
    order and numbered by it, as its trace export does (blis-rng §12): by arrival, static rows
    before follow-ups of the same tick, follow-ups of one tick in generation order
    (`follow_seq`, EngineState.follow_seq; without it, in row order)."""
    arrival_us = np.asarray(arrival_us, np.int64)
    keep = ~links.follow_up | (arrival_us >= 0)
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
        client_id=requests.client_id[rows], session_id=requests.session_id[rows],
        round_index=requests.round_index[rows], model=requests.model[rows],
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
