"""`blis-jax sensitivity`: `run`'s scenario flags plus what to differentiate (the derivatives
themselves are in blis_jax/fit/sensitivity.py)."""

from __future__ import annotations

import json
import math
from typing import TextIO

from blis_jax.cli import app
from blis_jax.cli.scenario_flags import FLAG_OF_FIELD, scenario_config
from blis_jax.errors import ConfigError
from blis_jax.fit import sensitivity as S
from blis_jax.io_safety import atomic_output
from blis_jax.naming import naming
from blis_jax.scenario import ResolvedScenario, resolve


def add_parser(sub) -> None:
    p = sub.add_parser(
        "sensitivity", allow_abbrev=False,
        help="derivatives of a run's metrics with respect to latency coefficients and settings",
        description="Simulate the scenario of `blis-jax run` (same flags) and print the derivative and "
                    "elasticity (d ln metric / d ln input) of each metric with respect to each input. "
                    "Coefficients: forward-mode differentiation of the run with its schedule held fixed. "
                    "--rate: central difference of whole simulations; integer settings (total-kv-blocks, "
                    "max-num-seqs, max-num-batched-tokens): one-sided difference of whole simulations.")
    app._add_run_flags(p)
    app._add_shared_flags(p)
    g = p.add_argument_group("sensitivity")
    g.add_argument("--metrics", default=",".join(S.DEFAULT_METRICS), metavar="NAME,...",
                   help=f"metrics to differentiate: {', '.join(S.METRICS)} (default "
                        f"{','.join(S.DEFAULT_METRICS)}; latencies in ms, throughput in output tokens/s)")
    g.add_argument("--wrt", default="alpha,beta", metavar="NAME,...",
                   help="inputs: alpha, beta (every coefficient of the group), alpha0..alpha3, beta0..beta10 or "
                        "BLIS's names b1a..bEP, and the settings rate, total-kv-blocks, max-num-seqs, "
                        "max-num-batched-tokens (default alpha,beta)")
    g.add_argument("--check", action="store_true",
                   help="also difference whole re-simulations for each coefficient (two runs each) and print "
                        "the relative difference per entry")
    g.add_argument("--fd-step", type=float, default=S.DEFAULT_STEP, metavar="REL",
                   help=f"relative finite-difference step (default {S.DEFAULT_STEP:g}): rate ×(1 ± REL); integer "
                        "settings +max(1, round(REL·N)); --check coefficients ± REL·value (alpha by whole µs)")
    g.add_argument("--output", default=None, metavar="FILE.json", help="also write the table as JSON")


def _warn_once(diag):
    """diag.warn, each message once: the re-resolved scenarios of the whole-run differences
    repeat the base scenario's warnings."""
    seen: set[str] = set()

    def warn(message: str) -> None:
        if message not in seen:
            seen.add(message)
            diag.warn(message)
    return warn


def resolve_flags(args, warn) -> ResolvedScenario:
    """The scenario of `run`'s flags, exactly as `blis-jax run` resolves it."""
    with naming(FLAG_OF_FIELD):
        return resolve(scenario_config(args, seed_given=app._seed_given(args)), warn=warn)


def _validate(args) -> tuple[tuple[str, ...], float]:
    metrics = S.parse_metrics(args.metrics)
    if not (math.isfinite(args.fd_step) and 0 < args.fd_step < 1):
        raise ConfigError(f"--fd-step {args.fd_step:g}: must be a fraction in (0, 1), e.g. 0.05")
    if args.num_instances != 1:
        raise ConfigError(f"--num-instances {args.num_instances}: sensitivity differentiates one instance; "
                          "use --num-instances 1")
    if getattr(args, "kv_offload_config", None) is not None:   # its traced simulation has no offload chain
        raise ConfigError("--kv-offload-config: sensitivity does not simulate the multi-tier KV offload chain; "
                          "drop it (use `blis-jax run` for this scenario)")
    app._check_output_paths(args)
    app._check_output_file("--output", args.output)
    return metrics, float(args.fd_step)


def cmd_sensitivity(args, stdout: TextIO, stderr: TextIO, diag) -> int:
    metrics, step = _validate(args)
    warn = _warn_once(diag)
    scenario = resolve_flags(args, warn)
    wrt = S.parse_wrt(args.wrt, scenario.latency_model.num_betas)   # the beta count decides the names
    if "rate" in wrt and args.workload_spec:
        raise ConfigError("--wrt rate: with --workload-spec the arrival rate is the spec's aggregate_rate, not "
                          "--rate; drop rate from --wrt (or use --workload/--rate)")
    S.check_model(scenario.latency_model, wrt)        # before the first simulation
    tty = bool(getattr(stderr, "isatty", lambda: False)())

    def say(line: str) -> None:
        if tty or args.progress:
            stderr.write(f"blis-jax sensitivity: {line}\n")
            stderr.flush()

    say(f"simulating the base run ({len(scenario.requests)} requests)")
    base = S.simulate(scenario)
    with naming(FLAG_OF_FIELD):   # a re-resolved scenario's errors name the flags
        table = S.sensitivities(scenario, metrics, wrt, vary=S.vary_config(scenario.config, warn=warn),
                                check=args.check, step=step, base=base, progress=say)
    _write_run_outputs(args, base)
    header = (f"sensitivities: {scenario.model_id}, {scenario.hardware}, TP {scenario.tp}, {scenario.latency_kind}; "
              f"{len(base.requests)} requests, {base.metrics['completed_requests']} completed\n\n")
    stdout.write(header + table.format())
    if args.output:
        doc = {"scenario": {"model": scenario.model_id, "hardware": scenario.hardware, "tp": scenario.tp,
                            "latency_model": scenario.latency_kind, "requests": len(base.requests),
                            "completed_requests": base.metrics["completed_requests"]},
               **table.to_dict()}
        with atomic_output(args.output, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=2)
            fh.write("\n")
        stdout.write(f"sensitivities: {args.output}\n")
    stdout.flush()
    return 0


def _write_run_outputs(args, base: S.Simulated) -> None:
    """--metrics-path, --results-path and --trace-output of the base run, as `run` writes them."""
    from blis_jax.output import write_metrics_file, write_results_file
    from blis_jax.workload.tracev2 import TraceHeader, write_trace

    if args.metrics_path:
        write_metrics_file(args.metrics_path, base.out, base.requests)
    if args.results_path:
        write_results_file(args.results_path, base.out, base.requests)
    if args.trace_output:
        write_trace(args.trace_output, TraceHeader(mode="generated", workload_seed=int(args.seed)), base.requests, base.out)
