"""Closed-loop sessions driven by real completions (spec §6.3).

The rounds' lengths come from the project's session generator (`workload.sessions.
closed_loop_requests`: one row per later round of a multi-turn session or of a concurrency
user), exactly as the simulator gets them; here only the *timing* is live: when a
session request completes `ok`, its next round arrives at completion offset + think time.
A non-`ok` result ends the session (and removes a concurrency user for good), as does the last
round, the spent follow-up budget, or an arrival beyond the horizon.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from blis_jax.errors import ConfigError
from blis_jax.observe.workload import ObservedWorkload, follow_up_ids, group_token_ids, token_ids


@dataclasses.dataclass
class Planned:
    """A request ready to be dispatched: its workload row and the live facts about it."""

    row: int
    arrival_us: int               # scheduled offset from the dispatcher's start
    deadline_us: int
    streaming: bool
    token_ids: list[int]
    session_slot: int = -1        # -1: not part of a closed-loop session
    session_id: str = ""
    round_index: int = 0
    follow_up: bool = False


class LiveSessions:
    """Bookkeeper of the follow-ups (single-threaded: called in completion order)."""

    def __init__(self, workload: ObservedWorkload, horizon_us: int | None = None,
                 think_sampler=None) -> None:
        self.w = workload
        self.horizon_us = horizon_us
        self.think_sampler = think_sampler   # (session slot) → think µs, or None: the blueprint's
        self.follow_ups = 0                  # follow-ups generated, against links.follow_budget

    def planned_static(self, row: int) -> Planned:
        r = self.w.requests
        group = r.prefix_group_names[r.prefix_group[row]] if r.prefix_group[row] >= 0 else ""
        ids = token_ids(self.w.seed, row, int(r.input_len[row]), group, int(r.prefix_len[row]))
        slot = int(self.w.links.session_slot[row])
        return Planned(row=row, arrival_us=int(r.arrival_us[row]), deadline_us=int(r.deadline_us[row]),
                       streaming=self.w.streaming(row), token_ids=ids, session_slot=slot,
                       session_id=str(r.session_id[row]), round_index=int(r.round_index[row]))

    def is_session(self, p: Planned) -> bool:
        return p.session_slot >= 0

    def next_round(self, done: Planned, ok: bool, completion_tokens: int, completion_offset_us: int) -> Planned | None:
        """The follow-up of a completed session request, or None when the session ends."""
        if not ok or done.session_slot < 0:
            return None
        links, r = self.w.links, self.w.requests
        nxt = int(links.next_round[done.row])
        # concurrency users: while the global follow-up budget lasts (blis-rng §7 step 3)
        if nxt < 0 or 0 <= links.follow_budget <= self.follow_ups:
            return None
        think = (self.think_sampler(done.session_slot) if self.think_sampler is not None
                 else int(links.think_time_us[done.row]))
        arrival = completion_offset_us + think
        if self.horizon_us is not None and arrival > self.horizon_us:
            return None
        self.follow_ups += 1
        timeout = int(links.timeout_us[nxt])
        accumulate = done.session_slot < len(self.w.accumulate) and self.w.accumulate[done.session_slot]
        group = r.prefix_group_names[r.prefix_group[nxt]] if r.prefix_group[nxt] >= 0 else ""
        prefix = group_token_ids(self.w.seed, group, int(r.prefix_len[nxt])) if group else []
        ids = follow_up_ids(self.w.seed, nxt, int(r.input_len[nxt]), done.token_ids if accumulate else None,
                            completion_tokens, done.round_index + 1, prefix)
        return Planned(row=nxt, arrival_us=arrival, deadline_us=arrival + timeout if timeout > 0 else 0,
                       streaming=False, token_ids=ids, session_slot=done.session_slot,
                       session_id=done.session_id, round_index=done.round_index + 1, follow_up=True)


# ------------------------------------------------------------------ --think-time-dist

_TIME = re.compile(r"^([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)(us|ms|s)?$")


def _time_us(key: str, text: str) -> float:
    m = _TIME.match(text.strip())
    if not m:
        raise ConfigError(f"invalid {key} value {text!r}: expected a non-negative number with optional unit "
                          "us, ms or s")
    value = float(m.group(1)) * {"us": 1.0, "ms": 1e3, "s": 1e6, None: 1e3}[m.group(2)]
    if not math.isfinite(value):
        raise ConfigError(f"invalid {key} value {text!r}: not finite")
    return value


def parse_think_time_dist(text: str):
    """`lognormal:mu=…,sigma=…[,min=…][,max=…]` or `constant:value=…` → (kind, params)."""
    if ":" not in text:
        raise ConfigError(f"think-time-dist must have format type:key=value,...; got {text!r}")
    kind, _, rest = text.partition(":")
    params: dict[str, str] = {}
    for pair in filter(None, rest.split(",")):
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise ConfigError(f"invalid pair {pair!r} (expected key=value)")
        if key in params:
            raise ConfigError(f"duplicate key {key!r}")
        params[key] = value
    if kind == "constant":
        if "value" not in params:
            raise ConfigError("constant requires value")
        return kind, {"value": max(1.0, _time_us("value", params["value"]))}
    if kind == "lognormal":
        out = {}
        for key in ("mu", "sigma"):
            if key not in params:
                raise ConfigError(f"lognormal requires {key}")
            try:
                out[key] = float(params[key])
            except ValueError:
                raise ConfigError(f"invalid {key} value {params[key]!r}") from None
            if not math.isfinite(out[key]):
                raise ConfigError(f"{key} must be finite")
        if out["sigma"] <= 0:
            raise ConfigError("sigma must be > 0")
        for key in ("min", "max"):
            if key in params:
                out[key] = _time_us(key, params[key])
        return kind, out
    raise ConfigError(f'unsupported think-time-dist type "{kind}"; supported: lognormal, constant')


def think_sampler(kind: str, params: dict, seed: int):
    """Per-session-slot think-time draws in µs (one NumPy stream per slot)."""
    streams: dict[int, np.random.Generator] = {}

    def draw(slot: int) -> int:
        if kind == "constant":
            return int(params["value"])
        rng = streams.setdefault(slot, np.random.Generator(np.random.PCG64([0x7468696E, seed & 0xFFFFFFFF, slot])))
        v = math.floor(math.exp(params["mu"] + math.log(1e6) + params["sigma"] * rng.standard_normal()) + 0.5)
        v = max(v, params.get("min", v))
        v = min(v, params.get("max", v))
        return max(1, int(v))
    return draw
