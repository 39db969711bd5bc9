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
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn, TextIO

from blis_jax.config import (
    auto_kv_blocks,
    auto_max_model_len,
    bundled_gpu_names,
    bundled_model_ids,
    load_coefficients,
    load_gpu,
    load_model,
)
from blis_jax.config.coefficients import check_alpha, check_beta
from blis_jax.config.kv_capacity import kv_bytes_per_token
from blis_jax.cluster.admission import ADMISSION_POLICIES
from blis_jax.cluster.deployments import PoolDeployment
from blis_jax.cluster.gateway import DISPATCH_ORDERS, FAIRNESS_POLICIES, SATURATION_DETECTORS, FlowControlConfig
from blis_jax.cluster.pd import PD_DECIDERS
from blis_jax.cluster.routing import ROUTING_POLICIES
from blis_jax.cluster.scorers import DEFAULT_PROFILE, SCORERS
from blis_jax.cluster.simulate import ClusterConfig, simulate_cluster_views
from blis_jax.engine import results as result_codes
from blis_jax.engine.dims import PREEMPTION_POLICIES, SCHEDULERS
from blis_jax.engine.params import make_engine_params
from blis_jax.engine.simulate import simulate_instance, simulate_sessions
from blis_jax import limits
from blis_jax.errors import ConfigError
from blis_jax.io_safety import atomic_write_text, check_command_paths, short
from blis_jax.latency import build_latency_model
from blis_jax.output import (
    format_pd_section,
    pd_summary,
    pd_trace_outcomes,
    render_stdout,
    write_metrics_file,
    write_results_file,
)
from blis_jax.workload.distribution import (
    DEFAULT_TIMEOUT_S,
    OUTPUT_DEFAULT,
    constant_iat_us,
    PROMPT_DEFAULT,
    DistributionWorkload,
    GaussianLength,
    generate_distribution,
)
from blis_jax.workload.presets import PRESETS, preset_workload
from blis_jax.workload.requests import RequestSet
from blis_jax.workload.tracev2 import TraceHeader, read_trace, write_trace

PROG = "blis-jax"
EXIT_USAGE = 2  # bad flags or input data
EXIT_FAILURE = 1  # the simulation itself could not finish

DEFAULT_MODEL = "meta-llama/llama-3.1-8b-instruct"
DEFAULT_HARDWARE = "H100"
DEFAULT_TP = 1
LATENCY_MODELS = ("trained-physics", "roofline")
WORKLOADS = ("distribution", *PRESETS)
LOG_LEVELS = ("trace", "debug", "info", "warn", "warning", "error", "fatal", "panic")
# BLIS `--total-kv-blocks` default: a phantom value used only when auto-sizing fails.
PHANTOM_KV_BLOCKS = 1_000_000
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
PROGRESS_DELAY_S = 2.0  # on a terminal, progress appears once a run has taken this long
PROGRESS_EVENTS_PER_CHUNK = 5_000  # engine events between progress reports

# BLIS `defaults.yaml` → `defaults:` (GPU, tensor_parallelism) per lower-cased model id; used
# when --hardware / --tp are not given. Every entry of that table, not only bundled models.
MODEL_DEFAULTS: dict[str, tuple[str, int]] = {
    "ibm-granite/granite-3.1-8b-instruct": ("H100", 1),
    "meta-llama/llama-3.1-8b-instruct": ("H100", 1),
    "meta-llama/llama-3.3-70b-instruct": ("H100", 4),
    "meta-llama/llama-4-maverick-17b-128e-instruct-fp8": ("H100", 8),
    "codellama/codellama-34b-instruct-hf": ("H100", 2),
    "meta-llama/llama-4-scout-17b-16e-instruct": ("H100", 4),
    "microsoft/phi-4": ("H100", 1),
    "mistralai/mistral-small-24b-instruct-2501": ("H100", 1),
    "mistralai/mistral-small-3.1-24b-instruct-2503": ("H100", 1),
    "nvidia/llama-3.1-nemotron-70b-instruct-hf": ("H100", 4),
    "openai/gpt-oss-120b": ("H100", 4),
    "openai/gpt-oss-20b": ("H100", 1),
    "qwen/qwen2.5-3b-instruct": ("H100", 1),
    "qwen/qwen3-14b": ("H100", 1),
    "qwen/qwen2.5-7b-instruct": ("H100", 1),
    "redhatai/llama-3.1-nemotron-70b-instruct-hf-fp8-dynamic": ("H100", 2),
    "redhatai/llama-3.3-70b-instruct-quantized.w4a16": ("H100", 1),
    "redhatai/llama-3.3-70b-instruct-quantized.w8a8": ("H100", 2),
    "redhatai/llama-4-scout-17b-16e-instruct-fp8-dynamic": ("H100", 2),
    "redhatai/llama-4-scout-17b-16e-instruct-quantized.w4a16": ("H100", 1),
    "redhatai/mistral-small-3.1-24b-instruct-2503-fp8-dynamic": ("H100", 1),
    "redhatai/mistral-small-3.1-24b-instruct-2503-quantized.w4a16": ("H100", 1),
    "redhatai/mistral-small-3.1-24b-instruct-2503-quantized.w8a8": ("H100", 1),
    "redhatai/phi-4-fp8-dynamic": ("H100", 1),
    "redhatai/phi-4-quantized.w4a16": ("H100", 1),
    "redhatai/phi-4-quantized.w8a8": ("H100", 1),
    "redhatai/qwen2.5-7b-instruct-fp8-dynamic": ("H100", 1),
    "redhatai/qwen2.5-7b-instruct-quantized.w4a16": ("H100", 1),
    "redhatai/qwen2.5-7b-instruct-quantized.w8a8": ("H100", 1),
    "redhatai/smollm3-3b-fp8-dynamic": ("H100", 1),
}


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
    for pool in ("prefill", "decode"):
        g.add_argument(f"--{pool}-hardware", default=None, metavar="GPU",
                       help=f"GPU of the {pool} pool (default: --hardware); its KV blocks are re-derived "
                            "from it unless --total-kv-blocks is given")
        g.add_argument(f"--{pool}-tp", type=int, default=None, metavar="TP",
                       help=f"tensor-parallel degree of the {pool} pool (default: --tp)")
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
    g.add_argument("--coefficients", default=None, metavar="FILE",
                   help="blis-jax extension: coefficient YAML (keys alpha, beta; e.g. fits/*.yaml) "
                        "for trained-physics, instead of --alpha-coeffs/--beta-coeffs")
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
    _add_sweep_parsers(sub)
    _add_fit_parser(sub)
    _add_sensitivity_parser(sub)
    _add_observe_parser(sub)
    models = sub.add_parser("models", allow_abbrev=False, help="list the bundled models and GPUs",
                            description="List the bundled model ids (for --model) and GPU names (--hardware).")
    _add_log_flag(models)
    return parser


def _add_sweep_parsers(sub) -> None:
    # Imported here, not at the top: the sweep package resolves its scenarios through this module.
    from blis_jax.sweep import commands

    commands.add_parsers(sub)


def cmd_sweep(args, stdout: TextIO, stderr: TextIO, diag: Diagnostics) -> int:
    from blis_jax.sweep import commands

    return commands.cmd_sweep(args, stdout, stderr, diag)


def cmd_plan(args, stdout: TextIO, stderr: TextIO, diag: Diagnostics) -> int:
    from blis_jax.sweep import commands

    return commands.cmd_plan(args, stdout, stderr, diag)


def _add_fit_parser(sub) -> None:
    from blis_jax.fit import commands  # flags and logic live in blis_jax/fit/

    commands.add_parser(sub)


def cmd_fit(args, stdout: TextIO, stderr: TextIO, diag: Diagnostics) -> int:
    from blis_jax.fit import commands

    return commands.cmd_fit(args, stdout, stderr, diag)


def _add_sensitivity_parser(sub) -> None:
    from blis_jax.fit import sensitivity_commands  # flags and logic live in blis_jax/fit/

    sensitivity_commands.add_parser(sub)


def cmd_sensitivity(args, stdout: TextIO, stderr: TextIO, diag: Diagnostics) -> int:
    from blis_jax.fit import sensitivity_commands

    return sensitivity_commands.cmd_sensitivity(args, stdout, stderr, diag)


def _add_observe_parser(sub) -> None:
    from blis_jax.observe import commands  # flags and logic live in blis_jax/observe/

    commands.add_parser(sub)


def cmd_observe(args, stdout: TextIO, stderr: TextIO, diag: Diagnostics) -> int:
    from blis_jax.observe import commands

    return commands.cmd_observe(args, stdout, stderr, diag)


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



# --------------------------------------------------------------------------- configuration


@dataclasses.dataclass(frozen=True)
class Scenario:
    """Everything but the requests: the resolved configuration of one simulation."""

    latency_model: object
    model_id: str
    hardware: str
    tp: int
    latency_kind: str
    total_kv_blocks: int
    max_model_len: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int
    scheduler: str
    preemption_policy: str
    horizon_us: int | None
    cluster: ClusterConfig = ClusterConfig()
    kv_bytes_per_token: float = 0.0  # per GPU (sizes PD KV transfers)
    prefill_pool: PoolDeployment | None = None  # PD pools on their own hardware / TP
    decode_pool: PoolDeployment | None = None

    @property
    def single_instance(self) -> bool:
        """Served by the single-instance engine: one instance that admits every request at its
        arrival (no admission or routing latency, no gateway queue)."""
        c = self.cluster
        return (c.num_instances == 1 and c.admission_policy == "always-admit" and c.flow_control is None
                and c.admission_latency_us == 0 and c.routing_latency_us == 0)


def cluster_config(args) -> ClusterConfig:
    """The cluster flags, validated (errors name the flag)."""
    if args.num_instances < 1:
        raise ConfigError(f"--num-instances {args.num_instances}: must be >= 1")
    if args.routing_scorers is not None and args.routing_policy != "weighted":
        raise ConfigError(f"--routing-scorers is used by --routing-policy weighted only, but the policy is "
                          f"{args.routing_policy}; add --routing-policy weighted or drop --routing-scorers")
    return ClusterConfig(
        num_instances=args.num_instances, routing_policy=args.routing_policy, routing_scorers=args.routing_scorers,
        admission_policy=args.admission_policy, token_bucket_capacity=args.token_bucket_capacity,
        token_bucket_refill_rate=args.token_bucket_refill_rate,
        tier_shed_threshold=args.tier_shed_threshold, tier_shed_min_priority=args.tier_shed_min_priority,
        queue_depth_threshold=args.queue_depth_threshold, kv_cache_util_threshold=args.kv_cache_util_threshold,
        snapshot_refresh_interval_us=args.snapshot_refresh_interval, cache_signal_delay_us=args.cache_signal_delay,
        admission_latency_us=args.admission_latency, routing_latency_us=args.routing_latency, seed=int(args.seed),
        prefill_instances=args.prefill_instances, decode_instances=args.decode_instances,
        pd_decider=args.pd_decider, pd_prefix_threshold=args.pd_prefix_threshold,
        pd_transfer_bandwidth=args.pd_transfer_bandwidth, pd_transfer_base_latency=args.pd_transfer_base_latency,
        pd_transfer_contention=args.pd_transfer_contention,
        prefill_routing_scorers=args.prefill_routing_scorers, decode_routing_scorers=args.decode_routing_scorers,
        flow_control=_flow_control(args),
    ).validate()


def _flow_control(args) -> FlowControlConfig | None:
    names = ("saturation_detector", "dispatch_order", "fairness_policy", "slo_targets", "max_gateway_queue_depth",
             "per_band_capacity", "queue_shedding", "usage_limit_threshold", "max_concurrency",
             "in_flight_eviction")
    config = FlowControlConfig(**{name: getattr(args, name) for name in names}, request_ttl_us=args.request_ttl,
                               dispatch_tick_interval_us=args.dispatch_tick_interval)
    if not args.flow_control:
        if config != FlowControlConfig():
            raise ConfigError("the gateway-queue flags (--saturation-detector, --dispatch-order, ...) need "
                              "--flow-control")
        return None
    return config


def parse_coefficients(flag: str, text: str) -> tuple[float, ...]:
    """A comma-separated list of finite numbers; the error names the flag and position."""
    values = []
    for i, part in enumerate(text.split(",")):
        part = part.strip()
        try:
            value = float(part)
        except ValueError:
            raise ConfigError(f"{flag}: value {i + 1} ({part!r}) is not a number; give a "
                              "comma-separated list such as 15563.2,777.35,45.91") from None
        if not math.isfinite(value):
            raise ConfigError(f"{flag}: value {i + 1} is {part}; coefficients must be finite numbers")
        values.append(value)
    return tuple(values)


def _latency_coefficients(args) -> tuple[str, tuple | None, tuple | None]:
    """(kind, alpha, beta) from --latency-model, --alpha/--beta-coeffs and --coefficients."""
    given_alpha, given_beta = args.alpha_coeffs is not None, args.beta_coeffs is not None
    if given_alpha != given_beta:
        missing = "--beta-coeffs" if given_alpha else "--alpha-coeffs"
        present = "--alpha-coeffs" if given_alpha else "--beta-coeffs"
        raise ConfigError(f"{present} needs {missing} too: give both coefficient lists or neither")
    if args.coefficients is not None and given_alpha:
        raise ConfigError("--coefficients and --alpha-coeffs/--beta-coeffs both set; use one source")
    kind = args.latency_model or "trained-physics"
    if kind == "roofline" and (given_beta or args.coefficients is not None):
        flag = "--beta-coeffs" if given_beta else "--coefficients"
        raise ConfigError(f"{flag} is for trained-physics only, but --latency-model is roofline; "
                          "drop it or use --latency-model trained-physics")
    if given_alpha:
        alpha = parse_coefficients("--alpha-coeffs", args.alpha_coeffs)
        beta = parse_coefficients("--beta-coeffs", args.beta_coeffs)
        for flag, check, values in (("--alpha-coeffs", check_alpha, alpha), ("--beta-coeffs", check_beta, beta)):
            try:
                check(values)
            except ConfigError as e:
                raise ConfigError(f"{flag}: {e}") from None
        return kind, alpha, beta
    if args.coefficients is not None:
        coeffs = load_coefficients(args.coefficients)
        return kind, coeffs.alpha, coeffs.beta
    return kind, None, None


def _hardware_and_tp(args, hf_id: str) -> tuple[str, int]:
    defaults = MODEL_DEFAULTS.get(hf_id.lower()) or MODEL_DEFAULTS.get(str(args.model).lower())
    for flag, value in (("--hardware", args.hardware), ("--prefill-hardware", args.prefill_hardware),
                        ("--decode-hardware", args.decode_hardware)):
        if value is not None and not value.strip():
            raise ConfigError(f"{flag}: empty GPU name; give a bundled GPU (e.g. H100) or a GPU YAML path, "
                              "or omit the flag")
    hardware = args.hardware or (defaults[0] if defaults else DEFAULT_HARDWARE)
    if args.tp is not None and args.tp < 0:
        raise ConfigError(f"--tp {args.tp}: the tensor-parallel degree must be >= 1 (0 = model default)")
    tp = args.tp if args.tp else (defaults[1] if defaults else DEFAULT_TP)
    return hardware, tp


def _kv_blocks(args, arch, gpu, tp: int, diag: Diagnostics) -> int:
    if args.total_kv_blocks is not None:
        if args.total_kv_blocks < 1:
            raise ConfigError(f"--total-kv-blocks {args.total_kv_blocks}: must be >= 1 "
                              "(omit it to auto-size from GPU memory)")
        limits.check_int("--total-kv-blocks", args.total_kv_blocks, 1, limits.MAX_KV_BLOCKS,
                         " (block ids are 32-bit; raise --block-size-in-tokens instead)")
        return args.total_kv_blocks
    try:
        return auto_kv_blocks(arch, gpu, tp, gpu_memory_utilization=args.gpu_memory_utilization,
                              block_size=args.block_size_in_tokens)
    except ConfigError as e:
        # BLIS: an over-committed GPU is fatal; any other auto-sizing failure falls back to
        # the phantom --total-kv-blocks default with a warning.
        if "do not fit" in str(e) or "divisible" in str(e):
            raise
        diag.warn(f"KV blocks could not be auto-computed ({e}); using --total-kv-blocks "
                  f"{PHANTOM_KV_BLOCKS}. Pass --total-kv-blocks to set it")
        return PHANTOM_KV_BLOCKS


def resolve_scenario(args, diag: Diagnostics, horizon_us: int | None) -> Scenario:
    """Validate the shared flags and build the latency model and engine limits."""
    cluster = cluster_config(args)
    if not INT64_MIN <= args.seed <= INT64_MAX:
        raise ConfigError(f"--seed {args.seed}: must fit in a signed 64-bit integer")
    if args.horizon is not None and args.horizon <= 0:
        raise ConfigError(f"--horizon {args.horizon}: must be > 0 µs (omit it for no horizon)")
    if args.block_size_in_tokens < 1:
        raise ConfigError(f"--block-size-in-tokens {args.block_size_in_tokens}: must be >= 1")
    limits.check_int("--block-size-in-tokens", args.block_size_in_tokens, 1, limits.MAX_BLOCK_SIZE,
                     " tokens (vLLM uses 16 to 256)")
    limits.check_int("--max-model-len", args.max_model_len, 0, limits.MAX_TOKENS, " tokens (0 = auto)")
    limits.check_int("--max-num-batched-tokens", args.max_num_batched_tokens, 1, limits.MAX_TOKENS)
    util = args.gpu_memory_utilization
    if not (math.isfinite(util) and 0.0 < util <= 1.0):
        raise ConfigError(f"--gpu-memory-utilization {util}: must be in (0, 1], e.g. 0.9")

    kind, alpha, beta = _latency_coefficients(args)
    arch = load_model(args.model)  # ids are matched case-insensitively, as BLIS lower-cases them
    hardware, tp = _hardware_and_tp(args, arch.hf_id)
    gpu = load_gpu(hardware)
    try:
        latency_model = build_latency_model(kind, arch, gpu, tp, alpha=alpha, beta=beta)
    except ConfigError as e:
        raise ConfigError(f"--latency-model {kind}: {e}") from None

    block = args.block_size_in_tokens
    blocks = _kv_blocks(args, arch, gpu, tp, diag)
    max_model_len = _max_model_len("--max-model-len", args.max_model_len, arch, blocks, block)
    pools = {pool: _pool_deployment(args, pool, cluster, arch, kind, alpha, beta, gpu, tp, diag)
             for pool in ("prefill", "decode")}
    return Scenario(
        latency_model=latency_model, model_id=arch.hf_id, hardware=gpu.name, tp=tp,
        latency_kind=kind, total_kv_blocks=blocks, max_model_len=max_model_len, block_size=block,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        scheduler=args.scheduler, preemption_policy=args.preemption_policy, horizon_us=horizon_us,
        cluster=cluster, kv_bytes_per_token=kv_bytes_per_token(arch, tp),
        prefill_pool=pools["prefill"], decode_pool=pools["decode"],
    )


def _max_model_len(flag: str, value: int, arch, blocks: int, block: int) -> int:
    """An explicit max-model-len (checked against the KV capacity), else BLIS's auto value."""
    if value < 0:
        raise ConfigError(f"{flag} {value}: must be >= 0 (0 = auto)")
    if value == 0:
        return auto_max_model_len(arch, blocks, block)
    needed = -(-value // block)
    if needed > blocks:
        raise ConfigError(f"{flag} {value} needs {needed} KV blocks of {block} tokens but the instance has "
                          f"{blocks}; lower {flag} or raise --total-kv-blocks")
    return value


def _pool_deployment(args, pool: str, cluster: ClusterConfig, arch, kind, alpha, beta, base_gpu, base_tp: int,
                     diag: Diagnostics) -> PoolDeployment | None:
    """A PD pool's own deployment when any of its --<pool>-hardware/-tp/-max-model-len is set
    (blis-features §3.10: per-pool overrides, pool KV capacity recomputed)."""
    hardware, tp, mml = (getattr(args, f"{pool}_{name}") for name in ("hardware", "tp", "max_model_len"))
    if hardware is None and tp is None and not mml:
        return None
    if not cluster.pd:
        raise ConfigError(f"--{pool}-hardware/--{pool}-tp/--{pool}-max-model-len configure a PD pool: set "
                          "--prefill-instances and --decode-instances")
    if tp is not None and tp < 1:
        raise ConfigError(f"--{pool}-tp {tp}: the tensor-parallel degree must be >= 1 (omit it to use --tp)")
    gpu = load_gpu(hardware) if hardware is not None else base_gpu
    tp = base_tp if tp is None else tp
    try:
        model = build_latency_model(kind, arch, gpu, tp, alpha=alpha, beta=beta)
    except ConfigError as e:
        raise ConfigError(f"--{pool}-tp / --{pool}-hardware: {e}") from None
    blocks = _kv_blocks(args, arch, gpu, tp, diag)
    block = args.block_size_in_tokens
    flag = f"--{pool}-max-model-len" if mml else "--max-model-len"
    max_model_len = _max_model_len(flag, mml or args.max_model_len, arch, blocks, block)
    return PoolDeployment(latency_model=model, total_kv_blocks=blocks, max_model_len=max_model_len,
                          hardware=gpu.name, tp=tp, kv_bytes_per_token=kv_bytes_per_token(arch, tp))


def _check_output_paths(args) -> None:
    """Fail before simulating when an output cannot be written."""
    for flag, value in (("--metrics-path", args.metrics_path), ("--results-path", args.results_path),
                        ("--trace-output", args.trace_output)):
        _check_output_file(flag, value)


# ------------------------------------------------------------------------------ workloads


def run_workload(args, diag: Diagnostics) -> DistributionWorkload:
    """The DistributionWorkload of `run`'s flags (distribution mode or a preset)."""
    args = argparse.Namespace(**{**vars(args), "num_requests": 100 if args.num_requests is None else args.num_requests,
                                 "timeout": DEFAULT_TIMEOUT_S if args.timeout is None else args.timeout})
    length_flags = {
        "prompt": (args.prompt_tokens, args.prompt_tokens_stdev, args.prompt_tokens_min, args.prompt_tokens_max),
        "output": (args.output_tokens, args.output_tokens_stdev, args.output_tokens_min, args.output_tokens_max),
    }
    if args.workload != "distribution":
        explicit = [f"--{kind}-tokens*" for kind, values in length_flags.items() if any(v is not None for v in values)]
        if args.prefix_tokens is not None:
            explicit.append("--prefix-tokens")
        if explicit:
            diag.warn(f"--workload {args.workload}: the preset sets the lengths; "
                      f"{', '.join(explicit)} ignored")
        return preset_workload(args.workload, rate=args.rate, num_requests=args.num_requests,
                               timeout_s=args.timeout, horizon_us=args.horizon)
    dists = {}
    for kind, default in (("prompt", PROMPT_DEFAULT), ("output", OUTPUT_DEFAULT)):
        mean, std, lo, hi = length_flags[kind]
        dist = GaussianLength(mean=default.mean if mean is None else mean,
                              std=default.std if std is None else std,
                              min=default.min if lo is None else lo,
                              max=default.max if hi is None else hi)
        if not math.isfinite(dist.mean) or dist.mean < 0:
            raise ConfigError(f"--{kind}-tokens {dist.mean:g}: the mean length must be a number >= 0")
        dists[kind] = dist
    return DistributionWorkload(rate=args.rate, num_requests=args.num_requests, prompt=dists["prompt"],
                                output=dists["output"],
                                prefix_tokens=0 if args.prefix_tokens is None else args.prefix_tokens,
                                timeout_s=args.timeout, horizon_us=args.horizon)


def replay_horizon(args, requests: RequestSet) -> int | None:
    """Explicit --horizon, else BLIS's replay default: 2 × the latest injection time
    (no horizon when every request is injected at time 0). Trace times are at most
    limits.MAX_TIME_US, so the doubled time fits int64."""
    if args.horizon is not None:
        return args.horizon
    latest = int(requests.arrival_us.max()) if len(requests) else 0
    return 2 * latest if latest > 0 else None


# ------------------------------------------------------------------------------- commands


def engine_params(scenario: Scenario):
    """The engine's dynamic settings of a resolved scenario (shared with `blis-jax sweep`)."""
    return make_engine_params(
        max_num_seqs=scenario.max_num_seqs,
        max_num_batched_tokens=scenario.max_num_batched_tokens,
        long_prefill_token_threshold=scenario.long_prefill_token_threshold,
        max_model_len=scenario.max_model_len,
        total_kv_blocks=scenario.total_kv_blocks,
        horizon_us=scenario.horizon_us,
    )


def simulate(scenario: Scenario, requests: RequestSet, args, stderr: TextIO, sessions=None, *, with_views=False):
    """Run the engine, with a progress reporter when stderr is a terminal or --progress.
    With closed-loop `sessions` (SessionLinks) returns (the requests that existed, outputs).
    `with_views`: returns (outputs, per-instance views or None) (PD pools: each instance's own
    sub-requests, for its metrics block)."""
    views = None
    params = engine_params(scenario)
    tty = bool(getattr(stderr, "isatty", lambda: False)())
    reporter = ProgressReporter(stderr, tty) if (tty or args.progress) else None
    extra = {"progress": reporter, "events_per_chunk": PROGRESS_EVENTS_PER_CHUNK} if reporter else {}
    settings = dict(block_size=scenario.block_size, scheduler=scenario.scheduler,
                    preemption_policy=scenario.preemption_policy, **extra)
    try:
        if sessions is not None:
            if not scenario.single_instance:
                raise ConfigError("--workload-spec: closed-loop sessions run on one instance with always-admit "
                                  "for now; use --num-instances 1 and --admission-policy always-admit, without "
                                  "--admission-latency, --routing-latency or --flow-control")
            requests, out = simulate_sessions(requests, sessions, params, scenario.latency_model, **settings)
        elif scenario.single_instance:
            out = simulate_instance(requests, params, scenario.latency_model, **settings)
        else:
            out, views = simulate_cluster_views(requests, params, scenario.latency_model, scenario.cluster,
                                                kv_bytes_per_token=scenario.kv_bytes_per_token,
                                                prefill_pool=scenario.prefill_pool, decode_pool=scenario.decode_pool,
                                                **settings)
    finally:
        if reporter is not None:
            reporter.close()
    if out.result != result_codes.OK:
        raise SimulationFailed(f"the engine stopped early ({result_codes.describe(out.result)}: an "
                               "internal buffer overflowed); the outputs would be incomplete, so none "
                               "were written. Please report this with the command line")
    if with_views:
        return out, views
    return out if sessions is None else (requests, out)


class SimulationFailed(RuntimeError):
    """The engine could not complete the run (not a user-input problem)."""


def write_outputs(args, requests: RequestSet, out, header: TraceHeader, stdout: TextIO,
                  goodput_targets=None, views=None) -> None:
    extra = {}
    if views is not None:
        extra = dict(instance_outputs=views.outputs, extra_sections=(format_pd_section(pd_summary(out, views)),))
    stdout.write(render_stdout(out, requests, scheduler=args.scheduler, goodput_targets=goodput_targets, **extra))
    stdout.flush()
    if args.metrics_path:
        write_metrics_file(args.metrics_path, out, requests, goodput_targets)
    if args.results_path:
        write_results_file(args.results_path, out, requests)
    if args.trace_output:
        write_trace(args.trace_output, header, requests, out if views is None else pd_trace_outcomes(out, views))


def cmd_run(args, stdout: TextIO, stderr: TextIO, diag: Diagnostics) -> int:
    _check_output_paths(args)
    scenario, requests, sessions = resolve_run_sessions(args, diag)
    views = None
    if sessions is None:
        out, views = simulate(scenario, requests, args, stderr, with_views=True)
    else:
        requests, out = simulate(scenario, requests, args, stderr, sessions)
    # a workload spec's goodput targets go into the header and the metrics, as in BLIS
    goodput = _load_spec_file("--workload-spec", args.workload_spec).goodput_slo_targets if args.workload_spec else None
    header = TraceHeader(mode="generated", workload_seed=int(args.seed), goodput_slo_targets=goodput)
    write_outputs(args, requests, out, header, stdout, goodput_targets=goodput, views=views)
    return 0


def resolve_run(args, diag: Diagnostics) -> tuple[Scenario, RequestSet]:
    """`run`'s flags → (scenario, generated requests); `blis-jax sweep` resolves each of its
    scenarios through this same function, so a sweep row and a `run` cannot differ."""
    scenario, requests, sessions = resolve_run_sessions(args, diag)
    if sessions is not None:
        raise ConfigError("--workload-spec: closed-loop sessions (their rounds arrive during the run) are not "
                          "supported in sweeps yet; use `blis-jax run` for this workload")
    return scenario, requests


def resolve_run_sessions(args, diag: Diagnostics):
    """(scenario, requests, SessionLinks or None): with closed-loop sessions in the workload
    spec, the requests hold every round and the links tell the engine how rounds follow."""
    sessions = None
    if args.workload_spec:
        from blis_jax.workload.generate import generate_workload
        from blis_jax.workload.sessions import closed_loop_requests

        from blis_jax.workload.spec import load_spec

        if args.timeout is not None and args.timeout == 0:
            raise ConfigError("--timeout 0 is not allowed: give seconds > 0, or a negative value to disable")
        _check_run_numbers(args)
        spec = load_spec(args.workload_spec)
        limits.check_requests(_spec_request_estimate(spec, args), "lower num_requests (or --num-requests) "
                              "or the horizon")
        scenario = resolve_scenario(args, diag, horizon_us=args.horizon)
        seed = None if isinstance(args.seed, DefaultSeed) else args.seed
        generated = generate_workload(spec, seed, num_requests=args.num_requests,
                                      horizon_us=args.horizon, timeout_s=args.timeout, sessions="first_round")
        requests = generated.requests
        if generated.sessions:
            requests, sessions = closed_loop_requests(generated)
    else:
        _check_run_numbers(args)
        workload = run_workload(args, diag)
        n = workload.num_requests
        if workload.horizon_us is not None:
            by_horizon = workload.horizon_us // constant_iat_us(workload.rate)
            n = by_horizon if n == 0 else min(n, by_horizon)
        limits.check_requests(n, "lower --num-requests" if n == workload.num_requests else "shorten --horizon")
        scenario = resolve_scenario(args, diag, horizon_us=args.horizon)
        requests = generate_distribution(workload, args.seed)
    if len(requests) == 0:
        raise ConfigError("no requests to simulate: --horizon is shorter than one inter-arrival time "
                          "(1/--rate); raise --horizon or --rate")
    return scenario, requests, sessions


def _check_run_numbers(args) -> None:
    """Ranges of `run`'s workload flags (times and lengths inside the engine's int64 sums)."""
    if args.timeout is not None and abs(args.timeout) * 1e6 > limits.MAX_TIME_US:
        raise ConfigError(f"--timeout {args.timeout:g}: at most {limits.MAX_TIME_US / 1e6:.3g} s "
                          "(a negative value disables timeouts)")
    if args.num_requests is not None:
        limits.check_int("--num-requests", args.num_requests, 0, limits.INT64_MAX)
    for flag in ("prefix_tokens", "prompt_tokens_min", "prompt_tokens_max", "output_tokens_min",
                 "output_tokens_max"):
        value = getattr(args, flag)
        if value is not None and value > limits.MAX_TOKENS:
            limits.check_int("--" + flag.replace("_", "-"), value, 0, limits.MAX_TOKENS, " tokens")
    for flag in ("prompt_tokens", "prompt_tokens_stdev", "output_tokens", "output_tokens_stdev"):
        value = getattr(args, flag)
        if value is not None and abs(value) > limits.MAX_TOKENS:
            raise ConfigError(f"--{flag.replace('_', '-')} {value:g}: at most {limits.MAX_TOKENS:,} tokens")


def _spec_request_estimate(spec, args) -> int:
    """Requests a spec will generate (before generating them): the count, else rate x horizon."""
    n = args.num_requests if args.num_requests is not None else spec.num_requests
    if n:
        return n
    horizon = args.horizon or spec.horizon
    estimate = 0
    if horizon and spec.aggregate_rate:
        estimate = int(spec.aggregate_rate * horizon / 1e6)
    if spec.inference_perf is not None:
        estimate = max(estimate, int(sum(s.rate * s.duration for s in spec.inference_perf.stages)))
    return estimate


def cmd_replay(args, stdout: TextIO, stderr: TextIO, diag: Diagnostics) -> int:
    _check_output_paths(args)
    header, requests = read_trace(args.trace_header, args.trace_data)
    if len(requests) == 0:
        raise ConfigError(f"--trace-data {args.trace_data}: no request records; the CSV has only a header row")
    limits.check_requests(len(requests), "replay a part of the trace")
    scenario = resolve_scenario(args, diag, horizon_us=replay_horizon(args, requests))
    out, views = simulate(scenario, requests, args, stderr, with_views=True)
    replayed = dataclasses.replace(header, mode="replayed")
    write_outputs(args, requests, out, replayed, stdout, goodput_targets=header.goodput_slo_targets, views=views)
    return 0


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
                                 "compose": cmd_compose, "calibrate": cmd_calibrate,
                                 "sweep": cmd_sweep, "plan": cmd_plan, "fit": cmd_fit,
                                 "sensitivity": cmd_sensitivity, "observe": cmd_observe, "models": cmd_models}


def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None,
         stderr: TextIO | None = None) -> int:
    """Entry point of `blis-jax` / `python -m blis_jax`. Returns the exit code (0 success,
    2 bad flags or input, 1 the engine could not finish)."""
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
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
