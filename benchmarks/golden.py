"""BLIS's 15 golden experiments, timed: one command, prints a table.

    python benchmarks/golden.py                 # trained-physics, batched (one program, each core running its share of the lanes)
    python benchmarks/golden.py --single        # one run per experiment instead
    python benchmarks/golden.py --latency-model roofline
    python benchmarks/golden.py --passes 2      # a second pass: the compiled program reused

Wall time includes workload generation and compilation (a fresh process, no compile cache);
later passes (`--passes`) reuse the program compiled by the first, so the difference between
the first and second rows is the tracing and compilation.
For comparison: BLIS runs the same 15 experiments in about 60 s on this kind of machine.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from blis_jax import golden  # noqa: E402
from blis_jax.sweep import sharding  # noqa: E402

REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "blis" / "testdata"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latency-model", default="trained-physics", choices=sorted(golden.REFERENCE_FILES))
    parser.add_argument("--single", action="store_true")
    parser.add_argument("--reference", default=str(REFERENCE))
    parser.add_argument("--passes", type=int, default=1, help="run the 15 experiments this many times")
    args = parser.parse_args()
    sharding.host_devices_per_core()  # batched: one device per core, as `python -m blis_jax.golden`
    experiments = golden.load_experiments(args.reference, args.latency_model)
    print("| latency model | mode | pass | experiments | requests | wall (s) | "
          "of which workload generation (s) | simulated req/s | within tolerance | peak RSS (MiB) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for number in range(1, args.passes + 1):
        start = time.perf_counter()
        timings: dict = {}
        metrics = golden.run_experiments(experiments, batched=not args.single, timings=timings)
        wall = time.perf_counter() - start
        requests = sum(m["completed_requests"] for m in metrics)
        passing = sum(not golden.compare(e, m) for e, m in zip(experiments, metrics))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        label = "1 (compile included)" if number == 1 else str(number)
        print(f"| {args.latency_model} | {'single' if args.single else 'batched'} | {label} | {len(experiments)} | "
              f"{requests} | {wall:.1f} | {timings['generate_s']:.1f} | {requests / wall:.0f} | "
              f"{passing}/{len(experiments)} | {peak:.0f} |", flush=True)


if __name__ == "__main__":
    main()
