"""Outputs of `blis-jax fit`: the coefficient YAML (fits/ format with provenance), the report
directory (report.json, report.md, predicted_vs_observed.png) and the stdout tables."""

from __future__ import annotations

import datetime
import json
import math
import subprocess
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import yaml

from blis_jax.fit.fit import (
    BLIS_BETA_NAMES,
    NUM_ALPHA,
    CVResult,
    Evaluation,
    FitResult,
    Prepared,
    coefficient_label,
    coefficient_name,
    split,
)
from blis_jax.fit.observed import LOSS_DEFINITION
from blis_jax.io_safety import atomic_output, atomic_write_text

HEADER = """\
# Trained-physics latency coefficients (blis-jax format; see blis_jax/config/coefficients.py).
# Written by `blis-jax fit` (blis_jax/fit/): provenance below, loss of a real simulation.
# alpha: [queueing (alpha0, us), post-decode (alpha1, us), per-output-token (alpha2, us)], and when
#   used, blis-jax's first-token lag (alpha3, in durations of the first token's step; BLIS: none)
# beta (slice index: name, multiplies):
#    0 b1a  prefill compute          1 b2a  decode compute (0: unused)
#    2 b3   weight loading           3 b4   TP all-reduce
#    4 b5   per layer (us/layer)     5 b6   per scheduled request (us/request)
#    6 b7   per step (us)            7 b8   per MoE layer, interleaved MoE only (us)
#    8 b1b  prefill KV write         9 b2b  decode KV read/write
#   10 bEP  MoE dispatch/combine
"""
PLOT_FILE = "predicted_vs_observed.png"


def git_commit(repo: Path | None = None) -> str | None:
    """`git describe --always --dirty` of the checkout holding blis_jax, or None."""
    repo = repo or Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(repo), "describe", "--always", "--dirty", "--abbrev=40"],
                             capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def _r(x: float, digits: int = 4) -> float:
    return float(round(float(x), digits))


def _loss_block(ev: Evaluation) -> dict:
    return {"loss_pct": _r(ev.loss), "ttft_rmse_pct": _r(ev.ttft_rmse), "e2e_rmse_pct": _r(ev.e2e_rmse), "n": len(ev.ids)}


def experiment_rows(exps: Sequence[Prepared], result: FitResult) -> list[dict]:
    rows = []
    for i, p in enumerate(exps):
        rows.append({"id": p.id, "model": p.obs.model, "tp": p.obs.tp,
                     "observed": {"ttft_mean_ms": p.obs.ttft_mean_ms, "e2e_mean_ms": p.obs.e2e_mean_ms},
                     "start": {k: _r(v) for k, v in result.start.row(i).items()},
                     "fitted": {k: _r(v) for k, v in result.best.row(i).items()}})
    return rows


def cv_document(cv: CVResult, num_betas: int) -> dict:
    return {"mode": cv.mode,
            "start": _loss_block(cv.start),
            "held_out": _loss_block(cv.fitted),
            "folds": [{"group": f.group, "held_out": list(f.held_out),
                       "train_loss_start_pct": _r(f.train_start_loss), "train_loss_fitted_pct": _r(f.train_fitted_loss),
                       "held_out_start": [{"id": i, **{k: _r(v) for k, v in f.start.row(j).items()}}
                                          for j, i in enumerate(f.start.ids)],
                       "held_out_fitted": [{"id": i, **{k: _r(v) for k, v in f.fitted.row(j).items()}}
                                           for j, i in enumerate(f.fitted.ids)],
                       "alpha": split(f.theta, num_betas)[0], "beta": split(f.theta, num_betas)[1]}
                      for f in cv.folds]}


def coefficient_document(*, name: str, result: FitResult, exps: Sequence[Prepared], num_betas: int,
                         observed_path: str, observed_sha256: str, start_path: str, start_name: str | None,
                         free: Sequence[int], lo: np.ndarray, hi: np.ndarray, settings: dict, command: str,
                         version: str, cv: CVResult | None = None) -> dict:
    alpha, beta = split(result.theta, num_betas)
    bounds = {coefficient_name(k): [float(lo[k]), None if math.isinf(hi[k]) else float(hi[k])] for k in free}
    doc = {
        "name": name,
        "kind": "trained-physics",
        "source": f"blis-jax fit (blis-jax {version}, git {git_commit() or 'unknown'})",
        "fitted": (f"blis-jax fit on {len(exps)} observed experiment(s) from {start_name or start_path}: outer loop of "
                   f"full simulations (kept the best simulated loss), inner loop adam on the {settings['schedule_model']} "
                   f"fixed-schedule latency model; fitted {', '.join(coefficient_label(k) for k in free)}; "
                   "the others as in the start file"),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": command,
        "blis_jax_version": version,
        "git_commit": git_commit(),
        "observed": {"path": observed_path, "sha256": observed_sha256, "experiments": [p.id for p in exps]},
        "start": {"path": start_path, "name": start_name, "loss_pct": _r(result.start.loss)},
        "params": [coefficient_name(k) for k in free],
        "bounds": bounds,
        "settings": settings,
        "loss": {
            "definition": LOSS_DEFINITION,
            "simulated_pct": _r(result.best.loss),
            "ttft_rmse_pct": _r(result.best.ttft_rmse),
            "e2e_rmse_pct": _r(result.best.e2e_rmse),
            "start_pct": _r(result.start.loss),
            "per_experiment": {row["id"]: {"observed_ttft_mean_ms": row["observed"]["ttft_mean_ms"],
                                           "observed_e2e_mean_ms": row["observed"]["e2e_mean_ms"], **row["fitted"]}
                               for row in experiment_rows(exps, result)},
        },
        "history": [{k: (_r(v) if isinstance(v, float) else v) for k, v in h.items()} for h in result.history],
        "simulations": result.simulations,
        "wall_s": _r(result.wall_s, 1),
    }
    if cv is not None:
        doc["cv"] = {"mode": cv.mode, "start": _loss_block(cv.start), "held_out": _loss_block(cv.fitted)}
    doc["alpha"] = alpha
    doc["beta"] = beta
    return doc


def write_coefficients(path: str | Path, doc: dict) -> None:
    atomic_write_text(path, HEADER + yaml.safe_dump(doc, sort_keys=False, width=110, allow_unicode=True))


# --------------------------------------------------------------------------- text tables


def experiment_table(exps: Sequence[Prepared], result: FitResult) -> str:
    """Markdown table: observed vs start vs fitted mean TTFT / E2E per experiment."""
    lines = [("| id | model | TTFT obs | TTFT start | TTFT fit | APE start | APE fit | E2E obs | E2E start "
              "| E2E fit | APE start | APE fit |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for i, p in enumerate(exps):
        s, f = result.start.row(i), result.best.row(i)
        lines.append(f"| {p.id} | {p.obs.model.split('/')[-1]} | {p.obs.ttft_mean_ms:.2f} | {s['ttft_mean_ms']:.2f} | "
                     f"{f['ttft_mean_ms']:.2f} | {s['ttft_ape_pct']:.1f} | {f['ttft_ape_pct']:.1f} | "
                     f"{p.obs.e2e_mean_ms:.1f} | {s['e2e_mean_ms']:.1f} | {f['e2e_mean_ms']:.1f} | "
                     f"{s['e2e_ape_pct']:.1f} | {f['e2e_ape_pct']:.1f} |")
    return "\n".join(lines) + "\n"


def loss_lines(result: FitResult, reference: dict | None = None) -> str:
    s, b = result.start, result.best
    out = [(f"loss (simulated, {len(b.ids)} experiments): start {s.loss:.3f}% (TTFT RMSE {s.ttft_rmse:.2f} + "
            f"E2E RMSE {s.e2e_rmse:.2f}) -> fitted {b.loss:.3f}% (TTFT RMSE {b.ttft_rmse:.2f} + E2E RMSE "
            f"{b.e2e_rmse:.2f}); {result.simulations} simulations in {result.wall_s:.0f} s")]
    if reference:
        out.append(f"reference: BLIS's own trained-physics predictions in the observed file score "
                   f"{reference['loss']:.2f}% on these experiments")
    return "\n".join(out) + "\n"


def coefficient_table(theta_start: np.ndarray, theta: np.ndarray, num_betas: int, free: Sequence[int]) -> str:
    lines = ["| coefficient | start | fitted | ratio |", "|---|---:|---:|---:|"]
    for k in range(NUM_ALPHA + num_betas):
        mark = " *" if k in free else ""
        ratio = f"{theta[k] / theta_start[k]:.4f}" if theta_start[k] else "-"
        lines.append(f"| {coefficient_label(k)}{mark} | {theta_start[k]:.6g} | {theta[k]:.6g} | {ratio} |")
    return "\n".join(lines) + "\n(* fitted)\n"


def cv_table(cv: CVResult) -> str:
    lines = [(f"cross-validation ({cv.mode}): each held-out experiment simulated with the coefficients fitted "
              "without it"),
             ("| held out | train loss start | train loss fit | id | TTFT APE start | TTFT APE fit | E2E APE start "
              "| E2E APE fit |"),
             "|---|---:|---:|---|---:|---:|---:|---:|"]
    for f in cv.folds:
        for j, i in enumerate(f.fitted.ids):
            s, g = f.start.row(j), f.fitted.row(j)
            lines.append(f"| {f.group.split('/')[-1]} | {f.train_start_loss:.2f} | {f.train_fitted_loss:.2f} | {i} | "
                         f"{s['ttft_ape_pct']:.1f} | {g['ttft_ape_pct']:.1f} | {s['e2e_ape_pct']:.1f} | "
                         f"{g['e2e_ape_pct']:.1f} |")
    lines.append(f"CV loss ({cv.mode}, held-out predictions): {cv.fitted.loss:.3f}% (TTFT RMSE {cv.fitted.ttft_rmse:.2f} "
                 f"+ E2E RMSE {cv.fitted.e2e_rmse:.2f}); start coefficients on the same experiments: "
                 f"{cv.start.loss:.3f}%")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- report directory


def plot_predicted_vs_observed(path: str | Path, exps: Sequence[Prepared], result: FitResult) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    models = sorted({p.obs.model for p in exps})
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(models)}
    fig, axes = plt.subplots(1, 2, figsize=(13, 6.2))
    panels = (("mean TTFT (ms)", "ttft", result.start.ttft_ms, result.best.ttft_ms, result.best.ttft_rmse),
              ("mean E2E (ms)", "e2e", result.start.e2e_ms, result.best.e2e_ms, result.best.e2e_rmse))
    for ax, (title, key, start, fitted, rmse) in zip(axes, panels):
        obs = np.array([getattr(p.obs, f"{key}_mean_ms") for p in exps])
        lo = min(obs.min(), start.min(), fitted.min()) / 1.3
        hi = max(obs.max(), start.max(), fitted.max()) * 1.3
        ax.plot([lo, hi], [lo, hi], color="black", lw=1, label="y = x")
        ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="grey", alpha=0.12,
                        label="±10 %")
        for i, p in enumerate(exps):
            c = colors[p.obs.model]
            ax.plot([obs[i], obs[i]], [start[i], fitted[i]], color=c, lw=0.8, alpha=0.5)
            ax.scatter(obs[i], start[i], facecolors="none", edgecolors=c, s=40)
            ax.scatter(obs[i], fitted[i], color=c, s=40)
            ax.annotate(p.id, (obs[i], fitted[i]), fontsize=7, xytext=(4, -3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):   # ticks at 1, 2, 5 × 10^k as plain numbers, not 3×10¹
            axis.set_major_locator(matplotlib.ticker.LogLocator(base=10.0, subs=(1.0, 2.0, 5.0)))
            axis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel(f"observed {title}")
        ax.set_ylabel(f"simulated {title}")
        ax.set_title(f"{title}: RMSE of APE {rmse:.2f} % (fitted)")
        ax.grid(True, which="both", alpha=0.25)
    handles = [plt.Line2D([], [], marker="o", ls="", color=colors[m], label=m.split("/")[-1]) for m in models]
    handles += [plt.Line2D([], [], marker="o", ls="", markerfacecolor="none", markeredgecolor="black",
                           label="start coefficients"),
                plt.Line2D([], [], marker="o", ls="", color="black", label="fitted coefficients")]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 5), fontsize=8, frameon=False)
    fig.suptitle(f"blis-jax fit: loss {result.start.loss:.2f} % → {result.best.loss:.2f} % "
                 f"({len(exps)} experiments, simulated)")
    fig.tight_layout(rect=(0, 0.07, 1, 0.96))
    with atomic_output(path, "wb") as f:
        fig.savefig(f, dpi=110, format=Path(path).suffix.lstrip(".") or "png")
    plt.close(fig)


def write_report(directory: str | Path, exps: Sequence[Prepared], result: FitResult, num_betas: int,
                 free: Sequence[int], doc: dict, cv: CVResult | None = None, reference: dict | None = None) -> list[Path]:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    report = {
        "command": doc["command"], "observed": doc["observed"], "start": doc["start"], "params": doc["params"],
        "settings": doc["settings"],
        "loss": {"start": _loss_block(result.start), "fitted": _loss_block(result.best),
                 "blis_predictions_in_file": reference},
        "coefficients": {"start": {"alpha": split(result.start.theta, num_betas)[0],
                                   "beta": split(result.start.theta, num_betas)[1]},
                         "fitted": {"alpha": doc["alpha"], "beta": doc["beta"]},
                         "beta_names": list(BLIS_BETA_NAMES[:num_betas])},
        "experiments": experiment_rows(exps, result),
        "history": doc["history"],
    }
    if cv is not None:
        report["cv"] = cv_document(cv, num_betas)
    paths = [directory / "report.json", directory / "report.md", directory / PLOT_FILE]
    atomic_write_text(paths[0], json.dumps(report, indent=1) + "\n")
    md = ["# blis-jax fit report", "", f"`{doc['command']}`", "", loss_lines(result, reference),
          "## Per experiment (mean latencies in ms, APE in %)", "", experiment_table(exps, result),
          "## Coefficients", "", coefficient_table(result.start.theta, result.theta, num_betas, free),
          "## Outer iterations", "", "| outer | simulated loss % | fixed-schedule prediction % | accepted | trust r |",
          "|---:|---:|---:|---|---:|"]
    for h in result.history:
        approx = h["fixed_schedule_loss_pct"]
        md.append(f"| {h['outer']} | {h['loss_pct']:.3f} | {'' if approx is None else f'{approx:.3f}'} | "
                  f"{h['accepted']} | {h['trust']:.3g} |")
    if cv is not None:
        md += ["", "## Cross-validation", "", cv_table(cv)]
    md += ["", f"![predicted vs observed]({PLOT_FILE})", ""]
    atomic_write_text(paths[1], "\n".join(md))
    plot_predicted_vs_observed(paths[2], exps, result)
    return paths
