"""Accuracy against real vLLM servers, request by request: replay every real trace under
../shared/reference/observed/requests/ with each coefficient file and compare.

    python benchmarks/accuracy.py                                   # every fits/*.yaml
    python benchmarks/accuracy.py --coefficients fits/trained-physics-iter29.yaml
    python benchmarks/accuracy.py --prefix none --skip-first-s 60   # other treatments
    python benchmarks/accuracy.py --json acc.json                   # every figure as JSON

Each run is replayed as `blis-jax replay <case.json replay_args> --coefficients FILE` resolves
it (the same scenario and engine), with the prompts the real server cached as prefix groups
(--prefix, see blis_jax/fit/real_traces.py and docs/ACCURACY.md). Per coefficient file it prints,
per run and load stage, observed → simulated mean / p50 / p90 / p99 of TTFT and E2E (ms) and the
per-request MAPE (%), the figures `blis-jax calibrate` reports; then the loss of issue #22 over
the runs that were not overloaded: RMSE of APE(mean TTFT) + RMSE of APE(mean E2E), in %.
All (run, coefficient file) replays run as lanes of the sweep's batch runner, one per core.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from blis_jax.errors import ConfigError  # noqa: E402
from blis_jax.fit import real_traces  # noqa: E402
from blis_jax.sweep import sharding  # noqa: E402

RUNS = ROOT.parent / "shared" / "reference" / "observed" / "requests"
WARM_UP_S = 60.0  # the summary also scores each replay without its first minute


def _cell(row: dict, metric: str, stat: str) -> str:
    key = f"{metric}_{stat}"
    if f"{key}_obs_ms" not in row:
        return "–"
    obs, sim = row[f"{key}_obs_ms"], row[f"{key}_sim_ms"]
    digits = 1 if max(obs, sim) < 1000 else 0
    return f"{obs:.{digits}f} → {sim:.{digits}f}"


def _pct(value) -> str:
    return "–" if value is None else f"{value:.1f}"


def _short(run: str) -> str:
    return run.split("-tp1-")[-1] if "-tp1-" in run else run


def format_table(name: str, scores: dict[str, dict], overloaded: dict[str, bool]) -> str:
    head = ("| run | stage | ok observed / completed simulated / paired | TTFT mean | p50 | p90 | p99 | TTFT MAPE | "
            "E2E mean | p50 | p90 | p99 | E2E MAPE |")
    lines = [f"#### {name}", "", "Observed → simulated over the paired requests, ms; MAPE per request, %.", "", head,
             "|" + "---|" * 2 + "---:|" * 11]
    for run, rows in scores.items():
        label = _short(run) + (" (overloaded)" if overloaded[run] else "")
        for stage, row in rows.items():
            done = f" / {row['sim_completed']}" if "sim_completed" in row else ""
            cells = [label if stage == real_traces.ALL else "", stage, f"{row['observed_ok']}{done} / {row['pairs']}"]
            for metric in ("ttft", "e2e"):
                cells += [_cell(row, metric, s) for s in real_traces.STATS]
                cells.append(_pct(row.get(f"{metric}_mape_pct")))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def export(folders, coefficients: Path, args) -> int:
    out = Path(args.export_traces)
    out.mkdir(parents=True, exist_ok=True)
    for folder in folders:
        run = real_traces.load_run(folder, coefficients, prefix_mode=args.prefix)
        yaml_path, csv_path = real_traces.export_trace(run, out / run.name)
        flags = list(run.case["replay_args"])
        flags[flags.index("--trace-header") + 1] = str(yaml_path)
        flags[flags.index("--trace-data") + 1] = str(csv_path)
        results = out / f"{run.name}.results.json"
        flags[flags.index("--results-path") + 1] = str(results)
        print(f"blis-jax replay {' '.join(flags)} --coefficients {coefficients}")
        print(f"blis-jax calibrate --trace-header {yaml_path} --trace-data {csv_path} --sim-results {results} "
              f"--report {out / run.name}.calibration.json")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--coefficients", nargs="+", default=None,
                        help="coefficient files (default: every fits/*.yaml)")
    parser.add_argument("--runs", default=str(RUNS), help="folder of real runs (default: %(default)s)")
    parser.add_argument("--only", nargs="+", default=None, help="run folders to keep (substring match)")
    parser.add_argument("--prefix", choices=real_traces.PREFIX_MODES, default="prompt",
                        help="prefix groups for the prompts the server cached (default: %(default)s)")
    parser.add_argument("--skip-first-s", type=float, default=0.0,
                        help="leave out requests sent in the first S seconds of each run (default: 0)")
    parser.add_argument("--json", default=None, help="also write every figure to this JSON file")
    parser.add_argument("--export-traces", metavar="DIR", default=None,
                        help="only write each run as simulated (prefix groups added, observed times kept) to "
                             "DIR/<run>.yaml/.csv for `blis-jax replay` + `calibrate`, and print the commands")
    args = parser.parse_args(argv)

    sharding.host_devices_per_core()  # one lane per core
    from blis_jax.sweep.batch import run_lanes  # after the device setting

    coefficient_files = [Path(p) for p in (args.coefficients or sorted(str(p) for p in (ROOT / "fits").glob("*.yaml")))]
    folders = real_traces.run_folders(args.runs)
    if args.only:
        folders = [f for f in folders if any(s in f.name for s in args.only)]
    if args.export_traces:
        return export(folders, coefficient_files[0], args)
    start = time.perf_counter()
    jobs = [(c, real_traces.load_run(f, c, prefix_mode=args.prefix)) for c in coefficient_files for f in folders]
    lanes = [real_traces.lane(run) for _, run in jobs]

    def reduce(i, out):
        if out.result != 0:
            return None
        return real_traces.sim_results(out, jobs[i][1].requests)

    results = run_lanes(lanes, reduce)
    wall = time.perf_counter() - start

    report: dict = {"prefix": args.prefix, "skip_first_s": args.skip_first_s, "wall_s": wall, "coefficients": {}}
    summary = [f"| coefficients | TTFT RMSE | E2E RMSE | loss | TTFT MAPE | E2E MAPE | loss without the first "
               f"{WARM_UP_S:g} s |", "|---|---:|---:|---:|---:|---:|---:|"]
    for coeffs in coefficient_files:
        scores, overloaded, later = {}, {}, {}
        for (c, run), sim in zip(jobs, results):
            if c != coeffs:
                continue
            if sim is None:
                print(f"{coeffs.name} / {run.name}: the simulation stopped early (buffer overflow); not scored",
                      file=sys.stderr)
                continue
            scores[run.name] = real_traces.score_run(run, sim, skip_first_s=args.skip_first_s)
            overloaded[run.name] = run.overloaded
            # the same replay scored without its first minute (cold start, prefix-cache fill)
            later[run.name] = real_traces.score_run(run, sim, skip_first_s=max(args.skip_first_s, WARM_UP_S))
        loss = real_traces.real_trace_loss([rows[real_traces.ALL] for run, rows in scores.items()
                                            if not overloaded[run]])
        loss_later = real_traces.real_trace_loss([rows[real_traces.ALL] for run, rows in later.items()
                                                  if not overloaded[run]])
        report["coefficients"][coeffs.stem] = {"runs": scores, "loss": loss,
                                               f"loss_without_first_{WARM_UP_S:g}_s": loss_later}
        print(format_table(coeffs.stem, scores, overloaded))
        steps = [f"{_short(run)} {step['obs_ms']:.1f} → {step['sim_ms']:.1f}" for run, rows in scores.items()
                 if not overloaded[run] and (step := rows[real_traces.ALL]["ttft_cache_fill_step"]) is not None]
        print("Cache-fill step (mean TTFT of requests 50-99 minus 100-149, ms, observed → simulated): "
              + "; ".join(steps) + "\n")
        summary.append(f"| {coeffs.stem} | {loss['ttft_rmse']:.2f} | {loss['e2e_rmse']:.2f} | "
                       f"**{loss['loss']:.2f} %** | "
                       f"{loss['ttft_mape']:.1f} | {loss['e2e_mape']:.1f} | {loss_later['loss']:.2f} % |")
    print(f"#### Loss over the {loss['n']} runs that were not overloaded (%; MAPE: mean over those runs)\n")
    print("\n".join(summary) + "\n")
    print(f"{len(jobs)} replays ({sum(len(r.requests) for _, r in jobs)} requests), prefix {args.prefix}, "
          f"skip first {args.skip_first_s:g} s: {wall:.1f} s wall, compilation included")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as e:  # bad input: one line, no traceback
        print(f"accuracy.py: error: {e}", file=sys.stderr)
        sys.exit(2)
