"""`blis-jax observe`: send a workload to a real OpenAI-compatible server and record a TraceV2
(spec blis-observe.md). One concept per module:

* `workload` — the flags' workload (the project's generators, as `run` builds it) as rows to send;
* `tokens`, `prompts` — token IDs of a row, the 100-word prompt text, prefix strings (BLIS's
  words from Go's math/rand, `blis_jax.rng`);
* `http_request` — body and headers of one request; `sse` — streamed-response parsing;
* `client` — the aiohttp exchange of one request → `Outcome`;
* `sessions` — closed-loop follow-ups driven by real completions;
* `dispatcher` — pacing, the concurrency limit, dispatch indices, interrupts;
* `warmup` — the tokens-per-word probe and the prewarm phase;
* `kvscrape` — Prometheus `/metrics` and the observed KV hit rate;
* `records` — the trace and ITL CSV writers; `summary` — the stdout blocks;
* `progress` — the terminal progress line (the subcommand itself: `blis_jax.cli.observe`);
* `testserver` — a local OpenAI-compatible server with known token timing (spec §11).
"""
