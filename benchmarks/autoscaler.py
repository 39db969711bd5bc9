"""Autoscaler benchmark: one command, prints figures.

    python benchmarks/autoscaler.py --skip-grid      # a diurnal cycle compressed into 3 minutes
    python benchmarks/autoscaler.py --hours 24 --skip-grid --passes 1   # the real day
    python benchmarks/autoscaler.py --policies 9     # part 2 with a 3x3 grid

Part 1, one autoscaled cluster: 4 startup instances (Llama-3.1-8B-Instruct, H100, TP 1) on
node pools of 8 nodes x 8 GPUs, 64 instance slots (the startup 4 + 60 for the autoscaler), the
V2 saturation analyzer ticking every 30 s with a 2-minute scale-down window and ~75 s
loading delays, under a diurnal day: Poisson arrivals over 24 simulated hours at a rate of
1 req/s x (1 - 0.7·cos(2π t / 24 h)) (trough 0.3 req/s at midnight, peak 1.7 req/s at noon;
~86k requests), Gaussian prompt (500 ± 150) and long output (4000 ± 500) lengths, and a
KV cache of 2400 blocks of 16 tokens per instance, so that about eight requests at full length
fill an instance and the instance count follows the load. (With 800 blocks, three requests,
the instances thrashed: 145-271 preemptions each in the 1-minute cycle, a cluster no one would
run, and every preemption ends a decode run.) The trough must keep requests
in flight at every tick: BLIS's analyzer drains every instance of a model whose demand is
zero at a tick, and never scales up from zero (the request lengths are long for that reason:
in-flight requests per arrival rate). Reported: wall time of the first pass
(tracing and compilation included) and of a second pass (same shapes: the compiled program
is reused), simulated requests per second of wall time (second pass), peak memory (max RSS of
the process), and the scale events (instances placed, instances drained) with the peak
routable count.

Cost: the cluster loop steps its 64 slots in lockstep (vmapped) whenever any instance is busy,
so the work grows with the cluster events (arrivals, ticks) times the loop iterations between
them (decode runs of up to 64 steps, engine/coast.py), for all 64 slots. Figures, the day
included: docs/SWEEPS.md.

Part 2, a grid of autoscaler policies on the same ramp (scale-up threshold x scale-down
window): all policies as one batched call (`sweep/scaling_batch.simulate_batched`), against
the same runs one by one (each its own call of the same driver), both after their compile
(the first pass of each is reported separately). On CPU the batched call maps over the runs
(`lax.map`, one dispatch per chunk); on an accelerator it vmaps them.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SLOTS = 64
STARTUP = 4
DEPTH = 0.7
MEAN_RATE = 1.0  # requests / s over the cycle
KV_BLOCKS = 2400  # per instance (16-token blocks): about eight requests fill one


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0   # Linux: KiB


def diurnal_requests(mean_rate: float, hours: float, depth: float, seed: int):
    """Poisson arrivals over one diurnal cycle of `hours` hours at a rate
    mean_rate x (1 - depth·cos(2π t / cycle)) (trough at t = 0, peak at half the cycle)."""
    import numpy as np

    from blis_jax.workload.requests import make_request_set

    rng = np.random.default_rng(seed)
    cycle = hours * 3600.0
    peak = mean_rate * (1 + depth)
    t = np.cumsum(rng.exponential(1.0 / peak, size=int(peak * cycle * 1.2) + 100))   # thinning
    t = t[t < cycle]
    t = t[rng.random(t.shape[0]) < (1 - depth * np.cos(2 * np.pi * t / cycle)) / (1 + depth)]
    n = t.shape[0]
    prompt = np.clip(rng.normal(500, 150, n), 200, 800).astype(np.int64)
    output = np.clip(rng.normal(4000, 500, n), 3000, 5000).astype(np.int64)
    return make_request_set(request_id=np.arange(n), arrival_us=(t * 1e6).astype(np.int64), input_len=prompt,
                            output_len=output)


def scenario(requests, up: float = 0.8, down_window_us: float = 120e6):
    from blis_jax.cluster.autoscaler import AnalyzerConfig, AutoscalerConfig
    from blis_jax.cluster.node_pools import Delay, InstanceLifecycle, NodePool
    from blis_jax.cluster.simulate import ClusterConfig
    from blis_jax.scenario import Deployment, ScenarioConfig
    from blis_jax.scenario.resolve import resolve_deployment

    pool = NodePool(name="h100", gpu_type="H100", gpus_per_node=8, gpu_memory_gib=80.0, initial_nodes=8,
                    max_nodes=8, cost_per_hour=4.0)
    config = ScenarioConfig(
        deployment=Deployment(total_kv_blocks=KV_BLOCKS),
        cluster=ClusterConfig(
            num_instances=STARTUP, node_pools=(pool,),
            instance_lifecycle=InstanceLifecycle(loading_delay=Delay(mean=75.0, stddev=7.5),
                                                 warm_start_initial_instances=True),
            autoscaler=AutoscalerConfig(interval_us=30e6, scale_down_stabilization_window_us=down_window_us,
                                        hpa_scrape_delay=Delay(mean=1.0, stddev=0.2),
                                        analyzer=AnalyzerConfig(scale_up_threshold=up))),
        seed=7)
    resolved = resolve_deployment(config, horizon_us=None)
    return dataclasses.replace(resolved, requests=requests)


def scale_events(out) -> tuple[int, int, int]:
    """(instances placed, instances drained, peak routable instances)."""
    from blis_jax.sweep.instance_plot import instance_counts

    placed = sum("scale-up: placed instance" in m for _, _, m in out.cluster_log)
    drained = sum("scale-down: draining instance" in m for _, _, m in out.cluster_log)
    return placed, drained, int(instance_counts(out)["routable"].max())


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 1-minute cycle (~60 requests)")
    ap.add_argument("--hours", type=float, default=None, help="length of the diurnal cycle (default 0.05: 3 min)")
    ap.add_argument("--policies", type=int, default=None, help="grid size: 4 or 9 policies (default 4)")
    ap.add_argument("--skip-grid", action="store_true", help="part 1 only")
    ap.add_argument("--passes", type=int, choices=(1, 2), default=2,
                    help="part 1 once (compile included), or again on the compiled program (default)")
    ap.add_argument("--plot", default=None, metavar="PNG", help="also draw the instance counts of part 1")
    args = ap.parse_args(argv)
    hours = args.hours or (1 / 60 if args.quick else 0.05)
    policies = args.policies or 4
    sys.path.insert(0, str(REPO))
    import jax

    from blis_jax.sweep import scaling_batch

    requests = diurnal_requests(MEAN_RATE, hours, depth=DEPTH, seed=1)
    n = len(requests)
    print(f"device: {jax.devices()[0].platform} x{len(jax.devices())}; {n:,} requests over a {hours:g} h "
          f"diurnal cycle; {SLOTS} instance slots ({STARTUP} startup)", flush=True)
    base = scenario(requests)
    new = SLOTS - STARTUP

    start = [time.perf_counter()]

    def progress(done, total, sim_us):   # a long cycle runs for minutes: one line per chunk
        print(f"  {done:,}/{total:,} requests finished, simulated {sim_us / 3.6e9:.2f} h, "
              f"wall {time.perf_counter() - start[0]:.0f} s", file=sys.stderr, flush=True)

    def one(s):
        start[0] = time.perf_counter()
        return scaling_batch.simulate_batched([s], new_slots=new, progress=progress)[0]

    out, first = timed(lambda: one(base))
    assert out.result == 0, out.result
    placed, drained, peak = scale_events(out)
    done = int(out.completed_mask().sum())
    print(f"\n== one autoscaled cluster, {SLOTS} slots, a {hours:g} h diurnal cycle ==")
    print(f"first pass (compile included): {first:8.1f} s", flush=True)
    if args.passes > 1:
        _, second = timed(lambda: one(base))
        print(f"second pass:                   {second:8.1f} s")
    print(f"simulated requests / s:        {n / (second if args.passes > 1 else first):8.0f}   "
          f"({done:,} of {n:,} completed; pass {args.passes})")
    print(f"peak memory (max RSS):         {max_rss_mib():8.0f} MiB")
    print(f"scale events:                  {placed} instances placed, {drained} drained; "
          f"peak {peak} routable instances")
    if args.plot:
        from blis_jax.sweep.instance_plot import instance_counts, write_instance_counts

        write_instance_counts({"diurnal day, 64 slots": instance_counts(out)}, args.plot)
        print(f"wrote {args.plot}", flush=True)
    if args.skip_grid:
        return 0

    ups = (0.6, 0.8, 0.9) if policies > 4 else (0.6, 0.9)
    windows = (0.0, 120e6, 600e6) if policies > 4 else (0.0, 600e6)
    grid = [scenario(requests, up, w) for up, w in itertools.product(ups, windows)]
    print(f"\n== {len(grid)} autoscaler policies (scale-up threshold x scale-down window), same ramp ==")
    batched, b_first = timed(lambda: scaling_batch.simulate_batched(grid, new_slots=new))
    _, b_second = timed(lambda: scaling_batch.simulate_batched(grid, new_slots=new))
    singles, s_total = timed(lambda: [one(s) for s in grid])   # the B = 1 program is compiled (part 1)
    for (up, w), a, b in zip(itertools.product(ups, windows), batched, singles):
        same = (a.cluster_log == b.cluster_log and (a.status == b.status).all() and (a.e2e_us == b.e2e_us).all())
        p, d, pk = scale_events(a)
        print(f"  up {up:.1f}, down window {w / 1e6:5.0f} s: {p:3d} placed, {d:3d} drained, peak {pk:2d}; "
              f"batched = one by one: {same}")
    print(f"batched, first pass (compile included): {b_first:8.1f} s")
    print(f"batched, second pass:                   {b_second:8.1f} s")
    print(f"one by one (compiled):                  {s_total:8.1f} s   ({b_second / s_total:.2f}x)")
    print(f"peak memory (max RSS):                  {max_rss_mib():8.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
