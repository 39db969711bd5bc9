"""Cluster benchmark: one command, prints a table.

    python benchmarks/cluster.py                 # 4 and 16 instances x 10k and 100k requests
    python benchmarks/cluster.py --quick         # 10k requests only
    python benchmarks/cluster.py --instances 4   # one cluster size

Each configuration runs in its own subprocess, so that peak memory (max RSS) is per
configuration. "cold" is the first `simulate_cluster` call (tracing and XLA compilation
included); "compile" is the part of it that JAX reports as tracing, lowering and backend
compilation (jax.monitoring); configurations up to 10k requests are then run a second time in
the same process ("warm": same shapes, no compilation), the 100k ones only once (their run
time is cold - compile). CPU is the process's CPU time over a call (user + system, all
threads), which other load on a shared machine inflates much less than wall time. The
100k / 10k ratio of the run costs shows whether the cost is linear in the number of requests
(it should be ~10x); for the 100k CPU figure the 10k configuration's compile CPU
(cold - warm) is subtracted.

Workload: Llama-3.1-8B-Instruct on H100 (TP 1) per instance, trained-physics, auto-sized KV
cache and max_model_len, BLIS's default distribution workload as `blis-jax run` builds it
(constant arrivals, Gaussian 512/256 prompt and output lengths, 300 s client timeout, seed 42)
at 8 req/s per instance (moderate load); weighted routing with the default scorer profile
(precise-prefix-cache:2, queue-depth:1, kv-utilization:1) and the default 50 ms snapshot
refresh and cache-signal delay.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RATE_PER_INSTANCE = 8.0
INSTANCES = (4, 16)
SIZES = (10_000, 100_000)
WARM_UP_TO = 10_000  # configurations this size or smaller also get a warm run
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(num_requests: int, instances: int) -> dict:
    sys.path.insert(0, str(REPO))
    import jax
    import numpy as np

    from blis_jax.cluster.simulate import ClusterConfig, simulate_cluster
    from blis_jax.config import auto_kv_blocks, auto_max_model_len, load_coefficients, load_gpu, load_model
    from blis_jax.engine import output as so
    from blis_jax.engine.params import make_engine_params
    from blis_jax.latency import build_latency_model
    from blis_jax.workload.distribution import (
        DistributionWorkload,
        generate_distribution,
    )

    compile_s = [0.0]

    def on_event(name, seconds, **_):
        if name in _COMPILE_EVENTS:
            compile_s[0] += seconds

    jax.monitoring.register_event_duration_secs_listener(on_event)

    arch, gpu = load_model("meta-llama/Llama-3.1-8B-Instruct"), load_gpu("H100")
    blis = load_coefficients("iter29")   # BLIS's: the rates and figures here were chosen with them
    model = build_latency_model("trained-physics", arch, gpu, tp=1, alpha=blis.alpha, beta=blis.beta)
    blocks = auto_kv_blocks(arch, gpu, 1)
    params = make_engine_params(total_kv_blocks=blocks, max_model_len=auto_max_model_len(arch, blocks))
    rate = RATE_PER_INSTANCE * instances
    requests = generate_distribution(DistributionWorkload(rate=rate, num_requests=num_requests), seed=42)
    cluster = ClusterConfig(num_instances=instances, routing_policy="weighted")

    def timed():
        compile_s[0] = 0.0  # only what this call compiles
        cpu0, start = _cpu_seconds(), time.perf_counter()
        out = simulate_cluster(requests, params, model, cluster)
        return out, time.perf_counter() - start, _cpu_seconds() - cpu0, compile_s[0]

    out, cold, cold_cpu, compiled = timed()
    row = {"requests": num_requests, "instances": instances, "rate": rate, "cold_s": cold, "cold_cpu_s": cold_cpu,
           "compile_s": compiled, "warm_s": None, "warm_cpu_s": None}
    if num_requests <= WARM_UP_TO:
        del out
        out, row["warm_s"], row["warm_cpu_s"], _ = timed()
    counts = np.bincount(out.handled_by[out.handled_by >= 0], minlength=instances)
    row.update({
        "completed": int(out.completed_mask().sum()),
        "timed_out": int(out.timed_out.sum()),
        "rejected": int((out.status == so.REJECTED).sum()),
        "per_instance_min_max": [int(counts.min()), int(counts.max())],
        "sim_seconds": int(out.sim_end_us.max()) / 1e6,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "result": out.result,
    })
    return row


def run_seconds(r: dict) -> float:
    """Simulation wall time without compilation: warm if measured, else cold - compile."""
    return r["warm_s"] if r["warm_s"] is not None else r["cold_s"] - r["compile_s"]


def _fmt(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="10k requests only")
    parser.add_argument("--instances", type=int, nargs="*", default=list(INSTANCES), help="cluster sizes")
    parser.add_argument("--sizes", type=int, nargs="*", default=None, help="request counts")
    parser.add_argument("--one", nargs=2, metavar=("N", "INSTANCES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(int(args.one[0]), int(args.one[1]))))
        return
    sizes = args.sizes or ([SIZES[0]] if args.quick else list(SIZES))
    rows = []
    for instances in args.instances:
        for n in sizes:
            proc = subprocess.run([sys.executable, __file__, "--one", str(n), str(instances)],
                                  check=False, capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stderr, file=sys.stderr)
                raise SystemExit(f"benchmark {n} requests x {instances} instances failed")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append(r)
            print(f"{n:>7} x {instances:>2} instances  cold {r['cold_s']:8.2f} s (compile {r['compile_s']:6.2f} s, "
                  f"CPU {r['cold_cpu_s']:8.2f} s)  warm {_fmt(r['warm_s'])} s (CPU {_fmt(r['warm_cpu_s'])} s)  "
                  f"{n / run_seconds(r):6.0f} req/s  peak {r['peak_rss_mib']:6.0f} MiB", file=sys.stderr, flush=True)
    print()
    print("| instances | requests | rate (req/s) | cold (s) | compile (s) | cold CPU (s) | warm (s) | warm CPU (s) | "
          "simulated req/s (run) | peak RSS (MiB) | completed | timed out | simulated s | result |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['instances']} | {r['requests']} | {r['rate']:.0f} | {r['cold_s']:.2f} | {r['compile_s']:.2f} | "
              f"{r['cold_cpu_s']:.2f} | {_fmt(r['warm_s'])} | {_fmt(r['warm_cpu_s'])} | "
              f"{r['requests'] / run_seconds(r):.0f} | {r['peak_rss_mib']:.0f} | {r['completed']} | "
              f"{r['timed_out']} | {r['sim_seconds']:.1f} | {r['result']} |")
    by = {(r["instances"], r["requests"]): r for r in rows}
    small, big = min(sizes), max(sizes)
    for instances in args.instances:
        a, b = by.get((instances, small)), by.get((instances, big))
        if a is None or b is None or a is b or a["warm_s"] is None:
            continue
        compile_cpu = a["cold_cpu_s"] - a["warm_cpu_s"]
        big_cpu = b["warm_cpu_s"] if b["warm_cpu_s"] is not None else b["cold_cpu_s"] - compile_cpu
        print(f"{instances} instances, {big} / {small} requests ({big / small:.0f}x): run wall "
              f"{run_seconds(b) / run_seconds(a):.1f}x, run CPU {big_cpu / a['warm_cpu_s']:.1f}x")


if __name__ == "__main__":
    main()
