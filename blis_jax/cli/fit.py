"""`blis-jax fit`: flags, validation and outputs (the fitting itself is in blis_jax/fit/)."""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import math
import shlex
import threading
from pathlib import Path
from typing import TextIO

from blis_jax.config.coefficients import BLIS_FIT, load_coefficients
from blis_jax.errors import ConfigError

LOAD_GENERATORS = ("blis", "open-loop")   # = fit.LOAD_GENERATORS (not imported: keeps the CLI free of jax)
OUTPUT_LENGTHS = ("configured", "observed")   # = fit.OUTPUT_LENGTHS

LOG_LEVELS = ("trace", "debug", "info", "warn", "warning", "error", "fatal", "panic")
DEFAULTS = {"outer": 4, "steps": 1000, "lr": 0.05, "trust": 0.5, "patience": 2, "schedule_model": "local",
            "load_generator": "blis", "output_lengths": "configured"}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "fit", allow_abbrev=False, help="fit trained-physics coefficients to observed mean latencies",
        description="Fit trained-physics coefficients to observed mean TTFT / E2E (trainval15.json format) with "
                    "BLIS's loss: RMSE of APE(mean TTFT) + RMSE of APE(mean E2E) over experiments, in percent. "
                    "Outer loop: simulate every experiment at the current coefficients; inner loop: adam on the "
                    "loss with the simulated schedules held fixed; the best *simulated* loss is kept. Progress "
                    "goes to stderr, the tables to stdout.")
    g = p.add_argument_group("inputs")
    g.add_argument("--observed", default=None, metavar="FILE",
                   help="observed experiments JSON (../shared/reference/observed/trainval15.json); this and/or "
                        "--real-traces")
    g.add_argument("--real-traces", default=None, metavar="DIR",
                   help="also fit on the real request traces in DIR (../shared/reference/observed/requests: one "
                        "folder per run with case.json, trace.yaml, trace.csv), each replayed as it arrived and "
                        "scored on its run means; overloaded runs are left out, and a --observed experiment that "
                        "is the same run (case.json summary_reference) is replaced by its trace")
    g.add_argument("--real-prefix", choices=("prompt", "system", "none"), default="prompt",
                   help="prefix groups for the prompts the real server cached (default: prompt; see "
                        "docs/ACCURACY.md)")
    g.add_argument("--start", default=str(BLIS_FIT), metavar="FILE|NAME",
                   help="start coefficients, a coefficient file with 10 or 11 betas or a shipped set by name "
                        "(default: BLIS's, fits/trained-physics-iter29.yaml)")
    g.add_argument("--experiments", default=None, metavar="ID,...",
                   help="fit on these experiment ids only (default: all in --observed)")
    g.add_argument("--load-generator", choices=LOAD_GENERATORS, default=DEFAULTS["load_generator"],
                   help="how the experiments' inference-perf multi-turn chat is simulated: blis (default, BLIS's "
                        "closed-loop sessions: a user's next round arrives a think time after its previous one "
                        "completes) or open-loop (inference-perf's generator: Poisson arrivals at the stage rate "
                        "whatever the completions; inference_perf.multi_turn_mode: open-loop)")
    g.add_argument("--output-lengths", choices=OUTPUT_LENGTHS, default=DEFAULTS["output_lengths"],
                   help="tokens each simulated request generates: configured (default, the workload's output_len, "
                        "as BLIS simulates it) or observed (the experiment's observed output_len_mean: real runs "
                        "stop short of the configured length, Llama-2-7B by ~20 %%)")
    g = p.add_argument_group("what to fit")
    g.add_argument("--params", default=None, metavar="NAME,...",
                   help="coefficients to fit: alpha0..alpha3, beta0..beta10 (slice index of the beta list) or "
                        "BLIS names b1a,b2a,b3,b4,b5,b6,b7,b8,b1b,b2b,bEP (beta2 = b3 = weight loading), or 'all' "
                        "(default: every coefficient that is non-zero in --start)")
    g.add_argument("--bounds", default=None, metavar="NAME=LO:HI,...",
                   help="bounds of fitted coefficients, either side may be empty (default [0, inf)), "
                        "e.g. b3=0.5:3,alpha0=:20000")
    g = p.add_argument_group("optimizer")
    g.add_argument("--outer", type=int, default=DEFAULTS["outer"], metavar="N",
                   help=f"outer iterations: proposals re-simulated on every experiment (default "
                        f"{DEFAULTS['outer']}; 0 = only evaluate --start)")
    g.add_argument("--steps", type=int, default=DEFAULTS["steps"], metavar="K",
                   help=f"adam steps per outer iteration on the fixed-schedule loss (default {DEFAULTS['steps']})")
    g.add_argument("--lr", type=float, default=DEFAULTS["lr"],
                   help=f"adam learning rate in the transformed space, cosine-decayed (default {DEFAULTS['lr']})")
    g.add_argument("--trust", type=float, default=DEFAULTS["trust"], metavar="R",
                   help="trust region: a coefficient moves at most by a factor e^R per outer iteration (above "
                        f"its lower bound); halved after a rejected proposal, doubled again (up to R) after a step that "
                        f"realises 3/4 of its predicted improvement (default {DEFAULTS['trust']})")
    g.add_argument("--patience", type=int, default=DEFAULTS["patience"], metavar="N",
                   help=f"stop after N proposals in a row without a better simulated loss (default "
                        f"{DEFAULTS['patience']})")
    g.add_argument("--schedule-model", choices=("local", "chained"), default=DEFAULTS["schedule_model"],
                   help="fixed-schedule latency model of the inner loop: local (each request's wait local to its "
                        "own window, default) or chained (blis_jax.fit.schedule.predict_latencies)")
    g.add_argument("--cv", choices=("loeo", "lomo"), default=None,
                   help="also cross-validate: leave one experiment out / leave one model out (one fit per fold, "
                        "the held-out experiments simulated with the fold's coefficients)")
    g.add_argument("--cv-jobs", type=int, default=1, metavar="N",
                   help="run the --cv folds in N worker processes, alongside the main fit in this one (default 1: "
                        "one after another, after the main fit); the same figures. A fit simulates one experiment at a "
                        "time on one core, so N up to the number of cores runs the folds side by side")
    g = p.add_argument_group("outputs")
    g.add_argument("--output", default=None, metavar="FILE",
                   help="write the fitted coefficients as a fits/*.yaml file (for run --coefficients)")
    g.add_argument("--name", default=None, help="name in the coefficient file (default: the --output file stem)")
    g.add_argument("--report", default=None, metavar="DIR",
                   help="write report.json, report.md and predicted_vs_observed.png to DIR (created)")
    g.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--log", default="warn", choices=LOG_LEVELS, metavar="LEVEL",
                   help="stderr verbosity: warnings are printed at warn and below (default warn)")


def _command_line(args) -> str:
    """The fit's command line, rebuilt from the parsed flags (every value explicit)."""
    parts = ["blis-jax", "fit"]
    for flag, value in (("--observed", args.observed), ("--real-traces", args.real_traces)):
        if value is not None:
            parts += [flag, value]
    if args.real_traces is not None:
        parts += ["--real-prefix", args.real_prefix]
    parts += ["--start", args.start]
    for flag, value in (("--experiments", args.experiments), ("--params", args.params), ("--bounds", args.bounds)):
        if value is not None:
            parts += [flag, value]
    parts += ["--load-generator", args.load_generator, "--output-lengths", args.output_lengths]
    parts += ["--outer", str(args.outer), "--steps", str(args.steps), "--lr", repr(args.lr), "--trust",
              repr(args.trust), "--patience", str(args.patience), "--schedule-model", args.schedule_model]
    if args.cv is not None:
        parts += ["--cv", args.cv, "--cv-jobs", str(args.cv_jobs)]
    for flag, value in (("--output", args.output), ("--name", args.name), ("--report", args.report)):
        if value is not None:
            parts += [flag, value]
    return shlex.join(parts)


def _validate(args) -> None:
    if args.observed is None and args.real_traces is None:
        raise ConfigError("no observations: give --observed FILE (trainval15.json) and/or --real-traces DIR "
                          "(../shared/reference/observed/requests)")
    if args.experiments is not None and args.observed is None:
        raise ConfigError("--experiments selects --observed experiments; give --observed too or drop it")
    if args.outer < 0:
        raise ConfigError(f"--outer {args.outer}: must be >= 0 (0 only evaluates --start)")
    if args.steps < 1:
        raise ConfigError(f"--steps {args.steps}: must be >= 1")
    if args.patience < 1:
        raise ConfigError(f"--patience {args.patience}: must be >= 1")
    if args.cv_jobs < 1:
        raise ConfigError(f"--cv-jobs {args.cv_jobs}: must be >= 1")
    if args.cv_jobs > 1 and args.cv is None:
        raise ConfigError(f"--cv-jobs {args.cv_jobs}: runs cross-validation folds in parallel; give --cv loeo|lomo "
                          "too or drop it")
    for flag, value in (("--lr", args.lr), ("--trust", args.trust)):
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{flag} {value:g}: must be a number > 0")
    if args.output is not None:
        if not args.output:
            raise ConfigError("--output: empty path; give a file name or omit the flag")
        parent = Path(args.output).parent
        if not parent.is_dir():
            raise ConfigError(f"--output {args.output}: directory {str(parent)!r} does not exist; create it first")
    if args.report is not None:
        report = Path(args.report)
        if not args.report or (report.exists() and not report.is_dir()):
            raise ConfigError(f"--report {args.report!r}: must be a directory path")
        if not report.parent.is_dir():
            raise ConfigError(f"--report {args.report}: directory {str(report.parent)!r} does not exist; "
                              "create it first")


def _real_runs(real_traces_dir, real_prefix, start_path: Path, warn) -> list:
    """The real runs of --real-traces that can be fitted (not overloaded), resolved with the
    start coefficients."""
    from blis_jax.fit import real_traces

    if real_traces_dir is None:
        return []
    runs = [real_traces.load_run(f, start_path, prefix_mode=real_prefix, warn=warn)
            for f in real_traces.run_folders(real_traces_dir)]
    return [r for r in runs if not r.overloaded]


def _observations_sha256(observed, real: list) -> str:
    """The --observed file's sha256, or with real traces that of the file's hash and every
    fitted trace.csv together."""
    if not real:
        return observed.sha256
    h = hashlib.sha256((observed.sha256 if observed is not None else "").encode())
    for r in real:
        h.update((r.folder / "trace.csv").read_bytes())
    return h.hexdigest()


def _observations(observed_path, ids, real_traces_dir, real_prefix, start, warn):
    """(the --observed file or None, its selected experiments, the fittable real runs); a real
    run replaces the --observed experiment of the same run."""
    from blis_jax.fit.observed import load_observed

    observed = load_observed(observed_path) if observed_path is not None else None
    selected = observed.select(ids) if observed is not None else []
    real = _real_runs(real_traces_dir, real_prefix, Path(start), warn)
    if real:
        from blis_jax.fit import real_traces

        replaced = {real_traces.summary_id(r) for r in real}
        dropped = [e.id for e in selected if e.id in replaced]
        selected = [e for e in selected if e.id not in replaced]
        if dropped:
            warn(f"--real-traces replaces --observed experiment(s) {', '.join(dropped)} (the same runs)")
    return observed, selected, real


def _prepared(selected, real, theta0, num_betas, load_generator, output_lengths, warn) -> list:
    from blis_jax.fit import fit as F
    from blis_jax.fit import real_traces

    exps = F.prepare(selected, theta0, num_betas, load_generator=load_generator, output_lengths=output_lengths,
                     warn=warn)
    return exps + [real_traces.fit_observation(r) for r in real]


def _ignore(message: str) -> None:
    """Warnings in a cross-validation worker: the main process has printed them already."""


def _rebuild_experiments(observed_path, ids, real_traces_dir, real_prefix, start, load_generator,
                         output_lengths) -> list:
    """The fit's experiments prepared again in a --cv-jobs worker process (picklable by name)."""
    from blis_jax.fit import fit as F

    _, selected, real = _observations(observed_path, ids, real_traces_dir, real_prefix, start, _ignore)
    theta0, num_betas = F.start_vector(load_coefficients(Path(start)))
    return _prepared(selected, real, theta0, num_betas, load_generator, output_lengths, _ignore)


def cmd_fit(args, stdout: TextIO, stderr: TextIO, diag) -> int:
    from blis_jax import __version__
    from blis_jax.fit import fit as F
    from blis_jax.fit import report as R
    from blis_jax.fit.observed import prediction_loss

    _validate(args)
    ids = None if args.experiments is None else [i.strip() for i in args.experiments.split(",") if i.strip()]
    observed, selected, real = _observations(args.observed, ids, args.real_traces, args.real_prefix, args.start,
                                             diag.warn)
    start_path = Path(args.start)
    coeffs = load_coefficients(start_path)
    theta0, num_betas = F.start_vector(coeffs)
    free = F.parse_params(args.params, theta0, num_betas)
    lo, hi = F.parse_bounds(args.bounds, free, num_betas)
    if args.cv:
        F.cv_groups(selected, args.cv)          # fail early: fewer than 2 groups to hold out
    settings = F.FitSettings(free=tuple(free), lo=lo, hi=hi, outer=args.outer, steps=args.steps, lr=args.lr,
                             trust=args.trust, patience=args.patience, schedule_model=args.schedule_model)
    F.check_settings(theta0, settings)

    def say(line: str) -> None:
        if not args.quiet:
            stderr.write(f"blis-jax: {line}\n")
            stderr.flush()

    say(f"{len(selected)} experiment(s) and {len(real)} real trace(s), fitting "
        f"{', '.join(F.coefficient_label(k) for k in free)} "
        f"from {start_path}, load generator {args.load_generator}, {args.output_lengths} output lengths")
    exps = _prepared(selected, real, theta0, num_betas, args.load_generator, args.output_lengths, diag.warn)
    sim = F.Simulator(progress=say, keep=theta0)
    if args.cv and args.cv_jobs > 1:
        # the folds run in worker processes; a thread here only waits for them while the main fit runs
        rebuild = functools.partial(_rebuild_experiments, args.observed, ids, args.real_traces, args.real_prefix,
                                    args.start, args.load_generator, args.output_lengths)
        stop = threading.Event()
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as waiter:
            pending = waiter.submit(F.cross_validate, exps, theta0, settings, args.cv, sim,
                                    progress=None if args.quiet else say, jobs=args.cv_jobs, rebuild=rebuild,
                                    stop=stop)
            try:
                result = F.fit(exps, theta0, settings, sim, progress=say)
            except BaseException:
                stop.set()          # end the folds' workers rather than wait for them
                raise
            cv = pending.result()
    else:
        result = F.fit(exps, theta0, settings, sim, progress=say)
        cv = F.cross_validate(exps, theta0, settings, args.cv, sim, progress=say) if args.cv else None

    reference = None
    if all("blis_trained_physics" in p.obs.predictions for p in exps):
        reference = prediction_loss([p.obs for p in exps], "blis_trained_physics")
    command = _command_line(args)
    name = args.name or (Path(args.output).stem if args.output else "blis-jax-fit")
    doc = R.coefficient_document(
        name=name, result=result, exps=exps, num_betas=num_betas,
        observed_path=", ".join(str(p) for p in (args.observed, args.real_traces) if p is not None),
        observed_sha256=_observations_sha256(observed, real), start_path=str(start_path),
        start_name=coeffs.provenance.get("name"),
        free=free, lo=lo, hi=hi, command=command, version=__version__, cv=cv,
        settings={"outer": args.outer, "steps": args.steps, "lr": args.lr, "trust": args.trust,
                  "patience": args.patience, "schedule_model": args.schedule_model,
                  "load_generator": args.load_generator, "output_lengths": args.output_lengths})
    if args.output:
        R.write_coefficients(args.output, doc)
        load_coefficients(args.output)      # what we wrote must load
    if args.report:
        R.write_report(args.report, exps, result, num_betas, free, doc, cv, reference)

    stdout.write(R.experiment_table(exps, result))
    stdout.write(R.loss_lines(result, reference))
    stdout.write(R.coefficient_table(result.start.theta, result.theta, num_betas, free))
    if cv is not None:
        stdout.write(R.cv_table(cv))
    if args.output:
        stdout.write(f"coefficients: {args.output} (blis-jax run --coefficients {args.output})\n")
    if args.report:
        stdout.write(f"report: {args.report}/report.md, {args.report}/{R.PLOT_FILE}\n")
    stdout.flush()
    return 0
