"""`blis-jax observe`: flags (BLIS's names), validation, and the run sequence (spec §1–2, §8);
the pieces (workload, client, dispatcher, records, ...) are in `blis_jax.observe`.

Choices where BLIS's observe has a flaw (spec §12), all keeping BLIS's defaults on the wire:
* `--slo-ttft/-itl/-e2e`, `--think-time-dist` and the output paths are checked before anything
  is sent (BLIS parses `--slo-*` only after the run, so a typo wasted the observation);
* `--stream` (blis-jax) streams every request without recording ITL: with BLIS's default
  (non-streaming for rate, preset and concurrency workloads) the recorded "first chunk" is the
  whole response and TTFT means E2E; the default stays BLIS's so traces compare with BLIS's;
* an interrupt stops dispatching at once (BLIS may still start a few overdue requests);
* the saturation detectors (`--detectors`, ...) are not implemented yet: a clear error.
Bad input ends with one `error:` line and exit code 2, like every blis-jax command.
"""

from __future__ import annotations

import asyncio
import gc
import math
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from blis_jax.errors import ConfigError

if TYPE_CHECKING:
    from blis_jax.observe.workload import ObservedWorkload

API_FORMATS = ("completions", "chat")


def add_parser(sub) -> None:
    p = sub.add_parser("observe", allow_abbrev=False,
                       help="send a workload to a real OpenAI-compatible server and record a TraceV2",
                       description="Send the workload of run's flags (or a workload spec) to an OpenAI-compatible "
                                   "server (vLLM, ...) as real HTTP requests, measure each from the client side and "
                                   "write a TraceV2 (mode real) for `replay` and `calibrate`.")
    g = p.add_argument_group("server and outputs")
    g.add_argument("--server-url", default="", help="base URL, e.g. http://localhost:8000 (required)")
    g.add_argument("--model", default="", help="model name sent in every request body (required)")
    g.add_argument("--trace-header", default="", metavar="FILE", help="output TraceV2 header YAML (required)")
    g.add_argument("--trace-data", default="", metavar="FILE", help="output TraceV2 request CSV (required)")
    g.add_argument("--api-format", default="completions", help="completions (/v1/completions) or chat "
                   "(/v1/chat/completions); default completions")
    g.add_argument("--api-key", default="", help="bearer token sent on every request")
    g.add_argument("--server-type", default="vllm", help="written to the header's server.type (default vllm)")
    g.add_argument("--rtt-ms", type=float, default=0.0, metavar="MS",
                   help="network round trip written to the header (not measured; calibrate adds it)")
    g.add_argument("--timeout", type=int, default=300, metavar="S",
                   help="per-request client timeout over the whole exchange, 1..86400 s (default 300)")
    g.add_argument("--log", default="info", choices=("trace", "debug", "info", "warn", "warning", "error"),
                   metavar="LEVEL", help="stderr verbosity (default info)")

    g = p.add_argument_group("workload (as run)")
    g.add_argument("--workload-spec", default="", metavar="FILE", help="workload spec v2 YAML")
    g.add_argument("--workload", default="", metavar="PRESET", help="preset name (chatbot, summarization, "
                   "contentgen, multidoc); requires --rate")
    g.add_argument("--defaults-filepath", default=None, metavar="FILE",
                   help="accepted for BLIS compatibility; blis-jax's presets are built in")
    g.add_argument("--rate", type=float, default=None, help="requests/s (preset or distribution workload)")
    g.add_argument("--concurrency", type=int, default=0, metavar="N", help="N closed-loop virtual users")
    g.add_argument("--think-time-ms", type=int, default=None, metavar="MS", help="think time of the users (default 0)")
    g.add_argument("--think-time-dist", default=None, metavar="DIST",
                   help="lognormal:mu=..,sigma=..[,min=..][,max=..] or constant:value=.. (requires --concurrency)")
    g.add_argument("--num-requests", type=int, default=0, metavar="N", help="request cap (default 0: from the spec)")
    g.add_argument("--horizon", type=int, default=0, metavar="US", help="generation horizon, µs (default 0: none)")
    g.add_argument("--seed", type=int, default=None, help="workload seed (default 42, or the spec's)")
    g.add_argument("--prefix-tokens", type=int, default=None, metavar="N", help="shared prefix tokens (group shared)")
    for kind in ("prompt", "output"):
        g.add_argument(f"--{kind}-tokens", type=float, default=None, metavar="MEAN", help=f"{kind} length mean (512)")
        g.add_argument(f"--{kind}-tokens-stdev", type=float, default=None, metavar="STD", help="(default 256)")
        g.add_argument(f"--{kind}-tokens-min", type=int, default=None, metavar="N", help="(default 2)")
        g.add_argument(f"--{kind}-tokens-max", type=int, default=None, metavar="N", help="(default 7000)")
    g.add_argument("--lazy-generation", action="store_true", help="accepted; the sequence is identical")

    g = p.add_argument_group("sending")
    g.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                   help="maximum requests in flight (default 256, or --concurrency)")
    g.add_argument("--warmup-requests", type=int, default=0, metavar="N", help="first N dispatched are not recorded")
    g.add_argument("--prewarm-duration", default="0", metavar="DURATION", help="priming phase, e.g. 30s (default 0)")
    g.add_argument("--no-streaming", action="store_true", help="never stream")
    g.add_argument("--stream", action="store_true",
                   help="blis-jax: stream every request (meaningful TTFT) without recording ITL")
    g.add_argument("--unconstrained-output", action="store_true", help="do not force the output length")
    g.add_argument("--record-itl", action="store_true", help="stream every request and write per-chunk times")
    g.add_argument("--itl-output", default=None, metavar="FILE", help="ITL CSV (default <trace-data>.itl.csv)")

    g = p.add_argument_group("KV metrics and SLOs")
    g.add_argument("--scrape-kv-metrics", action="store_true", help="scrape /metrics before and after the window")
    g.add_argument("--kv-metrics-url", default="", metavar="URL", help="metrics URL (default <server-url>/metrics)")
    g.add_argument("--vllm-commit", default="", help="written to observed_kv_metrics.vllm_commit")
    for dim in ("ttft", "itl", "e2e"):
        g.add_argument(f"--slo-{dim}", default="", metavar="CLASS=DUR,...", help=f"goodput {dim.upper()} targets")
    for name in ("detectors", "saturation-config", "saturation-report", "saturation-final-window"):
        g.add_argument(f"--{name}", default="", help="not supported by blis-jax observe yet")


# ------------------------------------------------------------------------------ validation


def validate(args, diag) -> dict:
    """BLIS's checks in BLIS's order (spec §1.2), plus the early ones; returns parsed values."""
    for flag in ("server_url", "model", "trace_header", "trace_data"):
        if not getattr(args, flag):
            raise ConfigError(f"--{flag.replace('_', '-')} is required")
    if args.itl_output and not args.record_itl:
        diag.warn("--itl-output has no effect without --record-itl")
    if args.record_itl and args.no_streaming:
        raise ConfigError("--record-itl and --no-streaming are mutually exclusive; ITL recording requires "
                          "streaming responses")
    if args.stream and args.no_streaming:
        raise ConfigError("--stream and --no-streaming are mutually exclusive")
    if not (args.workload or args.workload_spec or args.rate is not None or args.concurrency > 0):
        raise ConfigError("Either --workload, --workload-spec, --rate, or --concurrency is required")
    if args.workload:
        if args.workload_spec:
            raise ConfigError("--workload and --workload-spec are mutually exclusive")
        if args.concurrency:
            raise ConfigError("--workload and --concurrency are mutually exclusive; use --workload-spec with "
                              "clients[].concurrency for closed-loop preset workloads")
        if args.rate is None:
            raise ConfigError(f'--workload "{args.workload}" requires --rate (preset synthesis needs a request rate)')
    if args.concurrency and args.rate is not None:
        raise ConfigError("--concurrency and --rate are mutually exclusive; use one or the other")
    if args.concurrency < 0:
        raise ConfigError(f"--concurrency must be >= 0, got {args.concurrency}")
    if args.think_time_ms is not None and args.think_time_ms < 0:
        raise ConfigError(f"--think-time-ms must be >= 0, got {args.think_time_ms}")
    if args.think_time_ms is not None and args.think_time_dist is not None:
        raise ConfigError("--think-time-ms and --think-time-dist are mutually exclusive")
    if args.think_time_dist and args.concurrency <= 0:
        raise ConfigError("--think-time-dist requires --concurrency")
    parsed: dict = {"think": None}
    if args.think_time_dist is not None:
        from blis_jax.observe.sessions import parse_think_time_dist
        try:
            parsed["think"] = parse_think_time_dist(args.think_time_dist)
        except ConfigError as e:
            raise ConfigError(f"--think-time-dist: {e}") from None
    if args.max_concurrency is not None and args.max_concurrency <= 0:
        raise ConfigError(f"--max-concurrency must be > 0, got {args.max_concurrency}")
    if args.warmup_requests < 0:
        raise ConfigError(f"--warmup-requests must be >= 0, got {args.warmup_requests}")
    from blis_jax.observe.summary import parse_go_duration, parse_slo_flag
    try:
        prewarm_us = parse_go_duration(args.prewarm_duration)
    except ValueError as e:
        raise ConfigError(f"--prewarm-duration: {e}") from None
    if prewarm_us < 0:
        raise ConfigError(f"--prewarm-duration must be >= 0, got {args.prewarm_duration}")
    parsed["prewarm_s"] = prewarm_us / 1e6
    if args.rate is not None and not (math.isfinite(args.rate) and args.rate > 0):
        raise ConfigError(f"--rate must be a finite value > 0, got {args.rate:g}")
    if args.api_format not in API_FORMATS:
        raise ConfigError(f"--api-format must be 'completions' or 'chat', got \"{args.api_format}\"")
    if not (math.isfinite(args.rtt_ms) and args.rtt_ms >= 0):
        raise ConfigError(f"--rtt-ms must be a finite value >= 0, got {args.rtt_ms:g}")
    if not 1 <= args.timeout <= 86400:
        raise ConfigError(f"--timeout must be between 1 and 86400 seconds (1 day), got {args.timeout}")
    if args.workload_spec and args.concurrency > 0:
        raise ConfigError("--concurrency cannot be used with --workload-spec; define concurrency in the spec file "
                          "using clients[].concurrency instead")
    for name in ("detectors", "saturation_config", "saturation_report", "saturation_final_window"):
        if getattr(args, name):
            raise ConfigError(f"--{name.replace('_', '-')}: BLIS's post-hoc saturation detectors are not "
                              "implemented in blis-jax yet; leave the flag out")
    # blis-jax: checked before the run, not after it (spec §12)
    slo = {}
    for dim in ("ttft", "itl", "e2e"):
        text = getattr(args, f"slo_{dim}")
        if text:
            try:
                slo[f"{dim}_ms"] = parse_slo_flag(text)
            except ConfigError as e:
                raise ConfigError(f"--slo-{dim}: {e}") from None
    parsed["slo"] = slo
    for flag in ("trace_header", "trace_data", "itl_output"):
        value = getattr(args, flag)
        if value and not Path(value).resolve().parent.is_dir():
            raise ConfigError(f"--{flag.replace('_', '-')} {value}: directory {str(Path(value).parent)!r} "
                              "does not exist; create it first")
    if args.defaults_filepath is not None:
        diag.warn("--defaults-filepath: blis-jax's presets are built in; the file is not read")
    from blis_jax.workload.presets import PRESETS
    if args.workload and args.workload not in PRESETS:
        raise ConfigError(f'Undefined workload "{args.workload}". Use one among ({", ".join(PRESETS)}) '
                          "or --workload-spec")
    if not args.workload_spec:
        _check_lengths(args)
    return parsed


def _check_lengths(args) -> None:
    from blis_jax.workload.distribution import OUTPUT_DEFAULT, PROMPT_DEFAULT, GaussianLength
    for kind, default in (("prompt", PROMPT_DEFAULT), ("output", OUTPUT_DEFAULT)):
        values = [getattr(args, f"{kind}_tokens{s}") for s in ("", "_stdev", "_min", "_max")]
        filled = [d if v is None else v for v, d in zip(values, (default.mean, default.std, default.min, default.max))]
        GaussianLength(*filled).check(f"--{kind}-tokens")


# ------------------------------------------------------------------------------- the run


def build_workload(args, diag) -> ObservedWorkload:
    """The workload of observe's flags (validated beforehand by `validate`)."""
    from blis_jax.observe import workload as ow
    from blis_jax.workload.distribution import OUTPUT_DEFAULT, PROMPT_DEFAULT

    if args.workload_spec:
        return ow.from_spec(args.workload_spec, args.seed, args.num_requests, args.horizon, label=args.workload_spec)
    seed = 42 if args.seed is None else args.seed
    if args.concurrency and args.concurrency > 0:
        spec = ow.concurrency_spec(args.concurrency, 1000 * int(args.think_time_ms or 0), seed, args.num_requests or 0,
                                   prompt=_flag_lengths(args, "prompt", PROMPT_DEFAULT) or PROMPT_DEFAULT,
                                   output=_flag_lengths(args, "output", OUTPUT_DEFAULT) or OUTPUT_DEFAULT,
                                   prefix_tokens=args.prefix_tokens or 0)
        return ow.from_spec(spec, args.seed, args.num_requests, args.horizon, label=None)
    from blis_jax.scenario import SyntheticWorkload

    ow.check_bounded(args.num_requests, args.horizon)
    synthetic = SyntheticWorkload(kind=args.workload or "distribution", rate=args.rate,
                                  num_requests=args.num_requests or 0, timeout_s=-1.0, prefix_tokens=args.prefix_tokens,
                                  prompt=_flag_lengths(args, "prompt", PROMPT_DEFAULT),
                                  output=_flag_lengths(args, "output", OUTPUT_DEFAULT))
    return ow.from_synthetic(synthetic, seed, args.horizon or None,
                             label=f"preset:{args.workload}" if args.workload else None,
                             warn=diag.warn if diag is not None else None)


def _flag_lengths(args, kind: str, default):
    """The length distribution of run's four `--{kind}-tokens*` flags, None when none is given."""
    from blis_jax.workload.distribution import GaussianLength

    values = [getattr(args, f"{kind}_tokens{s}") for s in ("", "_stdev", "_min", "_max")]
    if all(v is None for v in values):
        return None
    return GaussianLength(*(d if v is None else v for v, d in zip(values, (default.mean, default.std,
                                                                            default.min, default.max))))


class _Log:
    def __init__(self, stream: TextIO, level: str) -> None:
        self.stream, self.level = stream, level

    def info(self, message: str) -> None:
        if self.level in ("trace", "debug", "info"):
            self.stream.write(f"blis-jax observe: {message}\n")
            self.stream.flush()


def cmd_observe(args, stdout: TextIO, stderr: TextIO, diag) -> int:
    from blis_jax.cli.scenario_flags import FLAG_OF_FIELD
    from blis_jax.naming import naming
    parsed = validate(args, diag)
    log = _Log(stderr, args.log)
    with naming(FLAG_OF_FIELD):  # observe's workload flags are run's
        workload = build_workload(args, diag)
    if "adapter" in workload.requests.trace_columns:
        diag.warn("the workload spec declares LoRA adapters; observe ignores them (every request goes to --model)")
    n_static = len(workload.static_rows)
    if n_static == 0:
        diag.warn("No requests generated — writing empty trace")
    sessions = f" and {workload.num_sessions} sessions" if workload.num_sessions else ""
    log.info(f"Generated {n_static} requests{sessions}")
    return asyncio.run(_observe(args, parsed, workload, stdout, stderr, diag, log))


async def _observe(args, parsed, workload, stdout, stderr, diag, log) -> int:
    from blis_jax.observe import kvscrape
    from blis_jax.observe.client import Client, ClientConfig
    from blis_jax.observe.dispatcher import Dispatcher
    from blis_jax.observe.progress import Progress
    from blis_jax.observe.prompts import PromptBuilder, build_prefix_strings
    from blis_jax.observe.sessions import LiveSessions, think_sampler
    from blis_jax.observe.warmup import prewarm, probe_ratio

    max_concurrency = args.max_concurrency
    if max_concurrency is None:
        max_concurrency = args.concurrency if args.concurrency > 0 else 256
        if args.concurrency > 0:
            log.info(f"Auto-setting --max-concurrency={max_concurrency} to match --concurrency")
    config = ClientConfig(server_url=args.server_url, model=args.model, api_format=args.api_format,
                          api_key=args.api_key, timeout_s=float(args.timeout), unconstrained=args.unconstrained_output)
    async with Client.make_session(max_concurrency) as http:
        client = Client(config, http, warn=diag.warn)
        ratio = await probe_ratio(client, diag.warn)
        log.info(f"Calibrated tokens-per-word ratio: {ratio:g}")
        prefixes = build_prefix_strings(workload.seed, workload.prefix_lengths, ratio, _word_draws())
        if prefixes:
            log.info(f"Built prefix strings for {len(prefixes)} prefix groups")
        sampler = None
        if parsed["think"] is not None:
            sampler = think_sampler(*parsed["think"], seed=workload.seed)
        sessions = LiveSessions(workload, horizon_us=args.horizon or workload.horizon_us, think_sampler=sampler)
        progress = Progress(stderr)
        dispatcher = Dispatcher(workload, client, PromptBuilder(ratio, prefixes), sessions,
                                max_concurrency=max_concurrency, warmup_requests=args.warmup_requests,
                                stream_all=args.record_itl or args.stream, no_streaming=args.no_streaming,
                                progress=progress)
        stop = asyncio.Event()
        _install_signals(dispatcher, stop)
        if parsed["prewarm_s"] > 0:
            await prewarm(client, parsed["prewarm_s"], stop, log.info)
        metrics_url = args.kv_metrics_url or args.server_url.rstrip("/") + "/metrics"
        start_scrape = None
        if args.scrape_kv_metrics and not stop.is_set():
            try:
                start_scrape = await kvscrape.scrape(client, metrics_url)
            except kvscrape.ScrapeError as e:
                diag.warn(f"KV metrics scrape at start failed: {e}; no observed_kv_metrics")
        # Everything allocated so far (JAX, NumPy, the workload) moves to the permanent GC
        # generation: a full collection over that heap during the window would pause the loop
        # for milliseconds and show up as latency.
        gc.collect()
        gc.freeze()
        t0 = time.monotonic()
        try:
            recs = [] if stop.is_set() else await dispatcher.run()
        finally:
            gc.unfreeze()
            progress.close()
        if dispatcher.cancelled:
            log.info("Interrupted: in-flight requests aborted; writing what was recorded")
        kv = None
        if start_scrape is not None and not dispatcher.cancelled:
            try:
                kv = kvscrape.derive_kv_metrics(start_scrape, await kvscrape.scrape(client, metrics_url),
                                                args.vllm_commit)
                log.info(f"Observed KV hit rate: {kv['hit_rate']:g} ({kv['source']})")
            except kvscrape.ScrapeError as e:
                diag.warn(f"KV metrics: {e}; no observed_kv_metrics")
    _write_outputs(args, parsed, workload, recs, kv, t0, stdout, diag, log)
    return 0


def _write_outputs(args, parsed, workload, recs, kv, t0: float, stdout: TextIO, diag, log) -> None:
    """Trace, stdout summary, ITL file (spec §2 steps 16-22)."""
    from blis_jax.observe import records, summary

    targets = summary.merge_targets(workload.goodput_targets, parsed["slo"])
    header = records.observed_header(warmup=args.warmup_requests, seed=workload.seed,
                                     workload_spec=workload.workload_spec, server_type=args.server_type,
                                     model=args.model, rtt_ms=args.rtt_ms, goodput_targets=targets, kv_metrics=kv)
    records.write_observed_trace(args.trace_header, args.trace_data, header, workload, recs)
    duration = time.monotonic() - t0
    log.info(f"Observation wall-clock time: {duration:.3f}s")
    log.info(f"Trace exported: {args.trace_header}, {args.trace_data} ({len(recs)} records)")
    rows = [{"request_id": r.index, "status": r.outcome.status, "send": r.outcome.send_us,
             "first": r.outcome.first_chunk_us, "last": r.outcome.last_chunk_us,
             "output_tokens": r.outcome.output_tokens, "slo_class": str(workload.requests.slo_class[r.planned.row]),
             "session_id": r.planned.session_id, "round_index": r.planned.round_index} for r in recs]
    itl = ({r.index: r.outcome.chunk_times_us for r in recs if r.outcome.status == "ok"}
           if args.record_itl else None)
    goodput = None
    if targets:
        stdout_targets = targets
        if not args.record_itl and any("itl_ms" in t for t in targets.values()):
            diag.warn("ITL goodput targets need --record-itl; they are left out of the stdout goodput")
            stdout_targets = {c: {d: v for d, v in t.items() if d != "itl_ms"} for c, t in targets.items()}
            stdout_targets = {c: t for c, t in stdout_targets.items() if t}
        if stdout_targets:
            goodput = summary.goodput_block(rows, stdout_targets, duration, itl)
    stdout.write(summary.render(summary.metrics_block(rows, duration, itl, goodput), summary.session_block(rows)))
    stdout.flush()
    if args.record_itl:
        path = records.itl_path(args.trace_data, args.itl_output)
        itl_rows = records.itl_records(recs)
        if not itl_rows:
            diag.warn("--record-itl was set but no ITL data recorded (non-streaming requests?)")
        records.write_itl(path, itl_rows)


def _install_signals(dispatcher, stop: asyncio.Event) -> None:
    """SIGINT/SIGTERM: stop and drain (the trace is still written); later signals are ignored."""
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        stop.set()
        dispatcher.interrupt()

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread / platform
            pass


def _word_draws():
    """The prefix-word stream: BLIS's, from Go's math/rand seeded with each group's seed."""
    from blis_jax.observe import prompts
    return prompts.go_word_draws
