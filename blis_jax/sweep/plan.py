"""Capacity planning: the largest (or smallest) value of a search axis that meets SLO targets.

Every candidate runs in one batched sweep. Candidates are ordered along the search axis; the
answer for `max` is the last candidate of the run of passing candidates that starts at the
smallest one (so every smaller candidate passes too and the next larger one fails), and
symmetrically for `min` (e.g. the smallest instance count). The other
axes of the grid each get their own answer.

A candidate passes when its engine run finished, every SLO target holds, and (unless allowed
otherwise) every injected request completed: a saturated server whose requests time out can
show good latencies for the few that finish.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from blis_jax import limits
from blis_jax.errors import ConfigError
from blis_jax.io_safety import short
from blis_jax.sweep.table import METRICS, OK, RESULT, SweepTable

# Metrics where more is better: `metric=value` means `>=` for these, `<=` for the others.
HIGHER_IS_BETTER = frozenset({"completed_requests", "responses_per_sec", "tokens_per_sec", "cache_hit_rate",
                              "injected_requests", "total_output_tokens"})
# Search direction when `--search AXIS` gives none.
DEFAULT_DIRECTION = {"rate": "max", "num-instances": "min", "total-kv-blocks": "min"}
# Smallest value an axis can take: a `min` answer there needs no "extend the candidates" hint.
LOWEST = {"num-instances": 1, "total-kv-blocks": 1, "max-num-seqs": 1}
MEETS = "meets_slo"


@dataclasses.dataclass(frozen=True)
class SloTarget:
    metric: str
    op: str  # "<=" or ">="
    bound: float

    def holds(self, value: float) -> bool:
        return value <= self.bound if self.op == "<=" else value >= self.bound

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.bound:g}"


def parse_slo(text: str, flag: str = "--slo") -> tuple[SloTarget, ...]:
    """'ttft_p99_ms=200,itl_p99_ms<=50,responses_per_sec>=8' → targets (errors name the item)."""
    targets = []
    for item in [p.strip() for p in str(text).split(",")]:
        m = re.fullmatch(r"([A-Za-z0-9_]+)\s*(<=|>=|=)\s*(\S+)", item)
        if m is None:
            raise ConfigError(f"{flag}: {item!r} is not METRIC=VALUE (or METRIC<=VALUE, METRIC>=VALUE), "
                              "e.g. ttft_p99_ms=200,itl_p99_ms=50")
        metric, op, number = m.groups()
        if metric not in METRICS:
            close = difflib.get_close_matches(metric, METRICS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"{flag}: {metric!r} is not a metric{hint}; choose one of {', '.join(METRICS)}")
        try:
            bound = float(number)
        except ValueError:
            bound = math.nan
        if not math.isfinite(bound):
            raise ConfigError(f"{flag}: {short(item)}: the bound must be a finite number")
        if bound < 0:
            raise ConfigError(f"{flag}: {short(item)}: a target must be >= 0 (latencies and throughputs are "
                              "never negative)")
        if op == "=":
            op = ">=" if metric in HIGHER_IS_BETTER else "<="
        targets.append(SloTarget(metric, op, bound))
    if not targets:
        raise ConfigError(f"{flag}: give at least one target, e.g. ttft_p99_ms=200")
    return tuple(targets)


def parse_candidates(text: str, flag: str = "--candidates") -> list[float | int]:
    """'1,2,4.5' (a list) or 'LO:HI:N' (N evenly spaced values from LO to HI)."""
    text = str(text).strip()
    count = text.count(",") + 1
    if text.count(":") == 2 and text.rsplit(":", 1)[1].strip().isdigit():
        count = int(text.rsplit(":", 1)[1])
    limits.check_scenarios(count, f"give fewer {flag}")  # before building the list
    try:
        if ":" in text:
            lo, hi, n = text.split(":")
            lo_f, hi_f, count = float(lo), float(hi), int(n)
            if count < 2 or not (math.isfinite(lo_f) and math.isfinite(hi_f)) or hi_f <= lo_f:
                raise ValueError
            values = [lo_f + (hi_f - lo_f) * k / (count - 1) for k in range(count)]
        else:
            values = [float(p) for p in text.split(",")]
            if not values or not all(math.isfinite(v) for v in values):
                raise ValueError
    except ValueError:
        raise ConfigError(f"{flag} {short(text)}: give a comma list (1,2,4) or LO:HI:N with LO < HI and "
                          "N >= 2 (e.g. 1:40:14)") from None
    out = sorted({int(v) if float(v).is_integer() else v for v in values})
    return out


def parse_search(text: str, flag: str = "--search") -> tuple[str, str]:
    """'rate' / 'rate:max' / 'total-kv-blocks:min' → (axis, direction)."""
    axis, _, direction = str(text).partition(":")
    axis = axis.strip().replace("_", "-")
    direction = direction.strip() or DEFAULT_DIRECTION.get(axis, "")
    if direction not in ("max", "min"):
        raise ConfigError(f"{flag} {text!r}: say whether to find the largest or the smallest passing "
                          f"value, e.g. {axis}:max or {axis}:min")
    return axis, direction


@dataclasses.dataclass(frozen=True)
class Answer:
    """The plan's answer for one combination of the other axes."""

    context: Mapping[str, Any]
    value: Any  # None: no candidate passes
    next_value: Any  # the next candidate beyond the answer (it fails); None if the answer is the last
    failures: tuple[str, ...]  # why `next_value` (or, without an answer, the first candidate) fails
    also_passing: tuple[Any, ...]  # candidates beyond next_value that pass again (not monotone)


def violations(row: Mapping[str, Any], targets: Sequence[SloTarget], require_complete: bool = True) -> list[str]:
    """Reasons a row fails (empty: it passes)."""
    if row[RESULT] != OK:
        return [f"engine result {row[RESULT]}"]
    out = [f"{t.metric}={row[t.metric]:g} (needs {t.op}{t.bound:g})" for t in targets if not t.holds(row[t.metric])]
    if require_complete and row["completed_requests"] != row["injected_requests"]:
        out.append(f"only {row['completed_requests']} of {row['injected_requests']} requests completed "
                   f"({row['timed_out_requests']} timed out, {row['dropped_unservable']} dropped)")
    return out


def evaluate(table: SweepTable, axis: str, direction: str, targets: Sequence[SloTarget],
             require_complete: bool = True) -> tuple[SweepTable, list[Answer]]:
    """The table with a `meets_slo` column, and one answer per combination of the other axes."""
    if axis not in table.axes:
        raise ConfigError(f"--search {axis}: not an axis of the grid (axes: {', '.join(table.axes)}); add it "
                          "to the grid or give --candidates")
    reasons = [violations(row, targets, require_complete) for row in table.rows]
    rows = tuple({**row, MEETS: not why} for row, why in zip(table.rows, reasons))
    others = [a for a in table.axes if a != axis]
    contexts: dict[tuple, list[int]] = {}
    for k, row in enumerate(rows):
        contexts.setdefault(tuple(_key(row[a]) for a in others), []).append(k)
    answers = []
    for members in contexts.values():
        ordered = sorted(members, key=lambda k: rows[k][axis], reverse=(direction == "min"))
        passing = 0
        while passing < len(ordered) and rows[ordered[passing]][MEETS]:
            passing += 1
        value = rows[ordered[passing - 1]][axis] if passing else None
        nxt = ordered[passing] if passing < len(ordered) else None
        failures = tuple(reasons[nxt]) if nxt is not None else ()
        beyond = tuple(rows[k][axis] for k in ordered[passing + 1:] if rows[k][MEETS])
        answers.append(Answer(context={a: rows[members[0]][a] for a in others}, value=value,
                              next_value=rows[nxt][axis] if nxt is not None else None,
                              failures=failures, also_passing=beyond))
    return dataclasses.replace(table, rows=rows), answers


def _key(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def describe(answer: Answer, axis: str, direction: str, targets: Sequence[SloTarget]) -> str:
    """One paragraph per answer, for stdout."""
    where = ", ".join(f"{k}={v}" for k, v in answer.context.items())
    head = f"[{where}] " if where else ""
    slo = ", ".join(str(t) for t in targets)
    word = "largest" if direction == "max" else "smallest"
    if answer.value is None:
        text = f"{head}no candidate {axis} meets {slo}"
        if answer.failures:
            text += f"; the {'smallest' if direction == 'max' else 'largest'} fails: {'; '.join(answer.failures)}"
        return text
    text = f"{head}{axis} = {answer.value}: the {word} candidate meeting {slo}"
    if answer.next_value is not None:
        text += f"; next candidate {answer.next_value} fails: {'; '.join(answer.failures)}"
    elif direction == "min" and answer.value == LOWEST.get(axis):
        text += f" (every candidate passes, and {answer.value} is the smallest possible {axis})"
    else:
        text += f" (every candidate passes; extend the candidates {'up' if direction == 'max' else 'down'} to "
        text += "find the limit)"
    if answer.also_passing:
        text += (f". Note: {', '.join(str(v) for v in answer.also_passing)} pass again beyond it (the "
                 "metric is not monotone in this range)")
    return text
