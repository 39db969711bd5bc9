"""PNG of instance counts over simulated time, one panel per autoscaled scenario: routable,
loading and draining instances as step functions (exact: from when each instance entered each
lifecycle state, `cluster/timeline.py`)."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from blis_jax.cluster import timeline
from blis_jax.io_safety import atomic_output

PANELS_PER_FILE = 12
SERIES = (("routable", "tab:blue"), ("loading", "tab:orange"), ("draining", "tab:red"))


def instance_counts(out) -> dict[str, np.ndarray] | None:
    """The instance counts of an autoscaled run's `SimOutput` (None for a run without an
    autoscaler), up to its last simulated event."""
    if out.instance_entered is None:
        return None
    return timeline.counts(out.instance_entered, int(np.max(out.sim_end_us, initial=0)))


def write_instance_counts(counts: Mapping[str, Mapping[str, Any]], path: str | Path, title: str = "") -> Path:
    """Draw {panel label: `timeline.counts(...)`} into one PNG at `path` (a grid of panels)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    labels = list(counts)
    cols = min(3, max(1, len(labels)))
    rows = max(1, math.ceil(len(labels) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.6 * rows + 0.6), dpi=110, squeeze=False,
                             sharex=True)
    top = max((int(np.max(c[name], initial=0)) for c in counts.values() for name, _ in SERIES), default=1)
    for k, ax in enumerate(axes.flat):
        if k >= len(labels):
            ax.set_visible(False)
            continue
        c = counts[labels[k]]
        t = np.asarray(c["time_us"], np.float64) / 1e6
        for name, color in SERIES:
            ax.step(t, np.asarray(c[name]), where="post", color=color, linewidth=1.4, label=name)
        ax.set_title(textwrap.fill(labels[k], 48), fontsize=7)
        ax.set_ylim(-0.3, top + 0.7)
        ax.grid(True, alpha=0.3)
        if k % cols == 0:
            ax.set_ylabel("instances")
        if k >= len(labels) - cols:
            ax.set_xlabel("simulated time (s)")
    axes.flat[0].legend(fontsize=7, loc="upper left")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    with atomic_output(path, "wb") as f:
        fig.savefig(f, format="png")
    plt.close(fig)
    return path


def write_sweep_instance_counts(table, directory: str | Path, title_prefix: str = "",
                                labels: Mapping[int, str] | None = None) -> list[Path]:
    """`instance_counts.png` (`instance_counts_<k>.png` past PANELS_PER_FILE scenarios) from a
    sweep table's timelines; nothing when no scenario was autoscaled."""
    from blis_jax.sweep.grid import scenario_label

    if not table.timelines:
        return []
    values = {row["scenario"]: {a: row[a] for a in table.axes} for row in table.rows}
    indices = sorted(table.timelines)
    named = [(labels or {}).get(i) or scenario_label(i, values.get(i, {})) for i in indices]
    parts: Sequence = [list(zip(indices, named))[k:k + PANELS_PER_FILE]
                       for k in range(0, len(indices), PANELS_PER_FILE)]
    paths = []
    for n, part in enumerate(parts):
        name = "instance_counts.png" if len(parts) == 1 else f"instance_counts_{n + 1}.png"
        paths.append(write_instance_counts({label: table.timelines[i] for i, label in part}, Path(directory) / name,
                                           title=f"{title_prefix}instances over time"))
    return paths
