"""TraceV2 read and write (spec §4.13; blis-diff README "trace.yaml" / "trace.csv").

A trace is a YAML header plus a CSV of request records. Reading validates every column
(unknown or missing columns, bad numbers and negative lengths are ConfigErrors naming the
row and column) and builds a `RequestSet`: injection time = `send_time_us` if > 0 else
`arrival_time_us`; prompt = group prefix (length of the group's first row) + `input_tokens`,
or `server_input_tokens` (when > 0) for ungrouped rows. Columns the simulation does not use
are carried verbatim in `RequestSet.trace_columns`, so `write_trace` reproduces them.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
import re
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np
import yaml

# Only the status codes: writing outcomes is the one place a trace needs simulation results.
from blis_jax.engine.output import COMPLETED, LENGTH_CAPPED, TIMED_OUT
from blis_jax.errors import ConfigError
from blis_jax.io_safety import MAX_INPUT_BYTES, atomic_write_text, load_yaml_text, read_text, short, summarise
from blis_jax.limits import INT64_MAX, MAX_SEED, MAX_TIME_US, MAX_TOKENS
from blis_jax.workload.requests import NO_PREFIX_GROUP, RequestSet, make_request_set

REQUIRED_COLUMNS: tuple[str, ...] = (
    "request_id", "client_id", "tenant_id", "slo_class", "session_id", "round_index",
    "prefix_group", "prefix_length", "streaming", "input_tokens", "output_tokens",
    "text_tokens", "image_tokens", "audio_tokens", "video_tokens", "reason_ratio", "model",
    "deadline_us", "server_input_tokens", "arrival_time_us", "send_time_us",
    "first_chunk_time_us", "last_chunk_time_us", "num_chunks", "status", "error_message",
    "finish_reason",
)
# Bracketed columns of spec §4.13: present only when some record uses them. Each is written
# right after the column named here (None = at the end), which gives BLIS's order.
OPTIONAL_COLUMNS: Mapping[str, str | None] = MappingProxyType({
    "vllm_priority": "slo_class", "slo_target_us": "deadline_us",
    "x_request_id": None, "adapter": None, "think_time_us": None,
})
TRACE_STATUSES = ("ok", "error", "timeout", "incomplete")

# How each column is checked. Types: int (≥ 0 unless listed as signed), float, bool, str.
_NONNEG_INT = {"request_id", "round_index", "prefix_length", "input_tokens", "output_tokens",
               "text_tokens", "image_tokens", "audio_tokens", "video_tokens", "deadline_us",
               "server_input_tokens", "arrival_time_us", "send_time_us", "slo_target_us",
               "think_time_us", "num_chunks"}
_SIGNED_INT = {"first_chunk_time_us", "last_chunk_time_us", "vllm_priority"}
_FLOAT = {"reason_ratio"}
_BOOL = {"streaming"}
# Informational / optional columns: an empty cell is allowed (kept as empty).
_EMPTY_OK = {"first_chunk_time_us", "last_chunk_time_us", "num_chunks", *OPTIONAL_COLUMNS}
# Columns the RequestSet does not represent: carried raw for re-export.
_CARRIED = ("prefix_length", "streaming", "input_tokens", "text_tokens", "image_tokens",
            "audio_tokens", "video_tokens", "reason_ratio", "server_input_tokens",
            "arrival_time_us", "send_time_us", "first_chunk_time_us", "last_chunk_time_us",
            "num_chunks", "status", "error_message", "finish_reason", *OPTIONAL_COLUMNS)

_HEADER_ORDER = ("trace_version", "time_unit", "created_at", "mode", "warm_up_requests",
                 "workload_seed", "workload_spec", "session_context_growth", "server", "network",
                 "goodput_slo_targets", "kv_offload", "observed_kv_metrics")
_HEADER_EXTRA = ("workload_spec", "session_context_growth", "server", "network", "kv_offload",
                 "observed_kv_metrics")
TRACE_MODES = ("real", "generated", "replayed")
GOODPUT_DIMENSIONS = ("ttft_ms", "itl_ms", "e2e_ms")
SUPPORTED_VERSIONS = (1, 2, 3)

_INT_RE = re.compile(r"[+-]?[0-9]+")
# Largest value per integer column: times and token counts stay within the limits that keep
# the engine's int64 sums exact (limits.py); anything else must fit int64.
_TIME_COLUMNS = {"arrival_time_us", "send_time_us", "deadline_us", "first_chunk_time_us", "last_chunk_time_us",
                 "slo_target_us", "think_time_us"}
_TOKEN_COLUMNS = {"prefix_length", "input_tokens", "output_tokens", "text_tokens", "image_tokens", "audio_tokens",
                  "video_tokens", "server_input_tokens"}
csv.field_size_limit(MAX_INPUT_BYTES)  # a long error_message cell is data, not an error
_GO_TRUE = {"1", "t", "T", "TRUE", "true", "True"}
_GO_FALSE = {"0", "f", "F", "FALSE", "false", "False"}


@dataclasses.dataclass(frozen=True)
class TraceHeader:
    """The trace.yaml header. `extra` holds the sections this project only carries
    (workload_spec, server, network, kv_offload, ...), verbatim."""

    trace_version: int = 3
    time_unit: str = "microseconds"
    mode: str = "generated"
    warm_up_requests: int = 0
    workload_seed: int | None = None
    created_at: str | None = None
    goodput_slo_targets: Mapping[str, Mapping[str, float]] | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        if isinstance(self.trace_version, bool) or not isinstance(self.trace_version, int) \
                or self.trace_version not in SUPPORTED_VERSIONS:
            raise ConfigError(f"trace header trace_version: {self.trace_version!r} is not supported "
                              f"(supported: {', '.join(map(str, SUPPORTED_VERSIONS))})")
        if self.time_unit != "microseconds":
            raise ConfigError(f"trace header time_unit: {self.time_unit!r}; only 'microseconds' is defined")
        if self.mode not in TRACE_MODES:
            raise ConfigError(f"trace header mode: {self.mode!r}; expected one of {', '.join(TRACE_MODES)}")
        if isinstance(self.warm_up_requests, bool) or not isinstance(self.warm_up_requests, int) \
                or self.warm_up_requests < 0:
            raise ConfigError(f"trace header warm_up_requests: {self.warm_up_requests!r} must be an integer ≥ 0")
        if self.workload_seed is not None and (isinstance(self.workload_seed, bool)
                                               or not isinstance(self.workload_seed, int)
                                               or not -2**63 <= self.workload_seed <= MAX_SEED):
            raise ConfigError(f"trace header workload_seed: {short(self.workload_seed)} must be a 64-bit integer")
        if isinstance(self.warm_up_requests, int) and self.warm_up_requests > INT64_MAX:
            raise ConfigError(f"trace header warm_up_requests: {short(self.warm_up_requests)} beyond 64-bit integers")
        if self.goodput_slo_targets is not None:
            _check_goodput(self.goodput_slo_targets)
        unknown = sorted(set(self.extra) - set(_HEADER_EXTRA))
        if unknown:
            raise ConfigError(f"trace header: unknown key(s) {short(', '.join(map(str, unknown)))}; known keys: "
                              f"{summarise(_HEADER_ORDER, 'keys', 'see TraceV2 in the spec')}")
        object.__setattr__(self, "extra", MappingProxyType(dict(self.extra)))

    def to_dict(self) -> dict[str, Any]:
        """Header mapping in BLIS's key order; absent optional keys omitted."""
        values = {"trace_version": self.trace_version, "time_unit": self.time_unit,
                  "created_at": self.created_at, "mode": self.mode,
                  "warm_up_requests": self.warm_up_requests, "workload_seed": self.workload_seed,
                  # BLIS writes its target struct: fields in declaration order, whole numbers bare
                  "goodput_slo_targets": (None if self.goodput_slo_targets is None else
                                          {c: {d: _yaml_number(t[d]) for d in GOODPUT_DIMENSIONS if d in t}
                                           for c, t in self.goodput_slo_targets.items()}),
                  **dict(self.extra)}
        return {k: values[k] for k in _HEADER_ORDER if values.get(k) is not None}


def _yaml_number(value: float) -> float | int:
    """Go's YAML writes a float64 with an integral value as an integer (`200`, not `200.0`)."""
    return int(value) if isinstance(value, float) and value.is_integer() and abs(value) < 2**53 else value


class _SimResultLike(Protocol):
    status: np.ndarray
    ttft_us: np.ndarray
    itl_sum_us: np.ndarray


# ---------------------------------------------------------------------------------- read


class _HeaderLoader(yaml.SafeLoader):
    """SafeLoader that keeps timestamps (created_at) as the strings written in the file."""


_HeaderLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


def read_header(path: str | Path) -> TraceHeader:
    """Parse and validate trace.yaml."""
    path = Path(path)
    source = f"--trace-header {path}"
    raw = load_yaml_text(read_text(path, source), source, loader=_HeaderLoader)
    if not isinstance(raw, dict):
        raise ConfigError(f"--trace-header {path}: expected a mapping of header keys")
    known = {f.name for f in dataclasses.fields(TraceHeader)} - {"extra"}
    unknown = sorted(str(k) for k in raw if k not in known and k not in _HEADER_EXTRA)
    if unknown:
        raise ConfigError(f"--trace-header {path}: unknown key(s) {short(', '.join(unknown))}; "
                          f"known keys: {summarise(_HEADER_ORDER, 'keys', 'see TraceV2 in the spec')}")
    fields = {k: v for k, v in raw.items() if k in known}
    if fields.get("created_at") is not None:
        fields["created_at"] = str(fields["created_at"])
    extra = {k: v for k, v in raw.items() if k in _HEADER_EXTRA}
    try:
        return TraceHeader(**fields, extra=extra)
    except ConfigError as e:
        raise ConfigError(f"--trace-header {path}: {e}") from e


def read_trace(header_path: str | Path, data_path: str | Path) -> tuple[TraceHeader, RequestSet]:
    """Read a TraceV2 header + CSV into (TraceHeader, RequestSet)."""
    header = read_header(header_path)
    columns = read_columns(data_path)
    return header, requests_from_columns(columns, source=str(data_path))


def read_columns(data_path: str | Path) -> dict[str, list[str]]:
    """CSV → {column: raw cells}, after checking the column set and row widths."""
    path = Path(data_path)
    text = read_text(path, f"--trace-data {path}")
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        names = next(reader, None)
        if not names:
            raise ConfigError(f"--trace-data {path}: empty file; expected a header row with the "
                              f"{len(REQUIRED_COLUMNS)} TraceV2 columns (request_id, client_id, ...)")
        _check_column_names(names, path)
        cells: dict[str, list[str]] = {name: [] for name in names}
        for row in reader:
            if not row:
                continue  # tolerate a trailing blank line
            if len(row) != len(names):
                raise ConfigError(f"--trace-data {path}: line {reader.line_num} has {len(row)} fields, "
                                  f"the header has {len(names)}")
            for name, cell in zip(names, row):
                cells[name].append(cell)
    except csv.Error as e:
        raise ConfigError(f"--trace-data {path}: line {reader.line_num}: not valid CSV ({e})") from None
    return cells


def _check_column_names(names: list[str], path: Path) -> None:
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"--trace-data {path}: duplicate column(s) {short(', '.join(dupes), 60)}")
    unknown = [n for n in names if n not in REQUIRED_COLUMNS and n not in OPTIONAL_COLUMNS]
    if unknown:
        raise ConfigError(f"--trace-data {path}: unknown column(s) {short(', '.join(unknown), 60)}; TraceV2 has "
                          f"{len(REQUIRED_COLUMNS)} required columns (request_id, client_id, ...) and "
                          f"{len(OPTIONAL_COLUMNS)} optional ones (vllm_priority, ...)")
    missing = [n for n in REQUIRED_COLUMNS if n not in names]
    if missing:
        raise ConfigError(f"--trace-data {path}: missing required column(s) "
                          f"{summarise(missing, 'columns', 'see TraceV2 in the spec')}")


def requests_from_columns(cells: Mapping[str, list[str]], source: str = "trace") -> RequestSet:
    """Validate raw cells column by column and build the RequestSet."""
    parsed = {name: _parse_column(name, values, source) for name, values in cells.items()}
    n = len(parsed["request_id"])
    groups = parsed["prefix_group"]
    group_prefix = _group_prefix_lengths(groups, parsed["prefix_length"])
    prefix_len = np.array([group_prefix.get(g, 0) for g in groups], dtype=np.int64)
    grouped = np.array([g != "" for g in groups], dtype=bool)
    server = np.asarray(parsed["server_input_tokens"], dtype=np.int64)
    fresh = np.asarray(parsed["input_tokens"], dtype=np.int64)
    # BLIS uses the server-reported prompt length for ungrouped rows when it is known.
    input_len = np.where(grouped, prefix_len + fresh, np.where(server > 0, server, fresh))
    empty = input_len < 1
    if np.any(empty):
        i = int(np.argmax(empty))
        raise ConfigError(f"{source}: row {i} (request_id {parsed['request_id'][i]}), column input_tokens: "
                          "the prompt is empty (0 tokens and no prefix); every request needs ≥ 1 input token")
    send = np.asarray(parsed["send_time_us"], dtype=np.int64)
    arrival = np.asarray(parsed["arrival_time_us"], dtype=np.int64)
    carried = {name: np.asarray(cells[name], dtype=str) if n else np.zeros(0, dtype="<U1")
               for name in _CARRIED if name in cells}
    try:
        return make_request_set(
            request_id=parsed["request_id"], arrival_us=np.where(send > 0, send, arrival),
            input_len=input_len, output_len=parsed["output_tokens"], deadline_us=parsed["deadline_us"],
            prefix_group=groups, prefix_len=prefix_len, slo_class=parsed["slo_class"],
            tenant_id=parsed["tenant_id"], client_id=parsed["client_id"], session_id=parsed["session_id"],
            round_index=parsed["round_index"], model=parsed["model"], trace_columns=carried)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from e


def _group_prefix_lengths(groups: list[str], lengths: list[int]) -> dict[str, int]:
    """Each group's prefix is created once, with the prefix_length of its first row."""
    out: dict[str, int] = {}
    for g, length in zip(groups, lengths):
        if g and g not in out:
            out[g] = length
    return out


def _parse_column(name: str, values: list[str], source: str) -> list:
    if name in _NONNEG_INT or name in _SIGNED_INT:
        return [_parse_int(name, v, i, source, signed=name in _SIGNED_INT) for i, v in enumerate(values)]
    if name in _FLOAT:
        return [_parse_float(name, v, i, source) for i, v in enumerate(values)]
    if name in _BOOL:
        return [_parse_bool(name, v, i, source) for i, v in enumerate(values)]
    if name == "status":
        for i, v in enumerate(values):
            if v not in TRACE_STATUSES and v != "":
                raise _cell_error(source, i, name, v, f"expected one of {', '.join(TRACE_STATUSES)}")
    return list(values)


def _parse_int(name: str, value: str, row: int, source: str, signed: bool) -> int | None:
    if value == "" and name in _EMPTY_OK:
        return None
    if not _INT_RE.fullmatch(value):
        raise _cell_error(source, row, name, value, "expected an integer")
    number = int(value)
    if not signed and number < 0:
        raise _cell_error(source, row, name, value, "must be ≥ 0")
    limit = MAX_TIME_US if name in _TIME_COLUMNS else MAX_TOKENS if name in _TOKEN_COLUMNS else INT64_MAX
    if abs(number) > limit:
        what = "µs" if name in _TIME_COLUMNS else "tokens" if name in _TOKEN_COLUMNS else ""
        raise _cell_error(source, row, name, value, f"is beyond the limit of {limit:,} {what}".rstrip())
    return number


def _parse_float(name: str, value: str, row: int, source: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise _cell_error(source, row, name, value, "expected a number") from None
    if not math.isfinite(number):
        raise _cell_error(source, row, name, value, "expected a finite number")
    return number


def _parse_bool(name: str, value: str, row: int, source: str) -> bool:
    if value in _GO_TRUE:
        return True
    if value in _GO_FALSE:
        return False
    raise _cell_error(source, row, name, value, "expected true or false")


def _cell_error(source: str, row: int, column: str, value: str, why: str) -> ConfigError:
    return ConfigError(f"{source}: row {row} (line {row + 2}), column {column}: {short(value, 30)} {why}")


def _check_goodput(targets: Any) -> None:
    if not isinstance(targets, Mapping):
        raise ConfigError("trace header goodput_slo_targets: expected {class: {ttft_ms, itl_ms, e2e_ms}}")
    for cls, dims in targets.items():
        if not isinstance(dims, Mapping):
            raise ConfigError(f"trace header goodput_slo_targets.{cls}: expected a mapping of "
                              f"{', '.join(GOODPUT_DIMENSIONS)}")
        for dim, value in dims.items():
            if dim not in GOODPUT_DIMENSIONS:
                raise ConfigError(f"trace header goodput_slo_targets.{cls}: unknown target {dim!r}; "
                                  f"use {', '.join(GOODPUT_DIMENSIONS)}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"trace header goodput_slo_targets.{cls}.{dim}: {value!r} must be a number > 0")


# --------------------------------------------------------------------------------- write


def write_trace(prefix: str | Path, header: TraceHeader, requests: RequestSet,
                sim_output: _SimResultLike | None = None) -> tuple[Path, Path]:
    """Write `<prefix>.yaml` and `<prefix>.csv`; return both paths.

    With `sim_output` (per-request arrays in `requests` row order) the chunk times and status
    come from the simulation: first_chunk = arrival + TTFT, last_chunk = arrival + TTFT + ΣITL
    (post-decode overhead excluded), status ok / timeout / incomplete. Without it, carried
    columns are written back unchanged.
    """
    prefix = Path(prefix)
    yaml_path, csv_path = prefix.with_name(prefix.name + ".yaml"), prefix.with_name(prefix.name + ".csv")
    atomic_write_text(yaml_path, format_header(header))
    atomic_write_text(csv_path, format_records(requests, sim_output), newline="")
    return yaml_path, csv_path


def format_header(header: TraceHeader) -> str:
    # Go's yaml.v3 indents nested mappings by 4 spaces and keeps struct-field order.
    return _go_sequences(yaml.safe_dump(header.to_dict(), sort_keys=False, indent=4, default_flow_style=False,
                                        allow_unicode=True))


_ITEM = re.compile(r"( *)- {1,3}(.*)")


def _go_sequences(text: str) -> str:
    """PyYAML's block sequences as Go's yaml.v3 writes them (the kv_offload block's tiers): the
    dash indented 4 under its key, the item's keys 2 after the dash —
    `key:` / `    - a: 1` / `      b: 2` rather than `key:` / `-   a: 1` / `    b: 2`."""
    lines, items = [], []   # items: the dash columns (PyYAML's) of the enclosing sequence items
    for line in text.split("\n"):
        indent = len(line) - len(line.lstrip(" "))
        item = _ITEM.fullmatch(line)
        while items and line.strip() and (indent < items[-1] + 4 or (item and indent == items[-1])):
            items.pop()
        if item:
            lines.append(" " * (indent + 2 * len(items) + 4) + "- " + item.group(2))
            items.append(indent)
        else:
            lines.append(" " * (2 * len(items)) + line if line.strip() else line)
    return "\n".join(lines)


def trace_column_order(requests: RequestSet) -> list[str]:
    """Required columns plus the optional ones this request set carries, in BLIS order."""
    order = list(REQUIRED_COLUMNS)
    for name, after in OPTIONAL_COLUMNS.items():
        if name in requests.trace_columns:
            order.insert(order.index(after) + 1 if after else len(order), name)
    return order


def format_records(requests: RequestSet, sim_output: _SimResultLike | None = None) -> str:
    columns = _record_columns(requests, sim_output)
    order = trace_column_order(requests)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(order)
    for i in range(len(requests)):
        writer.writerow([columns[name][i] for name in order])
    return buf.getvalue()


def _record_columns(requests: RequestSet, sim_output: _SimResultLike | None) -> dict[str, list[str]]:
    n = len(requests)
    raw = requests.trace_columns

    def carried(name: str, default: str) -> list[str]:
        return [str(v) for v in raw[name]] if name in raw else [default] * n

    grouped = requests.prefix_group != NO_PREFIX_GROUP
    names = requests.prefix_group_names
    server = np.array([int(v) if v else 0 for v in carried("server_input_tokens", "0")], dtype=np.int64)
    fresh = requests.input_len - requests.prefix_len
    if "prefix_group" in raw and "prefix_length" in raw:
        # BLIS's own labels of a generated set: a follow-up round has prefix_length 0 and its
        # whole prompt as input_tokens, though its tokens still start with the group prefix.
        fresh = requests.input_len - np.array([int(v) for v in raw["prefix_length"]], dtype=np.int64)
    raw_input = carried("input_tokens", "")
    # Ungrouped rows whose prompt came from server_input_tokens keep their recorded input_tokens.
    input_tokens = [raw_input[i] if (not grouped[i] and server[i] > 0 and raw_input[i]) else str(fresh[i])
                    for i in range(n)]
    arrival = [str(v) for v in requests.arrival_us]
    cols: dict[str, list[str]] = {
        "request_id": _ints(requests.request_id),
        "client_id": list(requests.client_id), "tenant_id": list(requests.tenant_id),
        "slo_class": list(requests.slo_class), "session_id": list(requests.session_id),
        "round_index": _ints(requests.round_index),
        # A generated set may carry BLIS's own labels (session rounds leave the group out).
        "prefix_group": carried("prefix_group", "") if "prefix_group" in raw
        else [names[g] if g >= 0 else "" for g in requests.prefix_group],
        "prefix_length": carried("prefix_length", "0") if "prefix_group" in raw else
        [str(p) if grouped[i] else c for i, (p, c) in enumerate(zip(requests.prefix_len, carried("prefix_length", "0")))],
        "streaming": carried("streaming", "false"),
        "input_tokens": input_tokens, "output_tokens": _ints(requests.output_len),
        "text_tokens": carried("text_tokens", "0"), "image_tokens": carried("image_tokens", "0"),
        "audio_tokens": carried("audio_tokens", "0"), "video_tokens": carried("video_tokens", "0"),
        "reason_ratio": carried("reason_ratio", "0"), "model": list(requests.model),
        "deadline_us": _ints(requests.deadline_us),
        "server_input_tokens": carried("server_input_tokens", "0"),
        "arrival_time_us": carried("arrival_time_us", "") if "arrival_time_us" in raw else arrival,
        "send_time_us": carried("send_time_us", "") if "send_time_us" in raw else arrival,
        **{name: carried(name, "") for name in OPTIONAL_COLUMNS if name in raw},
    }
    cols.update(_outcome_columns(requests, sim_output, carried))
    return cols


def _outcome_columns(requests: RequestSet, sim_output: _SimResultLike | None, carried) -> dict[str, list[str]]:
    n = len(requests)
    if sim_output is None:
        return {"first_chunk_time_us": carried("first_chunk_time_us", "0"),
                "last_chunk_time_us": carried("last_chunk_time_us", "0"),
                "num_chunks": carried("num_chunks", "0"), "status": carried("status", "incomplete"),
                "error_message": carried("error_message", ""), "finish_reason": carried("finish_reason", "")}
    status = np.asarray(sim_output.status)
    ttft = np.asarray(sim_output.ttft_us, dtype=np.int64)
    itl_sum = np.asarray(sim_output.itl_sum_us, dtype=np.int64)
    if status.shape != (n,) or ttft.shape != (n,) or itl_sum.shape != (n,):
        raise ConfigError(f"write_trace: sim_output has per-request arrays of shape {status.shape}, "
                          f"expected ({n},) in the request set's row order")
    has_ttft = ttft >= 0
    first = np.where(has_ttft, requests.arrival_us + ttft, 0)
    last = np.where(has_ttft, requests.arrival_us + ttft + itl_sum, 0)
    label = np.full(n, "incomplete", dtype=object)
    label[(status == COMPLETED) | (status == LENGTH_CAPPED)] = "ok"
    label[status == TIMED_OUT] = "timeout"
    return {"first_chunk_time_us": _ints(first), "last_chunk_time_us": _ints(last),
            "num_chunks": ["0"] * n, "status": [str(s) for s in label],
            "error_message": [""] * n, "finish_reason": [""] * n}


def _ints(arr: np.ndarray) -> list[str]:
    return [str(int(v)) for v in arr]
