"""Scenario-sweep benchmark: one command, prints the figures.

    python benchmarks/sweep.py            # 10 rates x 5 instance counts x 4 max-num-seqs x 5 seeds:
                                          # 1,000 scenarios of 1,000 requests each
    python benchmarks/sweep.py --quick    # 2 rates x 2 instance counts x 2 max-num-seqs x 1 seed, 100 requests
    python benchmarks/sweep.py --seeds 1  # the full grid with one seed (200 scenarios)
    python benchmarks/sweep.py --no-shared-runs  # every scenario simulated (sweep/shared_runs.py off)

Llama-3.1-8B-Instruct on H100s (TP 1, trained-physics, auto-sized KV cache), BLIS's default
distribution workload (constant arrivals at the rate, Gaussian 512/256 prompt and output
lengths), 1, 2, 4, 8 or 16 instances behind BLIS's default router (round-robin, always-admit):
the sweep runs those instances as independent single-instance lanes (cluster/decompose.py).

Each sweep is a separate `blis-jax sweep` process: "cold" starts with an empty persistent
compilation cache (tracing + XLA compilation + the runs), "warm" is the same command again
with the cache filled by the cold run. Peak RSS is per process (the sweep's own memory).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
FULL = {"rate": [2, 4, 6, 8, 10, 12, 14, 16, 18, 20], "num-instances": [1, 2, 4, 8, 16],
        "max-num-seqs": [32, 64, 128, 256], "seed": [1, 2, 3, 4, 5]}
QUICK = {"rate": [5, 10], "num-instances": [1, 4], "max-num-seqs": [64, 256], "seed": [1]}
# BLIS on this machine: 0.2-1.0 s per 1,000-request run, one process per scenario
BLIS_RUN_S = (0.2, 1.0)


def grid(quick: bool, seeds: int | None) -> dict:
    axes = dict(QUICK if quick else FULL)
    if seeds is not None:
        axes["seed"] = list(range(1, seeds + 1))
    return {"base": {"model": "meta-llama/llama-3.1-8b-instruct", "hardware": "H100", "tp": 1,
                     "num-requests": 100 if quick else 1000},
            "axes": axes}


def sweep_process(grid_path: Path, out_dir: Path, cache: Path, extra: list[str]) -> dict:
    """Run `blis-jax sweep` in a child process; wall time and the child's own peak RSS."""
    env = {**os.environ, "BLIS_JAX_COMPILE_CACHE": str(cache),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "blis_jax", "sweep", str(grid_path), "--output-dir", str(out_dir),
           "--no-plots", "--progress", *extra]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if status != 0:
        sys.exit(f"sweep failed (status {status}):\n{stderr}")
    # the sweep's summary line: "... N/N scenarios in T (R scenarios/s), B batches[ on D devices]"
    summary = re.search(r"(\d+) batch(?:es)?(?: on (\d+) devices)?$", stderr.strip())
    return {"wall_s": wall, "peak_rss_mib": usage.ru_maxrss / 1024, "batches": int(summary.group(1)),
            "devices": int(summary.group(2) or 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny grid (seconds of simulation)")
    ap.add_argument("--seeds", type=int, default=None, help="number of seeds (default 5, quick 1)")
    ap.add_argument("--max-batch", type=int, default=None, help="passed to blis-jax sweep")
    ap.add_argument("--memory-budget", default=None, help="passed to blis-jax sweep")
    ap.add_argument("--no-shared-runs", action="store_true",
                    help="passed to blis-jax sweep: simulate every scenario, even those whose answer an "
                         "unbound max-num-seqs run already gives (times the engine alone)")
    args = ap.parse_args()
    extra = [flag for flag, value in (("--max-batch", args.max_batch), ("--memory-budget", args.memory_budget))
             if value is not None for flag in (flag, str(value))]
    extra += ["--no-shared-runs"] if args.no_shared_runs else []
    g = grid(args.quick, args.seeds)
    scenarios = 1
    for values in g["axes"].values():
        scenarios *= len(values)
    with tempfile.TemporaryDirectory(prefix="blis-jax-sweep-bench-") as tmp:
        tmp = Path(tmp)
        grid_path = tmp / "grid.yaml"
        grid_path.write_text(yaml.safe_dump(g, sort_keys=False))
        cold = sweep_process(grid_path, tmp / "cold", tmp / "cache", extra)
        warm = sweep_process(grid_path, tmp / "warm", tmp / "cache", extra)
        same = (tmp / "cold" / "table.csv").read_text() == (tmp / "warm" / "table.csv").read_text()
    print(f"grid: {' x '.join(f'{len(v)} {k}' for k, v in g['axes'].items())} = {scenarios} scenarios, "
          f"{g['base']['num-requests']} requests each; Llama-3.1-8B / H100 / TP1; sweep devices: "
          f"{cold['devices']}")
    print(f"{'run':<6}{'wall s':>10}{'scenarios/s':>14}{'batches':>9}{'peak RSS MiB':>14}")
    for name, r in (("cold", cold), ("warm", warm)):
        print(f"{name:<6}{r['wall_s']:>10.1f}{scenarios / r['wall_s']:>14.2f}{r['batches']:>9}"
              f"{r['peak_rss_mib']:>14.0f}")
    print(f"warm table identical to cold: {same}")
    if not args.quick:
        low, high = (scenarios * t for t in BLIS_RUN_S)
        print(f"BLIS, one process per scenario at {BLIS_RUN_S[0]}-{BLIS_RUN_S[1]} s per run: "
              f"{low:.0f}-{high:.0f} s ({high / warm['wall_s']:.0f}x the warm sweep at the slow end)")


if __name__ == "__main__":
    main()
