"""Sweep grid YAML → validated `Grid` → one `ScenarioSpec` per scenario.

    base:                 # settings of every scenario: `blis-jax run` flag names, no dashes
      model: meta-llama/llama-3.1-8b-instruct
      num-requests: 1000
    axes:                 # cartesian product, first axis varies slowest (no axes: base alone) ...
      rate: [5, 10, 20]
      max-num-seqs: [64, 256]
    # scenarios:          # ... or an explicit list (every entry sets the same keys)
    #   - {model: qwen/qwen3-14b, tp: 1}
    plots:                # optional: metric against one axis, one line per value of another
      - {metric: ttft_p99_ms, x: rate, lines: max-num-seqs}

An axis is any run setting (numbers, or categorical strings such as model or hardware, and
the cluster settings: num-instances, routing-policy, routing-scorers, admission-policy, ...)
or a coefficient axis (`alpha[i]`, `beta[i]`, `alpha-scale`, `beta-scale`). Validation is
strict: an unknown key or a mistyped value raises a ConfigError naming it and the fix.
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import itertools
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from blis_jax import limits
from blis_jax.config.bundled import bundled_dir
from blis_jax.errors import ConfigError
from blis_jax.io_safety import clip, read_text, short, short_path
from blis_jax.sweep import coefficient_axes, scaling_axes, settings
from blis_jax.sweep.table import METRICS
from blis_jax.workload.spec import load_yaml

TOP_KEYS = ("base", "axes", "scenarios", "plots")
PLOT_KEYS = ("metric", "x", "lines")
# Settings that name files: a relative path is relative to the grid file.
PATH_SETTINGS = ("workload-spec",)
# Settings that may name a file or a bundled id (a shipped coefficient set by name): relative to the
# grid file when that file exists.
MAYBE_PATH_SETTINGS = ("model", "hardware", "coefficients")


@dataclasses.dataclass(frozen=True)
class PlotSpec:
    metric: str
    x: str
    lines: str | None = None


@dataclasses.dataclass(frozen=True)
class ScenarioSpec:
    """Scenario `index`: its axis values and the run settings ({key: checked value}) they give."""

    index: int
    values: Mapping[str, Any]
    settings: Mapping[str, Any]

    @property
    def label(self) -> str:
        return scenario_label(self.index, self.values)


def scenario_label(index: int, values: Mapping[str, Any]) -> str:
    """'scenario 3 (rate=8, seed=2)': how errors and warnings name a scenario."""
    text = ", ".join(f"{k}={v}" for k, v in values.items())
    return f"scenario {index}" + (f" ({text})" if text else "")


@dataclasses.dataclass(frozen=True)
class Grid:
    """A validated grid: base settings (checked values), axis keys, one value combination per
    scenario, and plots."""

    base: Mapping[str, Any]
    axes: tuple[str, ...]
    combos: tuple[Mapping[str, Any], ...]
    plots: tuple[PlotSpec, ...] = ()
    source: str = "grid"

    def scenarios(self) -> list[ScenarioSpec]:
        out = []
        for i, combo in enumerate(self.combos):
            values = dict(combo)
            where = f"{self.source}: {scenario_label(i, values)}"
            checked = dict(self.base)
            for key, value in values.items():
                if scaling_axes.is_scaling_axis(key):
                    checked[key] = scaling_axes.check_value(key, value, where)
                elif not coefficient_axes.is_coefficient_axis(key):
                    checked[key] = settings.check_value(key, value, where)
            checked = coefficient_axes.apply(checked, values, where)
            out.append(ScenarioSpec(index=i, values=values, settings=checked))
        return out

    def with_axis(self, key: str, values: list[Any]) -> Grid:
        """This grid with axis `key` replaced (or added as the innermost axis) by `values`."""
        key = _axis_key(key, "--search")
        _check_axis_values(key, values, f"{self.source}: axes.{key}")
        others = [a for a in self.axes if a != key]
        rest = _unique_combos(self.combos, others)
        limits.check_scenarios(len(rest) * len(values), "give fewer --candidates or shrink the grid's other axes")
        combos = tuple({**c, key: v} for c in rest for v in values)
        _check_scenarios(self.base, combos, self.source)
        return dataclasses.replace(self, axes=(*others, key), combos=combos)


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _unique_combos(combos, keys) -> list[dict]:
    seen: dict[tuple, dict] = {}
    for c in combos:
        sub = {k: c[k] for k in keys}
        seen.setdefault(tuple(_hashable(v) for v in sub.values()), sub)
    return list(seen.values())


def load_grid(path: str | Path) -> Grid:
    """Read and validate a grid YAML file, or a bundled example grid by name (``quick``)."""
    path = resolve_grid_path(path)
    if not path.exists():
        names = ", ".join(sorted(p.stem for p in bundled_dir("sweeps").glob("*.yaml")))
        raise ConfigError(f"grid {short_path(path)}: cannot read it (no such file); give a grid YAML file "
                          f"or a bundled grid name ({names})")
    text = read_text(path, f"grid {path}")
    return parse_grid(load_yaml(text, source=f"grid {path}"), source=str(path), root=path.parent)


def resolve_grid_path(path: str | Path) -> Path:
    """``path`` itself if it exists; else a bundled grid of that name (``configs/sweeps``)."""
    path = Path(path)
    if path.exists() or len(path.parts) != 1:
        return path
    for candidate in (path, path.with_name(path.name + ".yaml")):
        bundled = bundled_dir("sweeps") / candidate.name
        if bundled.is_file():
            return bundled
    return path


def parse_grid(data: Any, source: str = "grid", root: Path | None = None) -> Grid:
    """Validate a grid mapping (already parsed YAML); `root` resolves relative file settings."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: the grid must be a mapping with keys {', '.join(TOP_KEYS)}")
    _check_keys(data, TOP_KEYS, source)
    base = _parse_base(data.get("base") or {}, source, root)
    has_axes, has_list = "axes" in data, "scenarios" in data
    if has_axes and has_list:
        raise ConfigError(f"{source}: give one of `axes` (a cartesian product) or `scenarios` (an "
                          "explicit list), not both")
    if has_axes:
        axes, combos = _parse_axes(data["axes"], source, root)
    elif has_list:
        axes, combos = _parse_list(data["scenarios"], source, root)
    else:  # the base scenario alone (e.g. for `plan --candidates`)
        axes, combos = (), [{}]
    for key in axes:
        if key in base:
            raise ConfigError(f"{source}: {key} is both in base and an axis; remove it from base")
    _check_scenarios(base, combos, source)
    plots = _parse_plots(data.get("plots") or [], axes, source)
    return Grid(base=base, axes=axes, combos=tuple(combos), plots=plots, source=source)


def _check_keys(mapping: Mapping, allowed, where: str) -> None:
    for key in mapping:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), list(allowed), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"{where}: unknown key {short(key)}{hint}; allowed: {', '.join(allowed)}")


def _parse_base(base: Any, source: str, root: Path | None) -> dict[str, Any]:
    where = f"{source}: base"
    if not isinstance(base, Mapping):
        raise ConfigError(f"{where}: must be a mapping of run settings, e.g. {{rate: 10, num-requests: 500}}")
    out: dict[str, Any] = {}
    for raw_key, value in base.items():
        if isinstance(raw_key, str) and coefficient_axes.is_coefficient_axis(raw_key):
            raise ConfigError(f"{where}.{raw_key}: is an axis only; in base give alpha-coeffs / beta-coeffs")
        if scaling_axes.is_scaling_axis(raw_key):
            key = scaling_axes.canonical(raw_key)
            if key in out:
                raise ConfigError(f"{where}.{raw_key}: {key} is set twice (dashes and underscores are the same key)")
            out[key] = scaling_axes.check_value(key, value, where)
            continue
        key = settings.canonical_key(raw_key, where)
        if key in out:
            raise ConfigError(f"{where}.{raw_key}: {key} is set twice (dashes and underscores are the same key)")
        out[key] = _file_setting(key, settings.check_value(key, value, where), root)
        _check_cluster_value(key, value, f"{where}.{key}")
    return out


def _file_setting(key: str, value: Any, root: Path | None) -> Any:
    if root is None or key not in (*PATH_SETTINGS, *MAYBE_PATH_SETTINGS) or Path(value).is_absolute():
        return value
    candidate = root / value
    if key in PATH_SETTINGS or os.path.exists(candidate):
        return str(candidate)
    return value


def _axis_key(raw_key: Any, where: str) -> str:
    if isinstance(raw_key, str) and coefficient_axes.is_coefficient_axis(raw_key.strip()):
        return raw_key.strip()
    if scaling_axes.is_scaling_axis(raw_key):
        return scaling_axes.canonical(raw_key)
    return settings.canonical_key(raw_key, where)


def _check_axis_values(key: str, values: Any, where: str) -> None:
    if not isinstance(values, list) or not values:
        raise ConfigError(f"{where}: must be a non-empty list of values, e.g. [1, 2, 4]")
    try:
        counts = collections.Counter(_hashable(v) for v in values)
    except TypeError:  # an unhashable value: the value check below names it
        counts = collections.Counter()
    dupes = sorted(str(v) for v, c in counts.items() if c > 1)
    if dupes:
        raise ConfigError(f"{where}: duplicate value(s) {clip(', '.join(dupes))}; list each value once")
    _check_values(key, values, where)


def _check_values(key: str, values, where: str) -> None:
    if coefficient_axes.is_coefficient_axis(key):
        coefficient_axes.check_axis(key, values, where.rsplit(".", 1)[0])
        return
    if scaling_axes.is_scaling_axis(key):
        for value in values:
            scaling_axes.check_value(key, value, where.rsplit(".", 1)[0])
        return
    for value in values:
        settings.check_value(key, value, where.rsplit(".", 1)[0])
        _check_cluster_value(key, value, where)


def _check_cluster_value(key: str, value: Any, where: str) -> None:
    """Cluster settings `run` would only reject later: the instance count's range and the
    weighted-routing scorer list (value already type-checked by settings.check_value)."""
    if key == "num-instances":
        from blis_jax.cluster.simulate import MAX_INSTANCES

        if not 1 <= int(value) <= MAX_INSTANCES:
            raise ConfigError(f"{where}: {value}: the number of instances must be an integer in "
                              f"1..{MAX_INSTANCES}")
    elif key in ("routing-scorers", "prefill-routing-scorers", "decode-routing-scorers"):
        from blis_jax.cluster.scorers import parse_profile

        parse_profile(str(value), flag=where)


def _check_scenarios(base: Mapping[str, Any], combos, source: str) -> None:
    """Rules between settings, per scenario: routing-scorers needs routing-policy weighted
    (as `run`, but before anything is resolved)."""
    default_policy = settings.default("routing-policy")
    for i, combo in enumerate(combos):
        if "routing-scorers" not in combo and "routing-scorers" not in base:
            continue
        policy = str(combo.get("routing-policy", base.get("routing-policy", default_policy)))
        if policy != "weighted":
            where = "base" if "routing-scorers" in base and "routing-policy" not in combo else scenario_label(i, combo)
            raise ConfigError(f"{source}: {where}: routing-scorers is used by routing-policy weighted only, but "
                              f"the policy is {policy}; set routing-policy: weighted or drop routing-scorers")


def _parse_axes(axes: Any, source: str, root: Path | None) -> tuple[tuple[str, ...], list[dict]]:
    where = f"{source}: axes"
    if not isinstance(axes, Mapping) or not axes:
        raise ConfigError(f"{where}: must be a mapping of setting → list of values, e.g. {{rate: [1, 2, 4]}}")
    # Count the scenarios before building or checking any of them.
    limits.check_scenarios(math.prod(len(v) if isinstance(v, list) else 1 for v in axes.values()),
                           f"shrink the axes of {source}")
    parsed: dict[str, list] = {}
    for raw_key, values in axes.items():
        key = _axis_key(raw_key, where)
        if key in parsed:
            raise ConfigError(f"{where}.{raw_key}: {key} is given twice")
        _check_axis_values(key, values, f"{where}.{key}")
        parsed[key] = [_axis_file_value(key, v, root) for v in values]
    keys = tuple(parsed)
    combos = [dict(zip(keys, combo)) for combo in itertools.product(*parsed.values())]
    return keys, combos


def _axis_file_value(key: str, value: Any, root: Path | None) -> Any:
    if isinstance(value, str) and (key in PATH_SETTINGS or key in MAYBE_PATH_SETTINGS):
        return _file_setting(key, value, root)
    return value


def _parse_list(entries: Any, source: str, root: Path | None) -> tuple[tuple[str, ...], list[dict]]:
    where = f"{source}: scenarios"
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{where}: must be a non-empty list of mappings, e.g. [{{rate: 5}}, {{rate: 10}}]")
    limits.check_scenarios(len(entries), f"shorten the scenarios of {source}")
    keys: tuple[str, ...] | None = None
    combos = []
    for i, entry in enumerate(entries):
        at = f"{where}[{i}]"
        if not isinstance(entry, Mapping) or not entry:
            raise ConfigError(f"{at}: must be a non-empty mapping of settings")
        combo = {}
        for raw_key, value in entry.items():
            key = _axis_key(raw_key, at)
            if key in combo:
                raise ConfigError(f"{at}.{raw_key}: {key} is given twice")
            _check_values(key, [value], f"{at}.{key}")
            combo[key] = _axis_file_value(key, value, root)
        if keys is None:
            keys = tuple(combo)
        elif set(combo) != set(keys):
            raise ConfigError(f"{at}: sets {', '.join(sorted(combo))} but scenarios[0] sets "
                              f"{', '.join(sorted(keys))}; every entry must set the same keys")
        combos.append({k: combo[k] for k in keys})
    return keys or (), combos


def _parse_plots(plots: Any, axes: tuple[str, ...], source: str) -> tuple[PlotSpec, ...]:
    where = f"{source}: plots"
    if not isinstance(plots, list):
        raise ConfigError(f"{where}: must be a list of {{metric, x, lines}} mappings")
    out = []
    for i, entry in enumerate(plots):
        at = f"{where}[{i}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{at}: must be a mapping with metric, x and (optional) lines")
        _check_keys(entry, PLOT_KEYS, at)
        out.append(plot_spec(entry.get("metric"), entry.get("x"), entry.get("lines"), axes, at))
    return tuple(out)


def plot_spec(metric: Any, x: Any, lines: Any, axes: tuple[str, ...], where: str) -> PlotSpec:
    """A checked plot: a known metric against an axis, optionally one line per another axis."""
    if metric not in METRICS:
        close = difflib.get_close_matches(str(metric), METRICS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"{where}.metric: {metric!r} is not a metric{hint}; choose one of {', '.join(METRICS)}")
    resolved = []
    for field, value in (("x", x), ("lines", lines)):
        if value is None and field == "lines":
            resolved.append(None)
            continue
        key = value.strip() if isinstance(value, str) else value
        if scaling_axes.is_scaling_axis(key):
            key = scaling_axes.canonical(key)
        elif isinstance(key, str) and not coefficient_axes.is_coefficient_axis(key):
            try:
                key = settings.canonical_key(key, where)  # underscores and aliases, as for axes
            except ConfigError:
                pass  # not a setting at all: reported below as "not an axis"
        if key not in axes:
            raise ConfigError(f"{where}.{field}: {short(value)} is not an axis of the grid; choose one of "
                              f"{', '.join(axes) or '(none)'}")
        resolved.append(key)
    if resolved[0] == resolved[1]:
        raise ConfigError(f"{where}.lines: {lines!r} is also x; choose another axis (or omit lines)")
    return PlotSpec(metric=str(metric), x=resolved[0], lines=resolved[1])
