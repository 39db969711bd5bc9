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
Concurrency users (unlimited rounds under a global follow-up budget) are not supported yet.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from blis_jax.errors import ConfigError
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

    @staticmethod
    def none(n: int) -> SessionLinks:
        return SessionLinks(np.zeros(n, bool), np.full(n, -1, np.int64), np.zeros(n, np.int64),
                            np.zeros(n, np.int64), np.full(n, -1, np.int64), 0)


def closed_loop_requests(workload) -> tuple[RequestSet, SessionLinks]:
    """(requests with every round, links) from a `GeneratedWorkload` with session plans."""
    from blis_jax.workload import generate as g

    base = workload.requests
    plans = workload.sessions
    for p in plans:
        if p.max_rounds == 0:
            rc = workload.clients[p.client_index]
            raise ConfigError(f"{rc.path}.concurrency: closed-loop concurrency users (unlimited rounds under a "
                              "follow-up budget) are not supported yet; use a multi-turn client with max_rounds")
    n0 = len(base)
    rows: dict[str, list] = {k: [] for k in ("input", "output", "reason", "src", "round")}
    next_round = np.full(n0, -1, np.int64)
    think = np.zeros(n0, np.int64)
    slot = np.full(n0, -1, np.int64)
    links_next, links_think, links_timeout, links_slot = [], [], [], []
    row = n0
    for s, p in enumerate(plans):
        rc = workload.clients[p.client_index]
        first = p.request_id
        slot[first], think[first] = s, p.think_time_us
        prev = first
        fresh0 = int(base.input_len[first] - p.prefix_len)
        context = fresh0 + int(base.output_len[first]) if p.context_growth == "accumulate" else 0
        idx = np.array([p.start_index], np.int64)
        starts = g._Starts(p.base_key, np.zeros(1, np.int64), idx, p.input_dist, p.output_dist)
        for r in range(1, p.max_rounds):
            fresh, output, reason, _ = g._sample_round(rc, starts, p.round_key(r), idx)
            rows["input"].append(p.prefix_len + context + int(fresh[0]))
            rows["output"].append(int(output[0]))
            rows["reason"].append(float(reason[0]))
            rows["src"].append(first)
            rows["round"].append(r)
            if p.context_growth == "accumulate":
                context += int(fresh[0]) + int(output[0])
            if prev < n0:
                next_round[prev] = row
            else:
                links_next[prev - n0] = row
            links_next.append(-1)
            links_think.append(p.think_time_us)
            links_timeout.append(p.timeout_us)
            links_slot.append(s)
            prev = row
            row += 1
    src = np.asarray(rows["src"], np.int64)
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
    requests = RequestSet(
        request_id=np.arange(n0 + m, dtype=np.int64),
        arrival_us=np.concatenate([base.arrival_us, np.full(m, FOLLOW_UP_ARRIVAL, np.int64)]),
        input_len=np.concatenate([base.input_len, rows["input"]]),
        output_len=np.concatenate([base.output_len, rows["output"]]),
        deadline_us=np.concatenate([base.deadline_us, np.zeros(m, np.int64)]),
        prefix_group=np.concatenate([base.prefix_group, base.prefix_group[src]]),
        prefix_len=np.concatenate([base.prefix_len, base.prefix_len[src]]),
        priority=np.concatenate([base.priority, base.priority[src]]),
        slo_class=np.concatenate([base.slo_class, base.slo_class[src]]),
        tenant_id=np.concatenate([base.tenant_id, base.tenant_id[src]]),
        client_id=np.concatenate([base.client_id, base.client_id[src]]),
        session_id=np.concatenate([base.session_id, base.session_id[src]]),
        round_index=np.concatenate([base.round_index, rows["round"]]),
        model=np.concatenate([base.model, base.model[src]]),
        prefix_group_names=base.prefix_group_names,
        trace_columns=columns,
    )
    links = SessionLinks(
        follow_up=np.concatenate([np.zeros(n0, bool), np.ones(m, bool)]),
        next_round=np.concatenate([next_round, links_next]),
        think_time_us=np.concatenate([think, links_think]),
        timeout_us=np.concatenate([np.zeros(n0, np.int64), links_timeout]),
        session_slot=np.concatenate([slot, links_slot]),
        num_sessions=len(plans),
    )
    return requests, links


def settle_sessions(requests: RequestSet, links: SessionLinks, arrival_us: np.ndarray):
    """(rows kept, final RequestSet) after a run: generated rounds get their arrival and
    deadline; rounds never generated are dropped; rows re-sorted by arrival (static rows keep
    their ids; follow-ups are numbered after them in arrival order)."""
    arrival_us = np.asarray(arrival_us, np.int64)
    keep = ~links.follow_up | (arrival_us >= 0)
    rows = np.flatnonzero(keep)
    rows = rows[np.argsort(arrival_us[rows], kind="stable")]
    n_static = int((~links.follow_up).sum())
    follow = links.follow_up[rows]
    ids = requests.request_id[rows].copy()
    ids[follow] = n_static + np.arange(int(follow.sum()))
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
