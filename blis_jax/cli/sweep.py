"""`blis-jax sweep` and `blis-jax plan`: flags and command bodies (logic in `blis_jax.sweep`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TextIO

from blis_jax.cli.app import add_memory_flag
from blis_jax.errors import ConfigError
from blis_jax.io_safety import short
from blis_jax.sweep import plan as planning
from blis_jax.sweep import instance_plot, plots, sharding, table
from blis_jax.sweep.grid import Grid, load_grid, plot_spec
from blis_jax.sweep.memory import parse_bytes
from blis_jax.sweep.progress import SweepProgress
from blis_jax.sweep.runner import run_sweep

EXIT_FAILED_SCENARIOS = 1  # the table is written, but some scenario could not be simulated


def add_parsers(sub) -> None:
    """Add the `sweep` and `plan` subcommands to the CLI's subparsers."""
    sweep = sub.add_parser(
        "sweep", allow_abbrev=False, help="simulate a grid of scenarios in batched, vmapped runs",
        description="Simulate every scenario of a grid YAML (base `run` settings plus axes) in "
                    "jitted, vmapped batches; write a table (CSV, JSON) with one row per scenario and "
                    "PNG plots. See docs/SWEEPS.md.")
    sweep.add_argument("grid", metavar="GRID.yaml", help="grid file: base, axes or scenarios, plots")
    sweep.add_argument("--output-dir", default=None, metavar="DIR",
                       help="where table.csv, table.json and the plots go (default: GRID-sweep/ beside "
                            "the current directory)")
    sweep.add_argument("--plot", action="append", default=[], metavar="METRIC:X[:LINES]",
                       help="add a plot: METRIC against axis X, one line per value of axis LINES "
                            "(repeatable; default: the grid's plots, else p99 TTFT/ITL/E2E vs the first axis)")
    sweep.add_argument("--no-plots", action="store_true", help="write the table only")
    _add_batch_flags(sweep)

    plan = sub.add_parser(
        "plan", allow_abbrev=False, help="capacity search: the largest rate that meets SLO targets",
        description="Run the candidates of a search axis (default rate, largest passing value) for "
                    "the grid's scenarios in one batched sweep and report the best value that meets "
                    "the SLO targets, with the table behind it. See docs/SWEEPS.md.")
    plan.add_argument("grid", metavar="GRID.yaml", help="grid file (its axes besides the search axis "
                      "each get their own answer)")
    plan.add_argument("--slo", required=True, metavar="TARGETS",
                      help="comma list of METRIC=VALUE (<= for latencies, >= for throughputs) or "
                           "METRIC<=VALUE / METRIC>=VALUE, e.g. ttft_p99_ms=200,itl_p99_ms=50")
    plan.add_argument("--search", default="rate", metavar="AXIS[:max|min]",
                      help="axis to search and direction (default rate:max)")
    plan.add_argument("--candidates", default=None, metavar="LIST|LO:HI:N",
                      help="candidate values of the search axis (replace the grid's axis), e.g. "
                           "1,2,4,8 or 1:40:14")
    plan.add_argument("--allow-incomplete", action="store_true",
                      help="let a candidate pass even if some requests timed out, were dropped or "
                           "did not finish")
    plan.add_argument("--output-dir", default=None, metavar="DIR",
                      help="also write the table (CSV, JSON, with a meets_slo column) here")
    _add_batch_flags(plan, part=False)  # a plan needs every candidate of a combination at once


def _add_batch_flags(p: argparse.ArgumentParser, part: bool = True) -> None:
    g = p.add_argument_group("batching")
    g.add_argument("--max-batch", type=int, default=None, metavar="N",
                   help="most scenarios per batch (default: as many as fit --memory-budget on "
                        "accelerators; one per device on CPU, where vmapped lanes are slower)")
    g.add_argument("--memory-budget", default=None, metavar="SIZE",
                   help="memory a batch may use on all devices together, e.g. 8G (default: half the "
                        "free device memory; for CPU, half the available host memory)")
    g.add_argument("--devices", type=int, default=None, metavar="N",
                   help="shard the scenarios over the first N local devices (default: all)")
    if part:
        g.add_argument("--part", default=None, metavar="K/N|auto",
                       help="run only scenarios with index %% N == K (one host's share of a multi-host "
                            "sweep); auto: jax.distributed.initialize() and this process's index/count")
    g.add_argument("--no-shared-runs", action="store_true",
                   help="simulate every scenario on its own, even where a run's batch never reached "
                        "max-num-seqs and so also answers the same scenario at a larger max-num-seqs "
                        "(the answers are identical; for timing the engine alone)")
    g.add_argument("--progress", action="store_true",
                   help="progress lines on stderr even when it is not a terminal")
    add_memory_flag(g)
    g.add_argument("--log", default="warn", metavar="LEVEL",
                   choices=("trace", "debug", "info", "warn", "warning", "error", "fatal", "panic"),
                   help="stderr verbosity (default warn)")


def _batch_options(args, stderr: TextIO) -> dict:
    sharding.host_devices_per_core()  # a fresh process only: before JAX starts its backends
    if args.max_batch is not None and args.max_batch < 1:
        raise ConfigError(f"--max-batch {args.max_batch}: must be >= 1")
    budget = parse_bytes(args.memory_budget) if args.memory_budget is not None else None
    devices = None
    part = _parse_part(getattr(args, "part", None))
    if args.devices is not None:
        import jax

        available = jax.local_devices()
        if not 1 <= args.devices <= len(available):
            raise ConfigError(f"--devices {args.devices}: must be between 1 and {len(available)} "
                              "(the local devices)")
        devices = available[:args.devices]
    tty = bool(getattr(stderr, "isatty", lambda: False)())
    progress = SweepProgress(stderr, 0, tty=tty, prefix=f"blis-jax {args.command}") if (tty or args.progress) else None
    return {"max_batch": args.max_batch, "memory_budget": budget, "devices": devices, "progress": progress,
            "part": part, "shared_runs": not args.no_shared_runs}


def _parse_part(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    if text == "auto":
        import jax

        try:
            jax.distributed.initialize()  # cluster settings from the environment (SLURM, etc.)
        except Exception as e:  # noqa: BLE001 - jax raises ValueError/RuntimeError by cluster type
            del e  # jax's text is long and about its internals
            raise ConfigError("--part auto: jax.distributed.initialize() failed (no multi-host environment found); "
                              "run it under SLURM or another JAX cluster, or give K/N such as 0/4") from None
        return jax.process_index(), jax.process_count()
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        k, n = -1, 0
    if not (n >= 1 and 0 <= k < n):
        raise ConfigError(f"--part {short(text)}: give K/N with 0 <= K < N (e.g. 0/4), or auto")
    return k, n


def _output_dir(args, grid_path: str) -> Path:
    out = Path(args.output_dir) if args.output_dir else Path(f"{Path(grid_path).stem}-sweep")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--output-dir {out}: cannot create it ({e.strerror or e})") from None
    return out


def _suffix(part) -> str:
    return f"-part{part[0]}of{part[1]}" if part else ""


def _run(grid: Grid, diag, options: dict) -> table.SweepTable:
    progress = options["progress"]
    try:
        return run_sweep(grid, diag=diag, **options)
    finally:
        if progress is not None:
            progress.close()


def cmd_sweep(args, stdout: TextIO, stderr: TextIO, diag) -> int:
    grid = load_grid(args.grid)
    specs = list(grid.plots)
    for text in args.plot:
        parts = text.split(":")
        if len(parts) not in (2, 3):
            raise ConfigError(f"--plot {text!r}: give METRIC:X or METRIC:X:LINES, e.g. ttft_p99_ms:rate:max-num-seqs")
        specs.append(plot_spec(parts[0], parts[1], parts[2] if len(parts) == 3 else None, grid.axes,
                               f"--plot {text}"))
    options = _batch_options(args, stderr)
    out_dir = _output_dir(args, args.grid)
    result = _run(grid, diag, options)
    suffix = _suffix(options["part"])
    written = [out_dir / f"table{suffix}.csv", out_dir / f"table{suffix}.json"]
    table.write_csv(written[0], result)
    table.write_json(written[1], result)
    if not args.no_plots and options["part"] is None:  # a part's rows are not the whole picture
        specs = specs or plots.default_plots(result)
        written += plots.write_plots(result, specs, out_dir, title_prefix=f"{Path(args.grid).stem}: ")
        # autoscaled scenarios: their instance counts over time (nothing written for other grids)
        written += instance_plot.write_sweep_instance_counts(result, out_dir, title_prefix=f"{Path(args.grid).stem}: ")
    stdout.write(table.format_text(result))
    stdout.write("".join(f"wrote {p}\n" for p in written))
    stdout.flush()
    return _report_failures(result, diag)


def _report_failures(result: table.SweepTable, diag) -> int:
    failed = result.failed()
    if not failed:
        return 0
    ids = ", ".join(str(r[table.SCENARIO]) for r in failed[:10]) + (" ..." if len(failed) > 10 else "")
    diag.warn(f"{len(failed)} scenario(s) could not be simulated (engine result code in the `result` column; "
              f"their metrics are empty): {ids}. Please report this with the grid file")
    return EXIT_FAILED_SCENARIOS


def cmd_plan(args, stdout: TextIO, stderr: TextIO, diag) -> int:
    targets = planning.parse_slo(args.slo)
    axis, direction = planning.parse_search(args.search)
    grid = load_grid(args.grid)
    if args.candidates is not None:
        grid = grid.with_axis(axis, planning.parse_candidates(args.candidates))
    elif axis not in grid.axes:
        raise ConfigError(f"--search {axis}: the grid has no {axis} axis; add one or give --candidates")
    options = _batch_options(args, stderr)
    result = _run(grid, diag, options)
    evaluated, answers = planning.evaluate(result, axis, direction, targets,
                                           require_complete=not args.allow_incomplete)
    metrics = tuple(dict.fromkeys([t.metric for t in targets] + ["completed_requests", "injected_requests"]))
    stdout.write(table.format_text(evaluated, metrics=(*metrics, planning.MEETS)))
    stdout.write("\n")
    stdout.write("".join(planning.describe(a, axis, direction, targets) + "\n" for a in answers))
    if args.output_dir:
        out_dir = _output_dir(args, args.grid)
        table.write_csv(out_dir / "plan.csv", evaluated)
        table.write_json(out_dir / "plan.json", evaluated)
        stdout.write(f"wrote {out_dir / 'plan.csv'}\nwrote {out_dir / 'plan.json'}\n")
    stdout.flush()
    return _report_failures(result, diag)
