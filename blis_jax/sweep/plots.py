"""PNG plots of a sweep table: a metric against one axis, one line per value of another.

Axes that are neither x nor lines (e.g. seeds) are averaged over, with a band from their
minimum to their maximum, and the title says so. Failed scenarios are left out.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from blis_jax.io_safety import atomic_output
from blis_jax.sweep.grid import PlotSpec
from blis_jax.sweep.table import SweepTable

DEFAULT_METRICS = ("ttft_p99_ms", "itl_p99_ms", "e2e_p99_ms")
MAX_LINES = 10  # a lines axis with more values than this is averaged over instead
LOG_Y_RATIO = 100  # a y range wider than this (all positive) is drawn on a log scale
AXIS_LABELS = {"rate": "rate (requests/s)", "horizon": "horizon (µs)", "timeout": "timeout (s)",
               "total-kv-blocks": "total KV blocks", "alpha[0]": "alpha[0] (µs)", "num-instances": "instances"}


def default_plots(table: SweepTable) -> list[PlotSpec]:
    """x: the first numeric non-seed axis with several values; lines: the next axis (not seed)
    with 2..MAX_LINES values; one plot per default metric. None without such an x axis."""
    varying = [a for a in table.axes if len(_distinct(table, a)) > 1]
    numeric = [a for a in varying if all(_is_number(v) for v in _distinct(table, a))]
    xs = [a for a in numeric if a != "seed"] or numeric
    if not xs:
        return []
    x = xs[0]
    lines = next((a for a in varying if a not in (x, "seed") and len(_distinct(table, a)) <= MAX_LINES), None)
    return [PlotSpec(metric=m, x=x, lines=lines) for m in DEFAULT_METRICS]


def plot_file_name(spec: PlotSpec) -> str:
    name = f"{spec.metric}_vs_{spec.x}" + (f"_by_{spec.lines}" if spec.lines else "")
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") + ".png"


def write_plot(table: SweepTable, spec: PlotSpec, path: str | Path, title: str | None = None) -> Path:
    """Draw `spec` from `table` into a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window (and no display needed)
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    averaged = [a for a in table.axes if a not in (spec.x, spec.lines) and len(_distinct(table, a)) > 1]
    xs = _distinct(table, spec.x)
    numeric_x = all(_is_number(v) for v in xs)
    position = {v: (float(v) if numeric_x else k) for k, v in enumerate(xs)}
    series: dict[Any, dict[Any, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in table.rows:
        value = row.get(spec.metric)
        if value is None:
            continue
        key = row[spec.lines] if spec.lines else None
        series[_hashable(key)][_hashable(row[spec.x])].append(float(value))

    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    line_keys = _distinct(table, spec.lines) if spec.lines else [None]
    drawn: list[float] = []
    for key in line_keys:
        points = series.get(_hashable(key))
        if not points:
            continue
        order = sorted(points, key=lambda v: position[v])
        px = [position[v] for v in order]
        mean = [sum(points[v]) / len(points[v]) for v in order]
        drawn += [y for v in order for y in points[v]]
        label = f"{spec.lines} = {key}" if spec.lines else spec.metric
        style = "-" if numeric_x else ":"  # categories have no order between them: a faint guide only
        (line,) = ax.plot(px, mean, marker="o", markersize=5, linewidth=1.6, linestyle=style, label=label)
        if averaged:
            lo, hi = [min(points[v]) for v in order], [max(points[v]) for v in order]
            ax.fill_between(px, lo, hi, color=line.get_color(), alpha=0.15, linewidth=0)
    if numeric_x:
        values = [float(v) for v in xs]
        if min(values) > 0 and max(values) / min(values) >= 50:
            ax.set_xscale("log")
            if len(values) <= 12:  # label the grid's values rather than powers of ten
                ax.set_xticks(values, [f"{v:g}" for v in values])
                ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    else:
        ax.set_xticks(range(len(xs)), [_short(v) for v in xs], rotation=15, ha="right")
        ax.margins(x=0.15)
    if drawn and min(drawn) > 0 and max(drawn) / min(drawn) >= LOG_Y_RATIO:
        ax.set_yscale("log")  # e.g. TTFT from tens of ms (stable) to tens of s (saturated)
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel(AXIS_LABELS.get(spec.x, spec.x))
    ax.set_ylabel(spec.metric)
    heading = title or f"{spec.metric} vs {spec.x}"
    if averaged:
        heading += f"\n(mean over {', '.join(averaged)}; band: min to max)"
    ax.set_title(heading, fontsize=10)
    ax.grid(True, alpha=0.3)
    if spec.lines:
        ax.legend(fontsize=8, title_fontsize=8, loc="best")
    fig.tight_layout()
    path = Path(path)
    with atomic_output(path, "wb") as f:
        fig.savefig(f, format=Path(path).suffix.lstrip(".") or "png")
    plt.close(fig)
    return path


def write_plots(table: SweepTable, specs: Sequence[PlotSpec], directory: str | Path,
                title_prefix: str = "") -> list[Path]:
    directory = Path(directory)
    paths = []
    for spec in specs:
        title = f"{title_prefix}{spec.metric} vs {spec.x}"
        paths.append(write_plot(table, spec, directory / plot_file_name(spec), title=title))
    return paths


def _distinct(table: SweepTable, axis: str) -> list[Any]:
    seen: dict[Any, Any] = {}
    for row in table.rows:
        seen.setdefault(_hashable(row[axis]), row[axis])
    return list(seen.values())


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _short(value: Any, limit: int = 28) -> str:
    """A tick label: model ids and paths without their organisation / directories."""
    text = str(value).rstrip("/").rsplit("/", 1)[-1]
    return text if len(text) <= limit else "…" + text[-(limit - 1):]
