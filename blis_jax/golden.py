"""BLIS's golden experiments: 15 inference-perf workloads on H100 × {trained-physics, roofline}.

Each experiment (BLIS `testdata/trained_physics_iter29.json`, `roofline_goldendataset.json`)
names a model, TP, KV blocks, batch limits and a workload spec with multi-turn chat, and BLIS's
resulting metrics. `scenario_config` turns an experiment into the `ScenarioConfig` that
`blis-jax run` builds from `run_flags` (the equivalent command line); `run_experiments` runs many
of them (batched where their shapes allow) through the scenario layer `run` uses and returns the
`run` metrics block of each.

Acceptance: completed requests and token totals equal BLIS's; TTFT / E2E / ITL means and
p90 / p99 within 0.1 %. The workloads come from BLIS's own Go streams (blis-rng.md), so the
session start times are BLIS's and every metric agrees to float rounding (≤ 1e-14 relative).

`python -m blis_jax.golden --reference DIR --write golden/` regenerates our own expected outputs
(`golden/<latency model>.json`), which the tests compare exactly, for regression.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml

from blis_jax.config.coefficients import BLIS_FIT
from blis_jax.errors import ConfigError, SimulationFailed
from blis_jax.scenario import Deployment, EngineSettings, ResolvedScenario, ScenarioConfig, SpecWorkload
from blis_jax.scenario import resolve as resolve_scenario
from blis_jax.scenario.resolve import Warn

REFERENCE_FILES = {"trained-physics": "trained_physics_iter29.json", "roofline": "roofline_goldendataset.json"}
EXACT_FIELDS = ("completed_requests", "total_input_tokens", "total_output_tokens")
TOLERANCES = {key: 0.001 for key in ("ttft_mean_ms", "e2e_mean_ms", "itl_mean_ms", "ttft_p90_ms", "ttft_p99_ms",
                                     "e2e_p90_ms", "e2e_p99_ms")}


@dataclasses.dataclass(frozen=True)
class GoldenExperiment:
    id: str
    latency_model: str
    model: str
    hardware: str
    tp: int
    total_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    workload: dict
    expected: dict

    @property
    def name(self) -> str:
        return f"{self.latency_model}:{self.id}"


def load_experiments(testdata_dir: str | Path, latency_model: str) -> list[GoldenExperiment]:
    if latency_model not in REFERENCE_FILES:
        raise ConfigError(f"latency model {latency_model!r}: golden data exists for {', '.join(REFERENCE_FILES)}")
    path = Path(testdata_dir) / REFERENCE_FILES[latency_model]
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read BLIS's golden dataset ({e.strerror}); pass --reference "
                          "with the directory holding it (../shared/reference/blis/testdata)") from None
    return [GoldenExperiment(id=str(e["id"]), latency_model=latency_model, model=e["model"], hardware=e["hardware"],
                             tp=int(e["tp"]), total_kv_blocks=int(e["total_kv_blocks"]),
                             max_num_seqs=int(e["max_num_seqs"]), max_num_batched_tokens=int(e["max_num_batched_tokens"]),
                             workload=e["workload"], expected=e["expected"])
            for e in data["experiments"]]


def write_spec(exp: GoldenExperiment, directory: str | Path) -> Path:
    """The experiment's workload as a spec file for `--workload-spec`."""
    path = Path(directory) / f"golden-{exp.latency_model}-{exp.id}.yaml"
    path.write_text(yaml.safe_dump(exp.workload, sort_keys=False))
    return path


def run_flags(exp: GoldenExperiment, spec_path: str | Path) -> list[str]:
    """`blis-jax run` flags that reproduce the experiment (BLIS's own flag names, and BLIS's
    coefficients by name: blis-jax's default set is another)."""
    coefficients = ["--coefficients", "iter29"] if exp.latency_model == "trained-physics" else []
    return ["run", "--model", exp.model, "--hardware", exp.hardware, "--tp", str(exp.tp),
            "--latency-model", exp.latency_model, *coefficients, "--total-kv-blocks", str(exp.total_kv_blocks),
            "--max-num-seqs", str(exp.max_num_seqs), "--max-num-batched-tokens", str(exp.max_num_batched_tokens),
            "--workload-spec", str(spec_path)]


def scenario_config(exp: GoldenExperiment) -> ScenarioConfig:
    """The scenario of `blis-jax run` with `run_flags(exp, ...)`: no seed given, so the workload
    spec's own seed is used (BLIS's precedence)."""
    return ScenarioConfig(
        deployment=Deployment(model=exp.model, hardware=exp.hardware, tp=exp.tp, latency_model=exp.latency_model,
                              total_kv_blocks=exp.total_kv_blocks,
                              # BLIS ran its golden experiments with its own coefficients
                              coefficients=BLIS_FIT if exp.latency_model == "trained-physics" else None),
        engine=EngineSettings(max_num_seqs=exp.max_num_seqs, max_num_batched_tokens=exp.max_num_batched_tokens),
        workload=SpecWorkload(spec=exp.workload))


def resolve(exp: GoldenExperiment, *, warn: Warn | None = None) -> ResolvedScenario:
    """The experiment resolved as `blis-jax run` resolves it (`warn` as in `scenario.resolve`)."""
    return resolve_scenario(scenario_config(exp), warn=warn)


def run_experiments(experiments: Sequence[GoldenExperiment], *, batched: bool = True,
                    progress: Callable[[str], None] | None = None, timings: dict | None = None,
                    warn: Warn | None = None) -> list[dict]:
    """The `run` metrics block of each experiment (`timings`, if given, gets the seconds spent
    generating the workloads as `generate_s`). Batched: the experiments share one compiled
    program per latency-model structure (dims covering all of them) and run as lanes of the
    sweep's batch runner, dealt to the devices (one per core on CPU, see sweep/batch.py); single: one
    `simulate_sessions` call each, with its own dims."""
    from blis_jax.engine.simulate import simulate_sessions
    from blis_jax.metrics import metrics_output

    start = time.perf_counter()
    resolved = [resolve(exp, warn=warn) for exp in experiments]
    if timings is not None:
        timings["generate_s"] = time.perf_counter() - start
    if batched:
        from blis_jax.sweep.batch import run_lanes
        from blis_jax.sweep.lane import SessionLane
        from blis_jax.sweep.progress import SweepProgress

        lanes = [SessionLane(requests=s.requests, links=s.sessions, params=s.params, model=s.latency_model,
                             block_size=s.block_size, scheduler=s.scheduler, preemption_policy=s.preemption_policy)
                 for s in resolved]
        bar = SweepProgress(sys.stderr, len(lanes), prefix="blis-jax golden") if progress is not None else None
        outputs = run_lanes(lanes, lambda _, result: result, progress=bar)
        if bar is not None:
            bar.close()
    else:
        outputs = []
        for exp, s in zip(experiments, resolved):
            if progress is not None:
                progress(f"{exp.name}: {len(s.requests)} requests")
            outputs.append(simulate_sessions(s.requests, s.sessions, s.params, s.latency_model))
    metrics = []
    for final, out in outputs:
        if out.result != 0:
            raise SimulationFailed(f"golden run stopped with result code {out.result}")
        metrics.append(metrics_output(out, final))
    return metrics


def compare(exp: GoldenExperiment, metrics: dict) -> list[str]:
    """Differences from BLIS beyond the acceptance tolerances (empty: the experiment passes)."""
    problems = []
    for key in EXACT_FIELDS:
        if metrics[key] != exp.expected[key]:
            problems.append(f"{exp.name} {key}: {metrics[key]} != BLIS {exp.expected[key]}")
    for key, tol in TOLERANCES.items():
        if key not in exp.expected:
            continue
        rel = metrics[key] / exp.expected[key] - 1.0
        if abs(rel) > tol:
            problems.append(f"{exp.name} {key}: {metrics[key]:.4f} vs BLIS {exp.expected[key]:.4f} "
                            f"({rel:+.2%}, tolerance {tol:.1%})")
    return problems


def relative_errors(exp: GoldenExperiment, metrics: dict) -> dict[str, float]:
    return {key: metrics[key] / exp.expected[key] - 1.0 for key in TOLERANCES if key in exp.expected}


def main(argv: Sequence[str] | None = None) -> int:
    from blis_jax import __version__
    from blis_jax.sweep import sharding

    sharding.host_devices_per_core()  # batched lanes run one per core (before JAX starts its backends)

    parser = argparse.ArgumentParser(prog="python -m blis_jax.golden", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", default="../shared/reference/blis/testdata",
                        help="directory of BLIS's golden datasets")
    parser.add_argument("--latency-model", action="append", choices=sorted(REFERENCE_FILES),
                        help="latency model(s) to run (default: both)")
    parser.add_argument("--write", metavar="DIR", help="write our outputs to DIR/<latency model>.json")
    parser.add_argument("--single", action="store_true", help="one run per experiment instead of batches")
    args = parser.parse_args(argv)
    failures = 0
    for kind in args.latency_model or sorted(REFERENCE_FILES):
        experiments = load_experiments(args.reference, kind)
        start = time.perf_counter()
        metrics = run_experiments(experiments, batched=not args.single,
                                  progress=lambda line: print(line, file=sys.stderr))
        wall = time.perf_counter() - start
        print(f"{kind}: {len(experiments)} experiments in {wall:.1f} s")
        for exp, m in zip(experiments, metrics):
            problems = compare(exp, m)
            failures += len(problems)
            errs = relative_errors(exp, m)
            print(f"  {exp.id:>16} {'ok  ' if not problems else 'FAIL'} " +
                  " ".join(f"{k.removesuffix('_ms')}={v:+.2%}" for k, v in errs.items()))
            for p in problems:
                print(f"    {p}")
        if args.write:
            out = Path(args.write) / f"{kind}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({
                "generated_by": f"blis-jax {__version__} (python -m blis_jax.golden --write)",
                "latency_model": kind,
                "note": "our own outputs for BLIS's golden experiments, for regression; BLIS's numbers are in "
                        f"../shared/reference/blis/testdata/{REFERENCE_FILES[kind]}",
                "experiments": {exp.id: {"flags": run_flags(exp, f"<workload of experiment {exp.id}>"), "metrics": m}
                                for exp, m in zip(experiments, metrics)},
            }, indent=1) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
