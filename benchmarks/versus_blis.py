"""blis-jax against BLIS, scenario by scenario: one command, prints the ratios.

    python benchmarks/versus_blis.py            # every row (about 15 minutes on 2 cores)
    python benchmarks/versus_blis.py --quick    # the rows up to 1k requests (default run, 1k)
    python benchmarks/versus_blis.py --rows default,1k --repeats 5

Each row is `blis-jax run` with the row's flags, as a user types it, in a fresh process
(import, loading or compiling the programs, generating, simulating, printing). "warm" runs
after one untimed run of the same command has filled the compile caches; "cold" runs with
empty caches (a new temporary `BLIS_JAX_COMPILE_CACHE` and `XDG_CACHE_HOME`). Figures: the
median wall time over `--repeats` runs, simulated requests per second (requests / median
wall), the largest peak RSS of those processes, and blis-jax's time over BLIS's.

BLIS's figures are constants measured on the same 2-core machine with BLIS's default flags
(issue #20's table: each pair interleaved A B A B, medians of 3; BLIS built from
inference-sim/inference-sim at the commit of ../shared/reference/blis). Where BLIS's time was
a range, the ratio uses the range's middle. Tuned BLIS (`--cache-signal-delay 0`) simulates
3.8k-5.2k requests per second on one instance; the target for single-instance rows is 5k.
The cluster rows offer 8 req/s per instance (as benchmarks/cluster.py) with BLIS's default
weighted scorer profile; the single-instance rows use benchmarks/run.py's rates.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMON = ["--model", "meta-llama/Llama-3.1-8B-Instruct", "--hardware", "H100", "--tp", "1"]
WEIGHTED = ["--routing-policy", "weighted"]


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    flags: list[str]
    requests: int
    blis_s: tuple[float, float]  # BLIS's wall time (low, high), issue #20
    blis_gib: float | None = None  # BLIS's peak memory where it was measured
    cache: str = "warm"


ROWS = [
    Row("default", [], 100, (0.07, 0.10)),
    Row("1k", [*COMMON, "--rate", "9", "--num-requests", "1000"], 1_000, (3.2, 3.2)),
    Row("1k-cold", [*COMMON, "--rate", "9", "--num-requests", "1000"], 1_000, (3.2, 3.2), cache="cold"),
    Row("10k", [*COMMON, "--rate", "9", "--num-requests", "10000"], 10_000, (35.2, 35.2)),
    Row("10k-overloaded", [*COMMON, "--rate", "30", "--num-requests", "10000", "--timeout", "300"], 10_000,
        (37.7, 37.7)),
    Row("100k", [*COMMON, "--rate", "9", "--num-requests", "100000"], 100_000, (226.0, 524.0), blis_gib=4.8),
    Row("4x10k-weighted", [*COMMON, "--num-instances", "4", *WEIGHTED, "--rate", "32", "--num-requests", "10000"],
        10_000, (95.2, 95.2)),
    Row("16x10k-weighted", [*COMMON, "--num-instances", "16", *WEIGHTED, "--rate", "128", "--num-requests", "10000"],
        10_000, (77.0, 77.0)),
]
QUICK = ("default", "1k", "1k-cold")


def repo_env() -> dict:
    """This checkout's blis_jax first on the path, whatever is installed, with BLIS's coefficients
    (BLIS's rows ran with them; the speed of a run hardly depends on the numbers, its workload does)."""
    env = dict(os.environ)
    env.setdefault("BLIS_JAX_COEFFICIENTS", "iter29")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def timed_run(flags: list[str], env: dict, cwd: str) -> tuple[float, float]:
    """(wall s, peak RSS GiB) of one `blis-jax run` process."""
    out, err = Path(cwd) / "stdout.txt", Path(cwd) / "stderr.txt"
    with out.open("w") as stdout, err.open("w") as stderr:  # files: a full pipe would stall the run
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "blis_jax", "run", *flags], cwd=cwd, env=env, stdout=stdout, stderr=stderr)
        _, status, rusage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4
    if proc.returncode != 0 or "=== Simulation Metrics ===" not in out.read_text():
        raise SystemExit(f"blis-jax run {' '.join(flags)} failed:\n{err.read_text()[-2000:]}")
    return wall, rusage.ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def measure(row: Row, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as work:
        env = repo_env()
        if row.cache == "warm":
            timed_run(row.flags, env, work)  # fills the caches (untimed)
            runs = [timed_run(row.flags, env, work) for _ in range(repeats)]
        else:
            runs = []
            for i in range(repeats):
                fresh = Path(work) / f"cache{i}"
                env.update(BLIS_JAX_COMPILE_CACHE=str(fresh / "jax"), XDG_CACHE_HOME=str(fresh))
                runs.append(timed_run(row.flags, env, work))
    wall = statistics.median(w for w, _ in runs)
    blis = sum(row.blis_s) / 2
    return {"row": row.name, "cache": row.cache, "requests": row.requests, "wall_s": wall,
            "sim_req_per_s": row.requests / wall, "peak_gib": max(g for _, g in runs),
            "blis_s": row.blis_s, "ratio": wall / blis, "blis_gib": row.blis_gib}


def print_table(results: list[dict]) -> None:
    print(f"{'row':<18} {'cache':<5} {'wall s':>8} {'req/s':>8} {'peak GiB':>8} {'BLIS s':>11} "
          f"{'jax/BLIS':>9}  verdict")
    for r in results:
        low, high = r["blis_s"]
        blis = f"{low:g}" if low == high else f"{low:g}-{high:g}"
        verdict = f"{1 / r['ratio']:.1f}x faster" if r["ratio"] < 1 else f"{r['ratio']:.1f}x slower"
        print(f"{r['row']:<18} {r['cache']:<5} {r['wall_s']:>8.2f} {r['sim_req_per_s']:>8.0f} {r['peak_gib']:>8.2f} "
              f"{blis:>11} {r['ratio']:>9.2f}  {verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"only the rows {', '.join(QUICK)}")
    parser.add_argument("--rows", help=f"comma-separated rows of: {', '.join(r.name for r in ROWS)}")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row (median; default 3)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    chosen = ROWS
    if args.quick:
        chosen = [r for r in ROWS if r.name in QUICK]
    if args.rows:
        names = args.rows.split(",")
        unknown = sorted(set(names) - {r.name for r in ROWS})
        if unknown:
            parser.error(f"--rows: unknown {', '.join(unknown)}; rows: {', '.join(r.name for r in ROWS)}")
        chosen = [r for r in ROWS if r.name in names]
    results = []
    for row in chosen:
        print(f"... {row.name} ({row.cache})", file=sys.stderr, flush=True)
        results.append(measure(row, args.repeats))
    print_table(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
