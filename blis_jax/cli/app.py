"""Command-line interface: ``blis-jax run`` and ``blis-jax replay``, with BLIS's flag names.

``run`` synthesises a workload (constant arrivals, clamped-Gaussian lengths, or a named
preset) and simulates it; ``replay`` simulates the requests of a TraceV2 (header YAML + CSV).
Both print BLIS's ``=== Simulation Metrics ===`` JSON block (plus the text sections that
apply) on stdout and optionally write ``--metrics-path``, ``--results-path`` and a TraceV2
``--trace-output``. Bad input ends with one ``blis-jax: error: ...`` line on stderr and exit
code 2; diagnostics and progress never go to stdout.

``convert preset|inference-perf`` and ``compose`` print a workload spec v2 YAML (spec §1.5;
logic in ``workload.convert``); ``calibrate`` compares an observed TraceV2 with the results
file of replaying it and writes a JSON ``--report`` (spec §1.4; logic in ``calibrate``).
``fit`` fits trained-physics coefficients to observed mean latencies (logic in ``blis_jax.fit``).

Flag defaults are BLIS's (spec blis-features §1.1-§1.2), except ``--model``: BLIS requires
it, blis-jax defaults it to meta-llama/llama-3.1-8b-instruct so that a bare ``blis-jax run``
simulates the embedded default scenario. Configuration precedence is BLIS's: an explicit
flag wins, otherwise the model's BLIS default (hardware, TP), otherwise the hard-coded default;
KV blocks and max-model-len are auto-derived unless given (spec §2.14).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn, TextIO

from blis_jax import limits
from blis_jax.cli import scenario_flags
from blis_jax.cli.scenario_flags import FLAG_OF_FIELD, scenario_config
from blis_jax.cluster.admission import ADMISSION_POLICIES
from blis_jax.cluster.gateway import DISPATCH_ORDERS, FAIRNESS_POLICIES, SATURATION_DETECTORS
from blis_jax.cluster.encode import ENCODE_DECIDERS
from blis_jax.cluster.pd import PD_DECIDERS
from blis_jax.cluster.routing import ROUTING_POLICIES
from blis_jax.cluster.drain import DRAIN_POLICIES
from blis_jax.cluster.scorers import DEFAULT_PROFILE, SCORERS
from blis_jax.config import bundled_gpu_names, bundled_model_ids
from blis_jax.engine.dims import PREEMPTION_POLICIES, SCHEDULERS
from blis_jax.errors import ConfigError, SimulationFailed
from blis_jax.io_safety import atomic_write_text, check_command_paths, short
from blis_jax.naming import naming
from blis_jax.scenario import ResolvedScenario, SimulationResult, resolve, resolve_deployment, simulate
from blis_jax.scenario.policy import apply_policy_bundle
from blis_jax.scenario.config import (
    DEFAULT_HARDWARE,
    DEFAULT_MODEL,
    DEFAULT_TP,
    INT64_MAX,
    INT64_MIN,
    LATENCY_MODELS,
)
from blis_jax.workload.distribution import OUTPUT_DEFAULT, PROMPT_DEFAULT
from blis_jax.workload.presets import PRESETS
from blis_jax.workload.tracev2 import TraceHeader, read_trace

PROG = "blis-jax"
EXIT_USAGE = 2  # bad flags or input data
EXIT_FAILURE = 1  # the simulation itself could not finish

WORKLOADS = ("distribution", *PRESETS)
LOG_LEVELS = ("trace", "debug", "info", "warn", "warning", "error", "fatal", "panic")
PROGRESS_DELAY_S = 2.0  # on a terminal, progress appears once a run has taken this long
PROGRESS_EVENTS_PER_CHUNK = 5_000  # engine events between progress reports

# --------------------------------------------------------------------------------- parser


class UsageError(Exception):
    """An argparse error, carried to `main` so it prints one line instead of usage + exit."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(self.prog, message)


class DefaultSeed(int):
    """`--seed` when not given: a workload spec's own `seed` then wins (BLIS, blis-rng §4.1)."""


def _add_shared_flags(p: argparse.ArgumentParser) -> None:
    """Simulation-config flags that BLIS registers on both `run` and `replay`."""
    g = p.add_argument_group("simulation")
    g.add_argument("--seed", type=int, default=DefaultSeed(42), help="simulation seed (default 42)")
    g.add_argument("--horizon", type=int, default=None, metavar="US",
                   help="simulation horizon in µs; events after it are not executed (default: none "
                        "for run, 2 × the latest injection time for replay)")
    g.add_argument("--log", default="warn", choices=LOG_LEVELS, metavar="LEVEL",
                   help="stderr verbosity: warnings are printed at warn and below (default warn)")
    g.add_argument("--num-instances", type=int, default=1, metavar="N",
                   help="instances in the cluster (default 1)")
    g.add_argument("--progress", action="store_true",
                   help="print progress lines on stderr even when it is not a terminal "
                        "(on a terminal they appear for runs longer than a few seconds)")
    add_memory_flag(g)

    g = p.add_argument_group("cluster: admission and routing")
    g.add_argument("--admission-policy", choices=ADMISSION_POLICIES, default="always-admit",
                   help="cluster admission (default always-admit)")
    g.add_argument("--token-bucket-capacity", type=float, default=10_000, metavar="TOKENS",
                   help="token-bucket size in prompt tokens (default 10000)")
    g.add_argument("--token-bucket-refill-rate", type=float, default=1_000, metavar="TOKENS_PER_S",
                   help="token-bucket refill, tokens/s (default 1000)")
    g.add_argument("--tier-shed-threshold", type=int, default=0, metavar="REQUESTS",
                   help="tier-shed: admit every class while the busiest instance's load (queue + batch + "
                        "in flight) is at most this (default 0; BLIS's policy-bundle key tier_shed_threshold)")
    g.add_argument("--tier-shed-min-priority", type=int, default=0, metavar="PRIORITY",
                   help="tier-shed: above the threshold, admit classes of at least this priority (critical 4, "
                        "standard 3, batch -1, sheddable -2, background -3; default 0)")
    g.add_argument("--queue-depth-threshold", type=float, default=5.0, metavar="REQUESTS",
                   help="gaie-legacy and the utilization saturation detector: queue depth at which an instance "
                        "counts as saturated (default 5)")
    g.add_argument("--kv-cache-util-threshold", type=float, default=0.8, metavar="FRACTION",
                   help="gaie-legacy and the utilization saturation detector: KV utilization at which an "
                        "instance counts as saturated (default 0.8)")
    g.add_argument("--admission-latency", type=int, default=0, metavar="US",
                   help="arrival → admission decision, µs (default 0)")
    g.add_argument("--routing-latency", type=int, default=0, metavar="US",
                   help="admission → routing decision, µs (default 0)")
    g.add_argument("--routing-policy", choices=ROUTING_POLICIES, default="round-robin",
                   help="instance choice (default round-robin)")
    g.add_argument("--routing-scorers", default=None, metavar="NAME:W,...",
                   help=f"weighted routing's scorers and weights (default {DEFAULT_PROFILE}); "
                        f"scorers: {', '.join(SCORERS)}")
    g.add_argument("--snapshot-refresh-interval", type=int, default=50_000, metavar="US",
                   help="router's instance-signal staleness: re-read at most every US µs (default 50000; 0 = live)")
    g.add_argument("--cache-signal-delay", type=int, default=50_000, metavar="US",
                   help="router's prefix-cache view is re-taken every US µs (default 50000; 0 = live)")
    g.add_argument("--model-autoscaler-interval-us", type=float, default=None, metavar="US",
                   help="autoscaler tick interval, µs: overrides the policy bundle's whenever given (0 = off); "
                        "alone it enables the autoscaler with default settings (without node pools it can only "
                        "scale down)")
    # blis-jax extensions beyond BLIS's CLI: BLIS library features (its bundle parser rejects the keys)
    g.add_argument("--warm-up-requests", type=int, default=0, metavar="N",
                   help="beyond BLIS's CLI (a BLIS library feature): instances start WarmingUp and become Active "
                        "after N completed requests; each instance's first N routed requests are its warm-up "
                        "requests (default 0 = off)")
    g.add_argument("--warm-up-ttft-factor", type=float, default=0.0, metavar="F",
                   help="beyond BLIS's CLI: multiply the warm-up requests' TTFT by F in the cluster figures and "
                        "per-request records (F >= 1; default 0 = 1, no penalty); per-instance blocks and "
                        "scheduling are unchanged")
    g.add_argument("--drain-policy", choices=DRAIN_POLICIES, default="bare",
                   help="beyond BLIS's CLI: how the autoscaler's scale-down drains an instance: bare (BLIS's CLI: "
                        "Draining, terminated once its queue and batch are empty and one of its events fires), "
                        "wait (an idle instance terminates at once), immediate (its wait queue is discarded and "
                        "it terminates; its running batch still completes), redirect (its wait queue is routed "
                        "again to the other instances); default bare")
    g.add_argument("--policy-config", default=None, metavar="FILE",
                   help="BLIS policy bundle YAML: admission/routing/scheduler/preemption defaults (flags win), "
                        "node_pools, instance_lifecycle and autoscaler (strict keys)")

    g = p.add_argument_group("cluster: flow control (gateway queue between admission and routing)")
    g.add_argument("--flow-control", action="store_true",
                   help="queue requests at the gateway and dispatch them by priority band, tenant and saturation "
                        "(the queue is the admission policy)")
    g.add_argument("--saturation-detector", choices=SATURATION_DETECTORS, default="never",
                   help="what holds dispatch back (default never; utilization reads --queue-depth-threshold and "
                        "--kv-cache-util-threshold, concurrency --max-concurrency)")
    g.add_argument("--dispatch-order", choices=DISPATCH_ORDERS, default="fifo",
                   help="order inside a tenant's flow (default fifo)")
    g.add_argument("--fairness-policy", choices=FAIRNESS_POLICIES, default="global-strict",
                   help="which tenant's flow a band serves next (default global-strict)")
    g.add_argument("--slo-targets", default=None, metavar="CLASS=US,...",
                   help="slo-deadline order: per-class target after enqueue, µs")
    g.add_argument("--max-gateway-queue-depth", type=int, default=0, metavar="N",
                   help="queued requests at most (default 0: no limit)")
    g.add_argument("--per-band-capacity", type=int, default=0, metavar="N",
                   help="queued requests per priority band at most (default 0: no limit)")
    g.add_argument("--queue-shedding", action="store_true",
                   help="at the depth limit, shed the least valuable sheddable request for a more important one")
    g.add_argument("--usage-limit-threshold", type=float, default=1.0, metavar="FRACTION",
                   help="saturation ceiling of the lowest band (bands in between interpolate; default 1.0)")
    g.add_argument("--max-concurrency", type=float, default=100.0, metavar="REQUESTS",
                   help="concurrency detector: in-flight requests per instance at saturation (default 100)")
    g.add_argument("--request-ttl", type=int, default=0, metavar="US",
                   help="a request queued longer expires (default 0: never)")
    g.add_argument("--dispatch-tick-interval", type=int, default=1000, metavar="US",
                   help="dispatch retry period while the queue is non-empty (default 1000)")
    g.add_argument("--in-flight-eviction", action="store_true",
                   help="(not supported yet) evict running sheddable requests at saturation")

    g = p.add_argument_group("cluster: prefill/decode disaggregation")
    g.add_argument("--prefill-instances", type=int, default=0, metavar="N",
                   help="prefill pool size: the first N instances (default 0: no disaggregation)")
    g.add_argument("--decode-instances", type=int, default=0, metavar="N",
                   help="decode pool size: the next N instances")
    g.add_argument("--prefill-decode-instances", type=int, default=0, metavar="N",
                   help="shared pods serving both roles: the next N instances, in both pools")
    g.add_argument("--pd-decider", choices=PD_DECIDERS, default="never",
                   help="which requests are disaggregated (default never)")
    g.add_argument("--pd-prefix-threshold", type=int, default=16, metavar="TOKENS",
                   help="prefix-threshold: disaggregate when more prompt tokens than this are not cached on "
                        "the chosen decode instance (default 16)")
    g.add_argument("--pd-transfer-bandwidth", type=float, default=25.0, metavar="GB_PER_S",
                   help="KV transfer bandwidth (default 25 GB/s)")
    g.add_argument("--pd-transfer-base-latency", type=float, default=0.05, metavar="MS",
                   help="KV transfer fixed latency (default 0.05 ms)")
    g.add_argument("--pd-transfer-contention", action="store_true",
                   help="concurrent transfers share the bandwidth")
    g.add_argument("--prefill-routing-scorers", default=None, metavar="NAME:W,...",
                   help="weighted routing inside the prefill pool (default: the routing policy)")
    g.add_argument("--decode-routing-scorers", default=None, metavar="NAME:W,...",
                   help="weighted routing inside the decode pool (default: the routing policy)")
    g.add_argument("--encode-instances", type=int, default=0, metavar="N",
                   help="E/P/D encode pool: the N instances after the PD pools; they serve nothing (default 0)")
    g.add_argument("--encode-decider", choices=ENCODE_DECIDERS, default="never",
                   help="which requests get an encode routing decision (zero time, with the routing policy): "
                        "never, always, or multimodal (image/audio/video tokens); with no encode instance "
                        "they are encode routing rejections (default never)")
    for pool in ("prefill", "decode"):
        g.add_argument(f"--{pool}-hardware", default=None, metavar="GPU",
                       help=f"GPU of the {pool} pool (default: --hardware); its KV blocks are re-derived "
                            "from it unless --total-kv-blocks is given")
        g.add_argument(f"--{pool}-tp", type=int, default=None, metavar="TP",
                       help=f"tensor-parallel degree of the {pool} pool (default: --tp)")
        g.add_argument(f"--{pool}-latency-model", default=None, metavar="BACKEND",
                       help=f"latency backend of the {pool} pool, trained-physics or roofline (default: "
                            "--latency-model)" + ("; shared prefill-decode pods use the decode pool's"
                                                  if pool == "decode" else ""))
        g.add_argument(f"--{pool}-max-model-len", type=int, default=0, metavar="TOKENS",
                       help=f"max-model-len of the {pool} pool (default 0: --max-model-len, else derived "
                            "from the pool's KV capacity)")

    g = p.add_argument_group("model, hardware and latency")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="HuggingFace model id of a bundled model, or a path to a HF config.json "
                        "(or its directory) or a blis-jax model YAML. BLIS requires --model; "
                        f"blis-jax defaults it to {DEFAULT_MODEL} (the embedded default scenario). "
                        f"Bundled: {', '.join(bundled_model_ids())}")
    g.add_argument("--hardware", default=None, metavar="GPU",
                   help=f"GPU name ({', '.join(bundled_gpu_names())}) or a GPU YAML path "
                        f"(default: the model's BLIS default, else {DEFAULT_HARDWARE})")
    g.add_argument("--tp", type=int, default=None,
                   help=f"tensor-parallel degree (default: the model's BLIS default, else {DEFAULT_TP}; "
                        "0 means default)")
    g.add_argument("--latency-model", choices=LATENCY_MODELS, default=None,
                   help="latency backend (default trained-physics)")
    g.add_argument("--alpha-coeffs", default=None, metavar="A0,A1,A2",
                   help="trained-physics alpha coefficients, comma-separated (3 values, µs; blis-jax "
                        "extension: a 4th, the first-token lag in steps, default 0 as in BLIS); "
                        "give together with --beta-coeffs")
    g.add_argument("--beta-coeffs", default=None, metavar="B0,...",
                   help="trained-physics beta coefficients, comma-separated (7 to 11 values); "
                        "give together with --alpha-coeffs")
    g.add_argument("--coefficients", default=None, metavar="FILE|NAME",
                   help="blis-jax extension: coefficient YAML (keys alpha, beta) or a shipped set by name "
                        "for trained-physics, instead of --alpha-coeffs/--beta-coeffs (default: "
                        "fit-trainval15-open-loop-lag, or $BLIS_JAX_COEFFICIENTS; BLIS's: iter29)")
    g.add_argument("--max-model-len", type=int, default=0, metavar="TOKENS",
                   help="maximum sequence length (default 0: max_position_embeddings with rope "
                        "scaling, capped at total KV blocks × block size)")

    g = p.add_argument_group("KV cache")
    g.add_argument("--total-kv-blocks", type=int, default=None, metavar="N",
                   help="KV blocks per instance (default: auto-computed from model, GPU memory, "
                        "TP and --gpu-memory-utilization)")
    g.add_argument("--block-size-in-tokens", type=int, default=16, metavar="N",
                   help="tokens per KV block (default 16)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="FRAC",
                   help="GPU memory fraction for weights + KV cache in auto-sizing (default 0.9)")
    g.add_argument("--kv-cpu-blocks", type=int, default=0, metavar="N",
                   help="legacy CPU KV tier: CPU blocks (default 0: no CPU tier)")
    g.add_argument("--kv-offload-threshold", type=float, default=0.9, metavar="FRAC",
                   help="accepted for BLIS compatibility; ignored, as BLIS ignores it")
    g.add_argument("--kv-transfer-bandwidth", type=float, default=100.0, metavar="BLOCKS_PER_US",
                   help="CPU tier reload bandwidth (default 100)")
    g.add_argument("--kv-transfer-base-latency", type=int, default=0, metavar="US",
                   help="CPU tier fixed cost per reloaded block (default 0)")
    g.add_argument("--kv-offload-config", default=None, metavar="FILE",
                   help="multi-tier KV offload YAML (top-level kv_offload:): a CPU staging tier and fs tiers "
                        "(per instance; mutually exclusive with --kv-cpu-blocks; a replayed trace's kv_offload "
                        "header block takes precedence)")
    g.add_argument("--defaults-filepath", default=None, metavar="FILE",
                   help="BLIS defaults.yaml: blis-jax reads only its kv_offload_devices (device classes for "
                        "--kv-offload-config, added to BLIS's shipped ones); its other presets are built in")

    g = p.add_argument_group("LoRA adapters")
    g.add_argument("--lora-config", default=None, metavar="FILE",
                   help="LoRA YAML (top-level lora:): adapter registry, capacity, load costs, step-overhead tiers")
    g.add_argument("--lora-adapter-capacity", type=int, default=None, metavar="N",
                   help="resident adapters per instance (overrides the file's adapter_capacity)")
    g.add_argument("--lora-load-base-latency-us", type=float, default=None, metavar="US",
                   help="fixed cost of a cold adapter load (default 1500)")
    g.add_argument("--lora-load-bandwidth-bytes-us", type=float, default=None, metavar="BYTES_PER_US",
                   help="adapter load bandwidth (default 2e6)")
    g.add_argument("--lora-footprint-bytes-per-rank", type=float, default=None, metavar="BYTES",
                   help="adapter HBM footprint per rank (default 2e6)")
    g.add_argument("--lora-scorer-weight", type=float, default=0.0, metavar="W",
                   help="adds the lora-affinity scorer with this weight to weighted routing (default 0: off)")

    g = p.add_argument_group("batch formation and scheduling")
    g.add_argument("--max-num-seqs", "--max-num-running-reqs", dest="max_num_seqs", type=int,
                   default=256, metavar="N", help="running-batch size limit (default 256)")
    g.add_argument("--max-num-batched-tokens", "--max-num-scheduled-tokens",
                   dest="max_num_batched_tokens", type=int, default=2048, metavar="N",
                   help="token budget per step (default 2048)")
    g.add_argument("--long-prefill-token-threshold", type=int, default=0, metavar="N",
                   help="per-request prefill chunk cap (default 0: none)")
    g.add_argument("--scheduler", choices=SCHEDULERS, default="fcfs",
                   help="wait-queue order (default fcfs)")
    g.add_argument("--preemption-policy", choices=PREEMPTION_POLICIES, default="fcfs",
                   help="preemption victim selection (default fcfs)")

    g = p.add_argument_group("outputs")
    g.add_argument("--metrics-path", default=None, metavar="FILE",
                   help="write the aggregate JSON (with cache_hit_rate) and per-request records")
    g.add_argument("--results-path", default=None, metavar="FILE",
                   help="write per-request results (completed requests) as JSON")
    g.add_argument("--trace-output", default=None, metavar="PREFIX",
                   help="write the simulated requests as a TraceV2: PREFIX.yaml + PREFIX.csv")


def add_memory_flag(g) -> None:
    g.add_argument("--max-memory-gib", type=float, default=None, metavar="GIB",
                   help=f"memory budget of the size checks made before simulating (requests, engine buffers, "
                        f"scenarios; default {limits.DEFAULT_BUDGET_GIB:g}): a larger input is refused up front")


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload (run only)")
    g.add_argument("--workload", choices=WORKLOADS, default="distribution",
                   help="distribution (the length flags below) or a named preset (default distribution)")
    g.add_argument("--rate", type=float, default=1.0, help="arrival rate, requests/s (default 1.0; "
                   "constant inter-arrival time)")
    g.add_argument("--workload-spec", default=None, metavar="FILE",
                   help="workload spec v2 YAML (overrides --workload; --seed, --horizon and --num-requests "
                        "override the spec; --timeout applies only when given)")
    g.add_argument("--num-requests", type=int, default=None, metavar="N",
                   help="requests to generate (default 100; 0 = bounded by --horizon only)")
    g.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="client timeout in seconds (default 300; negative disables; 0 is rejected)")
    g.add_argument("--prefix-tokens", type=int, default=None, metavar="N",
                   help="shared prefix tokens of every request (default 0)")
    for kind, dist in (("prompt", PROMPT_DEFAULT), ("output", OUTPUT_DEFAULT)):
        g.add_argument(f"--{kind}-tokens", type=float, default=None, metavar="MEAN",
                       help=f"{kind} length mean (default {dist.mean:g})")
        g.add_argument(f"--{kind}-tokens-stdev", type=float, default=None, metavar="STD",
                       help=f"{kind} length standard deviation (default {dist.std:g})")
        g.add_argument(f"--{kind}-tokens-min", type=int, default=None, metavar="N",
                       help=f"{kind} length minimum (default {dist.min})")
        g.add_argument(f"--{kind}-tokens-max", type=int, default=None, metavar="N",
                       help=f"{kind} length maximum (default {dist.max})")


def _add_replay_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("trace (replay only)")
    g.add_argument("--trace-header", required=True, metavar="FILE", help="TraceV2 header YAML")
    g.add_argument("--trace-data", required=True, metavar="FILE", help="TraceV2 request CSV")


def _add_log_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log", default="warn", choices=LOG_LEVELS, metavar="LEVEL",
                   help="stderr verbosity: warnings are printed at warn and below (default warn)")


def _add_spec_output_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", default=None, metavar="FILE",
                   help="blis-jax extension: write the spec YAML to FILE instead of stdout")


def _add_convert_parsers(sub) -> None:
    convert = sub.add_parser("convert", allow_abbrev=False, help="emit a workload spec v2 YAML",
                             description="Convert a preset or an inference-perf spec into a workload "
                                         "spec v2 (YAML on stdout), for run --workload-spec.")
    kinds = convert.add_subparsers(dest="convert_kind", metavar="{preset,inference-perf}")
    kinds.required = True
    preset = kinds.add_parser("preset", allow_abbrev=False, help="spec of a named workload preset",
                              description="Spec of a preset: constant arrivals at --rate, the preset's "
                                          "clamped-Gaussian lengths, 300 s client timeout (as run --workload).")
    preset.add_argument("--name", required=True, metavar="PRESET",
                        help=f"preset name ({', '.join(PRESETS)})")
    preset.add_argument("--rate", type=float, default=1.0, help="arrival rate, requests/s (default 1.0)")
    preset.add_argument("--num-requests", type=int, default=100, metavar="N",
                        help="requests to generate (default 100)")
    inference_perf = kinds.add_parser("inference-perf", allow_abbrev=False,
                                      help="expand an inference-perf spec into explicit clients",
                                      description="Expand the inference_perf section (stages + "
                                                  "shared_prefix) of a spec into explicit clients.")
    inference_perf.add_argument("--spec", required=True, metavar="FILE",
                                help="workload spec YAML with an inference_perf section")
    for p in (preset, inference_perf):
        _add_spec_output_flag(p)
        _add_log_flag(p)

    compose = sub.add_parser("compose", allow_abbrev=False, help="merge several workload specs into one",
                             description="Merge workload specs: aggregate rates add up and each spec's "
                                         "clients keep their own rates; category and seed from the first.")
    compose.add_argument("--from", dest="from_specs", action="append", required=True, metavar="FILE",
                         help="a workload spec YAML (repeat for each spec)")
    _add_spec_output_flag(compose)
    _add_log_flag(compose)


def _add_calibrate_parser(sub) -> None:
    p = sub.add_parser("calibrate", allow_abbrev=False,
                       help="compare an observed trace with the simulator's per-request results",
                       description="Compare the observed latencies of a TraceV2 (first/last chunk times) "
                                   "with the per-request results of replaying it (replay --results-path): "
                                   "MAPE, Pearson r, bias and quality per metric, written as JSON to --report.")
    g = p.add_argument_group("inputs and report")
    g.add_argument("--trace-header", required=True, metavar="FILE", help="observed TraceV2 header YAML")
    g.add_argument("--trace-data", required=True, metavar="FILE", help="observed TraceV2 request CSV")
    g.add_argument("--sim-results", required=True, metavar="FILE",
                   help="per-request results of replaying the trace (replay --results-path)")
    g.add_argument("--report", required=True, metavar="FILE", help="calibration report JSON to write")
    g = p.add_argument_group("pairing and network")
    g.add_argument("--warmup-requests", type=int, default=-1, metavar="N",
                   help="drop records with request_id < N (default -1: the header's warm_up_requests)")
    g.add_argument("--network-rtt-us", type=float, default=-1, metavar="US",
                   help="round-trip time added to simulated latencies (default -1: the header's "
                        "network.measured_rtt_ms, else 0)")
    g.add_argument("--network-bandwidth-mbps", type=float, default=0.0, metavar="MBPS",
                   help="client link bandwidth for upload/download delays, 4 bytes per token "
                        "(default 0: no transfer delay)")
    g = p.add_argument_group("checks")
    g.add_argument("--sim-metrics", default=None, metavar="FILE",
                   help="aggregate metrics of the replay (--metrics-path, with cache_hit_rate), compared "
                        "with the header's observed_kv_metrics.hit_rate")
    g.add_argument("--hit-rate-tolerance-pp", type=float, default=5.0, metavar="PP",
                   help="allowed |real − sim| KV hit-rate gap, percentage points (default 5)")
    g.add_argument("--ttft-mape-threshold", type=float, default=0.15, metavar="FRAC",
                   help="TTFT MAPE above this fraction is reported as a failed check (default 0.15)")
    _add_log_flag(p)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, allow_abbrev=False,
                     description="Vectorized LLM-serving simulator with BLIS's flags and outputs.")
    from blis_jax import __version__
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="do not use JAX's persistent compilation cache (default: on, in "
                             "$XDG_CACHE_HOME/blis-jax/jax-cache; env BLIS_JAX_COMPILE_CACHE=DIR or 0)")
    sub = parser.add_subparsers(dest="command",
                                metavar="{run,replay,convert,compose,calibrate,sweep,plan,fit,sensitivity,observe,models}",
                                parser_class=_Parser)
    sub.required = True
    run = sub.add_parser("run", allow_abbrev=False, help="generate a workload and simulate it",
                         description="Generate a workload (constant arrivals, clamped-Gaussian lengths "
                                     "or a preset) and simulate it. With no flags: 100 requests at 1 req/s "
                                     f"on {DEFAULT_MODEL}, H100, TP 1, trained-physics.")
    _add_run_flags(run)
    _add_shared_flags(run)
    replay = sub.add_parser("replay", allow_abbrev=False, help="simulate the requests of a TraceV2",
                            description="Simulate the requests of a TraceV2 trace (header YAML + CSV).")
    _add_replay_flags(replay)
    _add_shared_flags(replay)
    _add_convert_parsers(sub)
    _add_calibrate_parser(sub)
    _add_delegated_parsers(sub)
    models = sub.add_parser("models", allow_abbrev=False, help="list the bundled models and GPUs",
                            description="List the bundled model ids (for --model) and GPU names (--hardware).")
    _add_log_flag(models)
    return parser


# Subcommands whose flags and output live in their own module of this package (imported when
# the parser is built: they import this module): module → (its parser adder, command → function).
_DELEGATED = {"sweep": ("add_parsers", {"sweep": "cmd_sweep", "plan": "cmd_plan"}),
              "fit": ("add_parser", {"fit": "cmd_fit"}),
              "sensitivity": ("add_parser", {"sensitivity": "cmd_sensitivity"}),
              "observe": ("add_parser", {"observe": "cmd_observe"})}


def _add_delegated_parsers(sub) -> None:
    for module, (adder, _) in _DELEGATED.items():
        getattr(importlib.import_module(f"blis_jax.cli.{module}"), adder)(sub)


def _delegated_commands() -> dict[str, Callable]:
    def command(module: str, function: str) -> Callable:
        def run(args, stdout: TextIO, stderr: TextIO, diag: Diagnostics) -> int:
            return getattr(importlib.import_module(f"blis_jax.cli.{module}"), function)(args, stdout, stderr, diag)
        return run

    return {name: command(module, function)
            for module, (_, functions) in _DELEGATED.items() for name, function in functions.items()}


# ---------------------------------------------------------------------------- diagnostics


@dataclasses.dataclass
class Diagnostics:
    """stderr output: warnings (suppressed above --log warn) and progress lines."""

    stream: TextIO
    level: str = "warn"

    def warn(self, message: str) -> None:
        if self.level in ("trace", "debug", "info", "warn", "warning"):
            self.stream.write(f"{PROG}: warning: {_one_line(message)}\n")
            self.stream.flush()

    def log(self, level: str, message: str) -> None:
        """An info, warning or error line, shown from that --log level on."""
        shown = {"info": ("trace", "debug", "info"), "warning": ("trace", "debug", "info", "warn", "warning")}
        if level == "error" or self.level in shown.get(level, ()):
            self.stream.write(f"{PROG}: {level}: {_one_line(message)}\n")
            self.stream.flush()


class ProgressReporter:
    """Engine progress callback: `done/total requests, simulated s, wall s` on stderr.

    On a terminal the line is rewritten in place and appears only once the run has taken
    `PROGRESS_DELAY_S`; with `--progress` on a non-terminal every report is its own line.
    """

    def __init__(self, stream: TextIO, tty: bool) -> None:
        self.stream, self.tty = stream, tty
        self.start = time.monotonic()
        self.printed = False

    def __call__(self, done: int, total: int, sim_time_us: int) -> None:
        wall = time.monotonic() - self.start
        if self.tty and wall < PROGRESS_DELAY_S:
            return
        line = (f"{PROG}: progress: {done}/{total} requests finished, "
                f"simulated {sim_time_us / 1e6:.1f} s, wall {wall:.1f} s")
        self.stream.write(f"\r{line}\x1b[K" if self.tty else line + "\n")
        self.stream.flush()
        self.printed = True

    def close(self) -> None:
        if self.tty and self.printed:
            self.stream.write("\n")
            self.stream.flush()


MAX_MESSAGE = 300  # an error line longer than this is cut (offending values are already shortened)


def _one_line(message: str) -> str:
    text = "; ".join(part.strip() for part in str(message).splitlines() if part.strip())
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE - 3] + "..."



# ------------------------------------------------------------------------------- commands


def _seed_given(args) -> bool:
    return not isinstance(args.seed, DefaultSeed)


def resolve_command(args, diag: Diagnostics) -> ResolvedScenario:
    """`run`'s or `replay`'s flags → the resolved scenario; errors name the flags."""
    with naming(FLAG_OF_FIELD):
        config = scenario_config(args, seed_given=_seed_given(args))
        if config.policy_config is not None:   # BLIS: a typed flag wins over the bundle, even at its default
            config = apply_policy_bundle(config, diag.warn, explicit=scenario_flags.given_fields(args))
        return resolve(config, warn=diag.warn)


def simulate_command(resolved: ResolvedScenario, args, stderr: TextIO, diag: Diagnostics | None = None
                     ) -> SimulationResult:
    """Simulate with a progress reporter when stderr is a terminal or --progress."""
    tty = bool(getattr(stderr, "isatty", lambda: False)())
    reporter = ProgressReporter(stderr, tty) if (tty or args.progress) else None
    extra = {"progress": reporter, "events_per_chunk": PROGRESS_EVENTS_PER_CHUNK} if reporter else {}
    if diag is not None:
        extra["warn"] = diag.warn
    try:
        with naming(FLAG_OF_FIELD):
            result = simulate(resolved, **extra)
    finally:
        if reporter is not None:
            reporter.close()
    if diag is not None:   # what the autoscaler did (BLIS logs it and reports it nowhere else)
        for when, level, message in result.output.cluster_log:
            diag.log(level, f"{message} (at {when / 1e6:.6f} s)")
    return result


def write_outputs(args, result: SimulationResult, stdout: TextIO) -> None:
    stdout.write(result.report())
    stdout.flush()
    if args.metrics_path:
        result.write_metrics(args.metrics_path)
    if args.results_path:
        result.write_results(args.results_path)
    if args.trace_output:
        result.write_trace(args.trace_output)


def cmd_run(args, stdout: TextIO, stderr: TextIO, diag: Diagnostics) -> int:
    _check_output_paths(args)
    write_outputs(args, simulate_command(resolve_command(args, diag), args, stderr, diag), stdout)
    return 0


cmd_replay = cmd_run   # the flags say which workload: --trace-header/--trace-data or run's own


def _check_output_paths(args) -> None:
    """Fail before simulating when an output cannot be written."""
    for flag, value in (("--metrics-path", args.metrics_path), ("--results-path", args.results_path),
                        ("--trace-output", args.trace_output)):
        _check_output_file(flag, value)


def resolve_scenario(args, diag: Diagnostics, horizon_us: int | None) -> ResolvedScenario:
    """The deployment of `run`'s or `replay`'s flags, without requests, at `horizon_us`."""
    with naming(FLAG_OF_FIELD):
        config = scenario_flags.scenario_config(args, seed_given=_seed_given(args))
        return resolve_deployment(config, horizon_us=horizon_us, warn=diag.warn)


def _check_output_file(flag: str, value: str | None) -> None:
    if value is None:
        return
    if value == "":
        raise ConfigError(f"{flag}: empty path; give a file name or omit the flag")
    parent = Path(value).parent
    if not parent.is_dir():
        raise ConfigError(f"{flag} {value}: directory {str(parent)!r} does not exist; create it first")


def _load_spec_file(flag: str, path: str):
    from blis_jax.workload.spec import load_spec

    try:
        return load_spec(path)
    except ConfigError as e:
        # load_spec's messages name run's flag; name this command's flag instead.
        message, run_flag = str(e), "--workload-spec "
        raise ConfigError(f"{flag} {message[len(run_flag):]}" if message.startswith(run_flag) else message) from None


def _emit_spec(spec, output: str | None, stdout: TextIO) -> None:
    from blis_jax.workload.convert import dump_spec

    text = dump_spec(spec)
    if output:
        atomic_write_text(output, text)
    else:
        stdout.write(text)
        stdout.flush()


def cmd_convert(args, stdout: TextIO, stderr: TextIO, diag: Diagnostics) -> int:
    from blis_jax.workload.convert import convert_inference_perf, convert_preset

    _check_output_file("--output", args.output)
    if args.convert_kind == "preset":
        spec = convert_preset(args.name, rate=args.rate, num_requests=args.num_requests)
    else:
        source = _load_spec_file("--spec", args.spec)
        try:
            spec = convert_inference_perf(source)
        except ConfigError as e:
            raise ConfigError(f"--spec {args.spec}: {e}") from None
    _emit_spec(spec, args.output, stdout)
    return 0


def cmd_compose(args, stdout: TextIO, stderr: TextIO, diag: Diagnostics) -> int:
    from blis_jax.workload.convert import compose

    _check_output_file("--output", args.output)
    specs = [_load_spec_file("--from", path) for path in args.from_specs]
    try:
        spec = compose(specs)
    except ConfigError as e:
        message = str(e)
        for i, path in enumerate(args.from_specs):  # compose names inputs by position
            message = message.replace(f"from[{i}]", f"--from {path}")
        raise ConfigError(message) from None
    _emit_spec(spec, args.output, stdout)
    return 0


def _header_rtt_us(header: TraceHeader) -> float:
    """network.measured_rtt_ms of a trace header, in µs (0 when absent)."""
    network = header.extra.get("network") or {}
    value = network.get("measured_rtt_ms") if isinstance(network, dict) else None
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"trace header network.measured_rtt_ms: {value!r} must be a number ≥ 0 "
                          "(or pass --network-rtt-us)")
    return float(value) * 1000.0


def _observed_hit_rate(header: TraceHeader, diag: Diagnostics) -> float | None:
    observed = header.extra.get("observed_kv_metrics") or {}
    value = observed.get("hit_rate") if isinstance(observed, dict) else None
    if value is None:
        diag.warn("--sim-metrics given but the trace header has no observed_kv_metrics.hit_rate; "
                  "the KV hit-rate comparison is skipped")
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ConfigError(f"trace header observed_kv_metrics.hit_rate: {value!r} must be a fraction in [0, 1]")
    return float(value)


def cmd_calibrate(args, stdout: TextIO, stderr: TextIO, diag: Diagnostics) -> int:
    from blis_jax import calibrate
    from blis_jax.output import go_json

    _check_output_file("--report", args.report)
    if args.warmup_requests < -1:
        raise ConfigError(f"--warmup-requests {args.warmup_requests}: must be ≥ 0 (-1 = the trace header's)")
    rtt = args.network_rtt_us
    if not math.isfinite(rtt) or (rtt < 0 and rtt != -1):
        raise ConfigError(f"--network-rtt-us {rtt:g}: must be ≥ 0 µs (-1 = the trace header's)")
    for flag, value in (("--network-bandwidth-mbps", args.network_bandwidth_mbps),
                        ("--hit-rate-tolerance-pp", args.hit_rate_tolerance_pp),
                        ("--ttft-mape-threshold", args.ttft_mape_threshold)):
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"{flag} {value:g}: must be a number ≥ 0")
    header, requests = read_trace(args.trace_header, args.trace_data)
    observed = calibrate.observed_from_trace(requests, source=f"--trace-data {args.trace_data}")
    sim = calibrate.read_sim_results(args.sim_results)
    warmup = header.warm_up_requests if args.warmup_requests == -1 else args.warmup_requests
    network = calibrate.NetworkModel(rtt_us=_header_rtt_us(header) if rtt == -1 else rtt,
                                     bandwidth_mbps=args.network_bandwidth_mbps)
    hit_rates = None
    if args.sim_metrics:
        sim_hit_rate = calibrate.read_sim_hit_rate(args.sim_metrics)
        real_hit_rate = _observed_hit_rate(header, diag)
        hit_rates = None if real_hit_rate is None else (real_hit_rate, sim_hit_rate)
    pairs = calibrate.pair_records(observed, sim, warmup_requests=warmup, network=network)
    report = calibrate.calibration_report(
        pairs, network, goodput_targets=header.goodput_slo_targets, hit_rates=hit_rates,
        hit_rate_tolerance_pp=args.hit_rate_tolerance_pp, ttft_mape_threshold=args.ttft_mape_threshold)
    atomic_write_text(args.report, go_json(report) + "\n")
    stdout.write(calibrate.format_summary(report))
    stdout.flush()
    if not report["checks"]["ttft_mape_within_threshold"]:
        diag.warn(f"TTFT MAPE {report['metrics']['ttft']['mape']} exceeds --ttft-mape-threshold "
                  f"{args.ttft_mape_threshold:g}")
    if pairs.unmatched_real:
        diag.warn(f"{pairs.unmatched_real} observed ok record(s) have no simulated result (timed out, "
                  "dropped or cut by the horizon in the simulation) and are not compared")
    return 0


def cmd_models(args, stdout: TextIO, stderr: TextIO, diag: Diagnostics) -> int:
    stdout.write("models (--model):\n" + "".join(f"  {m}\n" for m in bundled_model_ids()))
    stdout.write("GPUs (--hardware):\n" + "".join(f"  {g}\n" for g in bundled_gpu_names()))
    stdout.flush()
    return 0


COMMANDS: dict[str, Callable] = {"run": cmd_run, "replay": cmd_replay, "convert": cmd_convert,
                                 "compose": cmd_compose, "calibrate": cmd_calibrate, "models": cmd_models,
                                 **_delegated_commands()}


# Commands whose programs run on one device: their CPU backend gets a one-thread execution pool
# (cpu_backend.py). Not sweep/plan (one CPU device per core), nor the commands that simulate nothing
# (calibrate compares numbers on the host).
ONE_DEVICE_COMMANDS = frozenset({"run", "replay", "fit", "sensitivity"})


def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None,
         stderr: TextIO | None = None) -> int:
    """Entry point of `blis-jax` / `python -m blis_jax`. Returns the exit code (0 success,
    2 bad flags or input, 1 the engine could not finish)."""
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    parser = build_parser()
    try:
        raw = list(sys.argv[1:] if argv is None else argv)
        args = parser.parse_args(raw)
        args.given_flags = frozenset(t[2:].split("=", 1)[0] for t in raw if t.startswith("--"))
    except UsageError as e:
        stderr.write(f"{e.prog}: error: {_one_line(str(e))} (see {e.prog} --help)\n")
        return EXIT_USAGE
    except SystemExit as e:  # --help / --version
        return int(e.code or 0)
    diag = Diagnostics(stderr, level=getattr(args, "log", "warn"))
    if argv is None and not args.no_compile_cache:  # a real command line, not a library call
        from blis_jax.compile_cache import enable_compile_cache

        enable_compile_cache(diag)
    try:
        _check_flag_numbers(args)
        limits.configure(getattr(args, "max_memory_gib", None))
        check_command_paths(args.command, args)  # no output overwrites an input or another output
        if argv is None and args.command in ONE_DEVICE_COMMANDS:  # a fresh process, before JAX starts
            from blis_jax.cpu_backend import start_single_thread_cpu_backend

            start_single_thread_cpu_backend()
        return COMMANDS[args.command](args, stdout, stderr, diag)
    except ConfigError as e:
        stderr.write(f"{PROG} {args.command}: error: {_one_line(str(e))}\n")
        return EXIT_USAGE
    except BrokenPipeError:  # e.g. `blis-jax run | head`: the reader left, nothing to report
        _silence_stdout()
        return EXIT_FAILURE
    except OSError as e:
        where = f" {short(str(e.filename), 80)}:" if e.filename else ""
        stderr.write(f"{PROG} {args.command}: error:{where} {_one_line(e.strerror or str(e))}\n")
        return EXIT_USAGE
    except SimulationFailed as e:
        stderr.write(f"{PROG} {args.command}: error: {_one_line(str(e))}\n")
        return EXIT_FAILURE
    except (OverflowError, RecursionError, UnicodeError, MemoryError) as e:
        # A backstop: an input value beyond what some check foresaw. Still one line, no traceback.
        stderr.write(f"{PROG} {args.command}: error: an input is out of range ({type(e).__name__}: "
                     f"{_one_line(str(e))[:120]}); check the sizes and numbers given, and please report "
                     "the command line\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        stderr.write(f"\n{PROG} {args.command}: interrupted\n")
        return 130


def _check_flag_numbers(args) -> None:
    """Every numeric flag: an integer fits int64, a real number is finite (argparse accepts
    `inf`, `nan` and 30-digit integers; each would fail later with a traceback or overflow)."""
    for name, value in vars(args).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            continue
        if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
            raise ConfigError(f"{flag} {short(str(value), 24)}: beyond 64-bit integers; give a value below 2^63")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{flag} {value}: must be a finite number")


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def console_main() -> NoReturn:
    sys.exit(main())


if __name__ == "__main__":
    console_main()
