"""`RequestSet`: the engine's input, one numpy array per request attribute.

Rows are sorted by injection time (stable, so equal times keep their input order); row i of
every array describes the same request, and the engine's per-request outputs use the same
row order. Every workload source (distribution, presets, TraceV2) ends in `make_request_set`,
which converts, derives priorities and dense prefix-group ids, sorts and validates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import numpy as np

from blis_jax.errors import ConfigError

# vLLM convention (lower = more urgent): BLIS `InvertForVLLM` of the GAIE priorities
# critical 4, standard 3, batch -1, sheddable -2, background -3 (spec §2.8).
PRIORITY_BY_SLO_CLASS: Mapping[str, int] = MappingProxyType(
    {"critical": 0, "standard": 1, "": 1, "batch": 5, "sheddable": 6, "background": 7}
)
DEFAULT_PRIORITY = 1  # empty or unknown SLO class behaves as `standard`
NO_PREFIX_GROUP = -1

_INT64_FIELDS = ("request_id", "arrival_us", "input_len", "output_len", "deadline_us",
                 "prefix_len", "round_index")
_INT32_FIELDS = ("prefix_group", "priority")
_LABEL_FIELDS = ("slo_class", "tenant_id", "client_id", "session_id", "model")


def slo_priority(slo_class: str) -> int:
    """Instance (vLLM) priority of an SLO class; unknown classes count as standard."""
    return PRIORITY_BY_SLO_CLASS.get(slo_class, DEFAULT_PRIORITY)


@dataclasses.dataclass(frozen=True, eq=False)
class RequestSet:
    """N requests, sorted by injection time. Arrays are read-only copies.

    `input_len` is the full prompt (shared prefix included); `deadline_us` is absolute
    (0 = none); `prefix_group` is a dense id into `prefix_group_names` (-1 = none) and
    `prefix_len` that group's prefix length (0 without a group). Label arrays are strings and
    only feed outputs. `trace_columns` carries raw TraceV2 columns that nothing simulates
    (streaming, multimodal counts, recorded chunk times, ...) so a re-export can keep them.
    """

    request_id: np.ndarray
    arrival_us: np.ndarray
    input_len: np.ndarray
    output_len: np.ndarray
    deadline_us: np.ndarray
    prefix_group: np.ndarray
    prefix_len: np.ndarray
    priority: np.ndarray
    slo_class: np.ndarray
    tenant_id: np.ndarray
    client_id: np.ndarray
    session_id: np.ndarray
    round_index: np.ndarray
    model: np.ndarray
    prefix_group_names: tuple[str, ...] = ()
    trace_columns: Mapping[str, np.ndarray] = dataclasses.field(
        default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        # Own read-only copies: a frozen dataclass is only immutable if its arrays are.
        for name in _INT64_FIELDS:
            object.__setattr__(self, name, _frozen(_int_array(name, getattr(self, name)), np.int64))
        for name in _INT32_FIELDS:
            object.__setattr__(self, name, _frozen(_int_array(name, getattr(self, name)), np.int32))
        for name in _LABEL_FIELDS:
            object.__setattr__(self, name, _frozen(_label_array(name, getattr(self, name)), None))
        object.__setattr__(self, "prefix_group_names", tuple(str(g) for g in self.prefix_group_names))
        columns = {str(k): _frozen(np.asarray(v), None) for k, v in dict(self.trace_columns).items()}
        object.__setattr__(self, "trace_columns", MappingProxyType(columns))
        self.validate()

    def __len__(self) -> int:
        return int(self.request_id.shape[0])

    @property
    def num_prefix_groups(self) -> int:
        return len(self.prefix_group_names)

    def validate(self) -> RequestSet:
        """Raise ConfigError naming the first inconsistent field; return self otherwise."""
        n = len(self)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, np.ndarray) and value.shape != (n,):
                raise ConfigError(f"RequestSet.{f.name}: shape {value.shape}, expected ({n},) "
                                  "like request_id; every per-request array needs one entry per request")
        for name, col in self.trace_columns.items():
            if col.shape != (n,):
                raise ConfigError(f"RequestSet.trace_columns[{name!r}]: shape {col.shape}, expected ({n},)")
        _check_min("request_id", self.request_id, 0)
        if n and np.unique(self.request_id).shape[0] != n:
            dup = _first_duplicate(self.request_id)
            raise ConfigError(f"RequestSet.request_id: duplicate id {dup}; request ids must be unique")
        _check_min("arrival_us", self.arrival_us, 0)
        if n > 1 and np.any(np.diff(self.arrival_us) < 0):
            i = int(np.argmax(np.diff(self.arrival_us) < 0)) + 1
            raise ConfigError(f"RequestSet.arrival_us: row {i} arrives at {self.arrival_us[i]} µs, before "
                              f"row {i - 1} ({self.arrival_us[i - 1]} µs); build it with make_request_set, "
                              "which sorts by injection time")
        _check_min("input_len", self.input_len, 1)
        _check_min("output_len", self.output_len, 0)
        _check_min("deadline_us", self.deadline_us, 0)
        _check_min("round_index", self.round_index, 0)
        self._validate_prefix_groups()
        _check_min("priority", self.priority, 0)
        return self

    def _validate_prefix_groups(self) -> None:
        g = self.num_prefix_groups
        if np.any((self.prefix_group < NO_PREFIX_GROUP) | (self.prefix_group >= g)):
            i = int(np.argmax((self.prefix_group < NO_PREFIX_GROUP) | (self.prefix_group >= g)))
            raise ConfigError(f"RequestSet.prefix_group: row {i} has group {self.prefix_group[i]}, "
                              f"expected -1 (none) or 0..{g - 1} (indices into prefix_group_names)")
        _check_min("prefix_len", self.prefix_len, 0)
        ungrouped_with_len = (self.prefix_group == NO_PREFIX_GROUP) & (self.prefix_len != 0)
        if np.any(ungrouped_with_len):
            i = int(np.argmax(ungrouped_with_len))
            raise ConfigError(f"RequestSet.prefix_len: row {i} has prefix_len {self.prefix_len[i]} but no "
                              "prefix group; a prefix is only shared through a group, so use 0")
        too_long = self.prefix_len > self.input_len
        if np.any(too_long):
            i = int(np.argmax(too_long))
            raise ConfigError(f"RequestSet.prefix_len: row {i} prefix {self.prefix_len[i]} exceeds its "
                              f"input_len {self.input_len[i]}; input_len must include the prefix")


def make_request_set(
    *,
    request_id: Sequence[int] | np.ndarray,
    arrival_us: Sequence[int] | np.ndarray,
    input_len: Sequence[int] | np.ndarray,
    output_len: Sequence[int] | np.ndarray,
    deadline_us: Sequence[int] | np.ndarray | None = None,
    prefix_group: Sequence[str] | np.ndarray | None = None,
    prefix_len: Sequence[int] | np.ndarray | None = None,
    slo_class: Sequence[str] | np.ndarray | None = None,
    tenant_id: Sequence[str] | np.ndarray | None = None,
    client_id: Sequence[str] | np.ndarray | None = None,
    session_id: Sequence[str] | np.ndarray | None = None,
    round_index: Sequence[int] | np.ndarray | None = None,
    model: Sequence[str] | np.ndarray | None = None,
    trace_columns: Mapping[str, Sequence | np.ndarray] | None = None,
) -> RequestSet:
    """Build a validated RequestSet from per-request columns in any order.

    `prefix_group` holds group *names* ('' = none); `prefix_len` is the per-row prefix
    length (ignored for ungrouped rows). `input_len` must already include the prefix.
    Rows are stably sorted by `arrival_us` (the injection time).
    """
    rid = _int_array("request_id", request_id)
    n = rid.shape[0]
    columns: dict[str, np.ndarray] = {
        "request_id": rid,
        "arrival_us": _int_array("arrival_us", arrival_us),
        "input_len": _int_array("input_len", input_len),
        "output_len": _int_array("output_len", output_len),
        "deadline_us": _int_array("deadline_us", _or_fill(deadline_us, n, 0)),
        "round_index": _int_array("round_index", _or_fill(round_index, n, 0)),
    }
    labels = {name: _label_array(name, _or_fill(value, n, ""))
              for name, value in (("slo_class", slo_class), ("tenant_id", tenant_id),
                                  ("client_id", client_id), ("session_id", session_id),
                                  ("model", model))}
    group_names = _label_array("prefix_group", _or_fill(prefix_group, n, ""))
    plen = _int_array("prefix_len", _or_fill(prefix_len, n, 0))
    extras = {str(k): np.asarray(v) for k, v in (trace_columns or {}).items()}
    for name, arr in [*columns.items(), *labels.items(), ("prefix_group", group_names),
                      ("prefix_len", plen), *(("trace_columns[" + k + "]", v) for k, v in extras.items())]:
        if arr.shape != (n,):
            raise ConfigError(f"{name}: {arr.shape[0] if arr.ndim else 'scalar'} values for {n} requests; "
                              "give one value per request")

    order = np.argsort(columns["arrival_us"], kind="stable")
    columns = {k: v[order] for k, v in columns.items()}
    labels = {k: v[order] for k, v in labels.items()}
    extras = {k: v[order] for k, v in extras.items()}
    group_names, plen = group_names[order], plen[order]

    names, dense = _dense_groups(group_names)
    plen = np.where(dense == NO_PREFIX_GROUP, 0, plen)
    priority = np.array([slo_priority(c) for c in labels["slo_class"]], dtype=np.int32)
    return RequestSet(**columns, **labels, prefix_group=dense, prefix_len=plen, priority=priority,
                      prefix_group_names=names, trace_columns=extras)


def _dense_groups(group_names: np.ndarray) -> tuple[tuple[str, ...], np.ndarray]:
    """Map group names to 0..G-1 in order of first appearance ('' → -1)."""
    ids: dict[str, int] = {}
    dense = np.full(group_names.shape, NO_PREFIX_GROUP, dtype=np.int32)
    for i, name in enumerate(group_names):
        if name:
            dense[i] = ids.setdefault(str(name), len(ids))
    return tuple(ids), dense


def _or_fill(value, n: int, fill):
    return [fill] * n if value is None else value


def _int_array(name: str, values) -> np.ndarray:
    """int64 copy of `values`; integral floats are accepted, NaN/inf/fractions are not."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ConfigError(f"{name}: expected one value per request (a 1-D column), got shape {arr.shape}")
    if arr.dtype.kind in "iub":
        return arr.astype(np.int64)
    if arr.dtype.kind == "f":
        bad = ~np.isfinite(arr)
        if np.any(bad):
            i = int(np.argmax(bad))
            raise ConfigError(f"{name}: row {i} is {arr[i]}; expected a finite integer")
        frac = arr != np.trunc(arr)
        if np.any(frac):
            i = int(np.argmax(frac))
            raise ConfigError(f"{name}: row {i} is {arr[i]}; expected an integer")
        return arr.astype(np.int64)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    raise ConfigError(f"{name}: values of type {arr.dtype} are not integers")


def _label_array(name: str, values) -> np.ndarray:
    arr = np.asarray(values)
    if arr.size == 0:
        return np.zeros(0, dtype="<U1")
    if arr.dtype.kind not in "UO":
        raise ConfigError(f"{name}: expected strings, got {arr.dtype}")
    return arr.astype(str)


def _frozen(arr: np.ndarray, dtype) -> np.ndarray:
    out = np.array(arr, dtype=dtype, copy=True)
    out.setflags(write=False)
    return out


def _check_min(name: str, arr: np.ndarray, minimum: int) -> None:
    bad = arr < minimum
    if np.any(bad):
        i = int(np.argmax(bad))
        raise ConfigError(f"RequestSet.{name}: row {i} is {arr[i]}, must be ≥ {minimum}")


def _first_duplicate(arr: np.ndarray) -> int:
    s = np.sort(arr)
    return int(s[np.argmax(s[1:] == s[:-1]) + 1])
