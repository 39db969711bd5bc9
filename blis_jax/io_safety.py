"""Safe input reading and output writing, in one place for every subcommand.

* Inputs: `read_text` (bounded size, strict UTF-8, a UTF-8 BOM is accepted and dropped),
  `load_yaml_text` / `load_json_text` (bounded nesting depth and alias expansion, so a
  "billion laughs" file or a 10,000-deep list is refused instead of exhausting memory or
  the stack).
* Outputs: `check_command_paths` enforces the rule that no output may be, or overwrite, an
  input or another output of the same command (compared as resolved paths, symlinks and hard
  links included), and that each output's directory exists and is writable, before any
  simulation. `atomic_write_text` / `atomic_output` write a temporary file in the same
  directory and rename it over the target, so an interrupted run never leaves a half-written
  file where a good one was.
* Messages: `short` truncates an offending value, `summarise` a long list of names.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from blis_jax.errors import ConfigError

MAX_INPUT_BYTES = 256 * 2**20  # a 10^6-request trace is ~150 MB; anything larger is not an input file
MAX_NESTING = 64  # no input format of ours nests deeper than ~6
MAX_YAML_NODES = 2_000_000  # scalars + collections after alias expansion
MIN_FREE_BYTES = 64 * 2**10  # an output directory with less free space fails now, not after the run


# ------------------------------------------------------------------------------- messages


def short(value: Any, limit: int = 40) -> str:
    """repr(value), cut to `limit` characters with an ellipsis and the full length."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return repr(value) if isinstance(value, str) else text
    return f"{text[:limit]!r}... ({len(text)} characters)" if isinstance(value, str) else \
        f"{text[:limit]}... ({len(text)} characters)"


def short_path(path: str | Path, limit: int = 48) -> str:
    """A path for a message: whole when short, else '...' and its last `limit` characters."""
    text = str(path)
    return text if len(text) <= limit else "..." + text[-limit:]


def clip(text: Any, limit: int = 40) -> str:
    """str(text), cut to `limit` characters with '...'."""
    text = str(text)
    return text if len(text) <= limit else text[:limit] + "..."


def summarise(names: Sequence[str], what: str, hint: str, limit: int = 120) -> str:
    """'a, b, c' for a list that fits in `limit` characters; else
    '14 <what> (e.g. a, b; <hint>)'."""
    names = [str(n) for n in names]
    if len(", ".join(names)) <= limit:
        return ", ".join(names)
    return f"{len(names)} {what} (e.g. {', '.join(names[:2])}; {hint})"


# --------------------------------------------------------------------------------- inputs


def read_text(path: str | Path, what: str) -> str:
    """The file's text: at most MAX_INPUT_BYTES, UTF-8 (a leading BOM is dropped).
    Errors are one ConfigError line that starts with `what` (e.g. '--trace-data t.csv')."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_INPUT_BYTES + 1)
    except IsADirectoryError:
        raise ConfigError(f"{what}: is a directory; give a file") from None
    except OSError as e:
        raise ConfigError(f"{what}: cannot read ({e.strerror or e})") from None
    if len(data) > MAX_INPUT_BYTES:
        raise ConfigError(f"{what}: larger than {MAX_INPUT_BYTES // 2**20} MiB; split it or check the path")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ConfigError(f"{what}: not UTF-8 text (byte 0x{data[e.start]:02x} at line {line}); "
                          "save the file as UTF-8") from None
    return text


def check_yaml_shape(text: str, source: str) -> None:
    """Refuse YAML nested deeper than MAX_NESTING or expanding (aliases included) to more than
    MAX_YAML_NODES nodes, from the parser's events (iterative: no recursion, no expansion)."""
    anchors: dict[str, int] = {}
    stack: list[list] = []  # [node count so far, anchor name] per open collection
    depth = total = 0
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                stack.append([1, event.anchor])
                depth = max(depth, len(stack))
                if depth > MAX_NESTING:
                    line = event.start_mark.line + 1
                    raise ConfigError(f"{source}: nested more than {MAX_NESTING} levels deep (line {line})")
                continue
            if isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                size, anchor = stack.pop()
            elif isinstance(event, yaml.ScalarEvent):
                size, anchor = 1, event.anchor
            elif isinstance(event, yaml.AliasEvent):
                size, anchor = anchors.get(event.anchor, 1), None
            else:
                continue
            if anchor is not None:
                anchors[anchor] = size
            if stack:
                stack[-1][0] += size
            else:
                total += size
            if total + sum(s[0] for s in stack) > MAX_YAML_NODES:
                raise ConfigError(f"{source}: expands to more than {MAX_YAML_NODES:,} values (YAML aliases "
                                  "repeated?); write the data out or shrink it")
    except yaml.YAMLError:
        return  # the loader reports syntax errors with their position


def load_yaml_text(text: str, source: str, loader: type = yaml.SafeLoader) -> Any:
    """yaml.load with the shape bounds; YAML errors become one ConfigError line."""
    check_yaml_shape(text, source)
    try:
        return yaml.load(text, Loader=loader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML ({yaml_problem(e)})") from None
    except RecursionError:
        raise ConfigError(f"{source}: nested too deeply") from None


def load_json_text(text: str | bytes, source: str) -> Any:
    """json.loads with a nesting bound; errors become one ConfigError line."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8-sig")
        except UnicodeDecodeError:
            raise ConfigError(f"{source}: not UTF-8 text; save the file as UTF-8") from None
    _check_json_depth(text, source)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source}: not valid JSON ({e})") from None
    except RecursionError:
        raise ConfigError(f"{source}: nested too deeply") from None


def _check_json_depth(text: str, source: str) -> None:
    """Bracket depth outside strings (a cheap scan; the parser reports syntax errors)."""
    depth, in_string, escaped = 0, False, False
    if text.count("[") + text.count("{") <= MAX_NESTING:
        return
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_NESTING:
                raise ConfigError(f"{source}: nested more than {MAX_NESTING} levels deep")
        elif ch in "]}":
            depth -= 1


def yaml_problem(e: Exception) -> str:
    """A YAML error in a few words: the problem and its line (PyYAML's text quotes the input)."""
    problem, mark = getattr(e, "problem", None), getattr(e, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return _one_line(e)


def _one_line(e: Exception) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 160 else text[:157] + "..."


# -------------------------------------------------------------------------------- outputs


@contextlib.contextmanager
def atomic_output(path: str | Path, mode: str = "w", **open_kwargs) -> Iterator[Any]:
    """Open a temporary file beside `path`; on success it replaces `path` (os.replace), on an
    exception it is removed and `path` is left as it was. A symlink is followed (its target is
    replaced, not the link); a device or pipe (/dev/stdout) is written directly."""
    path = Path(os.path.realpath(path))
    if path.exists() and not path.is_file():
        with open(path, mode, **open_kwargs) as f:
            yield f
        return
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    try:
        with os.fdopen(fd, mode, **open_kwargs) as f:
            yield f
        try:
            os.chmod(tmp, 0o666 & ~_umask())
        except OSError:
            pass
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | Path, text: str, newline: str | None = None) -> None:
    with atomic_output(path, "w", encoding="utf-8", newline=newline) as f:
        f.write(text)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ------------------------------------------------------------------ the output-path rule

# Per subcommand: the flags that name input files, and the flags that name outputs with the
# files each one writes (a trace prefix writes PREFIX.yaml and PREFIX.csv; a directory flag
# writes the listed files inside it).
_SIM_INPUTS = ("workload_spec", "coefficients", "model", "hardware", "prefill_hardware", "decode_hardware",
               "trace_header", "trace_data", "policy_config")
_SIM_OUTPUTS = {"metrics_path": ("",), "results_path": ("",), "trace_output": (".yaml", ".csv")}
_INPUTS = {
    "run": _SIM_INPUTS, "replay": _SIM_INPUTS, "sensitivity": _SIM_INPUTS,
    "convert": ("spec",), "compose": ("from_specs",),
    "calibrate": ("trace_header", "trace_data", "sim_results", "sim_metrics"),
    "fit": ("observed", "start"), "sweep": ("grid",), "plan": ("grid",),
    "observe": ("workload_spec", "defaults_filepath"),
}


def _flag(name: str) -> str:
    return {"from_specs": "--from", "grid": "GRID.yaml"}.get(name, "--" + name.replace("_", "-"))


def _files(command: str, args) -> list[tuple[str, Path]]:
    """(flag, output file) pairs of the command (directories: the files written in them)."""
    out: list[tuple[str, Path]] = []

    def add(name: str, suffixes=("",)) -> None:
        value = getattr(args, name, None)
        if value is None:
            return
        if value == "":
            raise ConfigError(f"{_flag(name)}: empty path; give a file name or omit the flag")
        for suffix in suffixes:
            out.append((_flag(name), Path(value + suffix)))

    if command in ("run", "replay", "sensitivity"):
        for name, suffixes in _SIM_OUTPUTS.items():
            add(name, suffixes)
    if command in ("convert", "compose", "sensitivity", "fit"):
        add("output")
    if command == "calibrate":
        add("report")
    if command == "observe":  # the trace it records (its own check names a missing one)
        for name in ("trace_header", "trace_data"):
            if getattr(args, name, None):
                add(name)
        if getattr(args, "record_itl", False) and getattr(args, "trace_data", None):
            from blis_jax.observe.records import itl_path

            out.append(("--itl-output", Path(itl_path(args.trace_data, args.itl_output))))
    if command == "fit" and getattr(args, "report", None) is not None:
        if args.report == "":
            raise ConfigError("--report: empty path; give a directory or omit the flag")
        for name in ("report.json", "report.md", "predicted_vs_observed.png"):
            out.append(("--report", Path(args.report) / name))
    if command in ("sweep", "plan"):
        directory = getattr(args, "output_dir", None)
        if command == "sweep" and directory is None:
            directory = f"{Path(args.grid).stem}-sweep"
        if directory is not None:
            if directory == "":
                raise ConfigError("--output-dir: empty path; give a directory or omit the flag")
            names = ("plan.csv", "plan.json") if command == "plan" else ("table.csv", "table.json")
            out += [("--output-dir", Path(directory) / name) for name in names]
    return out


def _inputs(command: str, args) -> list[tuple[str, Path]]:
    found = []
    for name in _INPUTS.get(command, ()):
        value = getattr(args, name, None)
        for v in (value if isinstance(value, list) else [value]):
            if v and os.path.exists(v):  # --model / --hardware may be a bundled name, not a file
                found.append((_flag(name), Path(v)))
                if os.path.isdir(v):  # --model DIR reads DIR/config.json
                    found.append((_flag(name), Path(v) / "config.json"))
    return found


def _same(a: Path, b: Path) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def check_command_paths(command: str, args) -> None:
    """The output-path rule for one parsed command line (ConfigError naming both flags)."""
    outputs = _files(command, args)
    inputs = _inputs(command, args)
    for i, (flag, path) in enumerate(outputs):
        for in_flag, in_path in inputs:
            if _same(path, in_path):
                raise ConfigError(f"{flag} would overwrite the input {in_flag} {short_path(in_path)}; "
                                  "write the output to another file")
        for other_flag, other in outputs[:i]:
            if _same(path, other):
                raise ConfigError(f"{flag} and {other_flag} both write {short_path(path)}; "
                                  "give each output its own file")
        _check_writable(flag, path, is_dir_member=command in ("sweep", "plan") or
                        (command == "fit" and flag == "--report"))


def _check_writable(flag: str, path: Path, is_dir_member: bool) -> None:
    if path.is_dir():
        raise ConfigError(f"{flag} {short_path(path)}: is a directory; give a file name")
    parent = path.parent
    # A sweep's --output-dir (and fit's --report) may be created by the command: check the
    # nearest existing ancestor instead.
    if is_dir_member:
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
    if parent.exists() and not parent.is_dir():
        raise ConfigError(f"{flag} {short_path(path)}: {short_path(parent, 40)!r} is a file, not a directory")
    if not parent.is_dir():
        raise ConfigError(f"{flag} {short_path(path)}: directory {short_path(parent, 40)!r} does not exist; "
                          "create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {short_path(path)}: directory {short_path(parent, 32)} is not writable; "
                          "choose another location")
    try:
        st = os.statvfs(parent)
    except (OSError, AttributeError):
        return
    if st.f_bavail * st.f_frsize < MIN_FREE_BYTES:
        raise ConfigError(f"{flag} {short_path(path)}: no space left on its device; free some space "
                          "or choose another location")
