"""A local OpenAI-compatible server with known token timing (spec §11), for tests and demos.

    python -m blis_jax.observe.testserver --port 8000 --ttft-ms 30 --itl-ms 5

It emulates what observe's measurements depend on in vLLM: `POST /v1/completions` and
`/v1/chat/completions`, `min_tokens` (exact output length, `finish_reason: length`),
`priority` (accepted, or rejected like a default vLLM with `--reject-priority`), SSE with
one chunk per token, `stream_options.include_usage` and `data: [DONE]`, a chat role-only first
chunk, one-piece non-streaming bodies sent after generation, error statuses, stalls (for client
timeouts), a simple word tokenizer (⌈len(word)/4⌉ tokens per word, so the 100-word probe gives
~1.6 tokens per word) and `/metrics` with vLLM's prefix-cache counters.

Timing: token k (0-based) of a request is released at receipt + TTFT + k·ITL (one chunk per
token), each ITL stretched by (1 + slowdown·(requests in flight − 1)). The server logs when it
actually received each request and wrote its first and last chunk (wall-clock epoch µs), keyed
by `x-request-id`; `GET /debug/requests` returns that log, the ground truth for tests.
Binds 127.0.0.1 only by default. The module needs only the standard library and aiohttp, so
it also runs as a plain file (`python blis_jax/observe/testserver.py`), without the package's
JAX import.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import math
import sys
import time

from aiohttp import web

CHAT_TEMPLATE_TOKENS = 7   # a chat template's fixed overhead, as real servers add
CACHE_BLOCK_WORDS = 16     # prefix-cache granularity of the /metrics counters
STALL_S = 3600.0           # a stalled request sleeps this long (clients time out first)


@dataclasses.dataclass
class ServerConfig:
    ttft_ms: float = 20.0
    itl_ms: float = 5.0
    slowdown: float = 0.0            # per extra request in flight, relative ITL stretch
    default_output_tokens: int = 16  # when the body sets no max_tokens
    error_status: int = 0            # answer every generation request with this status (0 = never)
    error_body: str = "upstream error"
    stall: frozenset[int] = frozenset()   # receipt ordinals (0-based) that stall
    stall_after_chunks: int = -1     # -1: stall before the response headers; k ≥ 0: after k chunks
    reject_priority: bool = False    # a non-zero priority → HTTP 400 (vLLM without priority scheduling)
    ignore_min_tokens: bool = False


def count_tokens(text: str) -> int:
    return sum(math.ceil(len(w) / 4) for w in text.split())


def now_us() -> int:
    return time.time_ns() // 1000


class OpenAITestServer:
    """`async with OpenAITestServer(cfg) as s:` serves on `s.url` until the block ends."""

    def __init__(self, config: ServerConfig | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        self.config = config or ServerConfig()
        self.host, self.port = host, port
        self.log: dict[str, dict] = {}
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.received = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.metrics_requests = 0
        self._seen_blocks: set[int] = set()
        self.cache_queries = 0
        self.cache_hits = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/debug/requests", self._debug)
        return app

    async def start(self) -> None:
        # stalled handlers must not hold shutdown for aiohttp's default 60 s
        self._runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def __aenter__(self) -> OpenAITestServer:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # ------------------------------------------------------------------------- handlers

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        received = now_us()
        t0 = time.monotonic()
        ordinal = self.received
        self.received += 1
        cfg = self.config
        rid = request.headers.get("x-request-id", f"anon-{ordinal}")
        entry = {"received_us": received, "first_us": 0, "last_us": 0, "ordinal": ordinal}
        self.log[rid] = entry
        try:
            body = await request.json()
        except ValueError:
            return web.Response(status=400, text="invalid JSON body")
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        if cfg.error_status:
            return web.Response(status=cfg.error_status, text=cfg.error_body)
        if cfg.reject_priority and body.get("priority", 0) != 0:
            return web.Response(status=400, text="priority scheduling is not enabled")
        if chat:
            messages = body.get("messages") or []
            text = " ".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
            prompt_tokens = count_tokens(text) + CHAT_TEMPLATE_TOKENS
        else:
            text = str(body.get("prompt", ""))
            prompt_tokens = count_tokens(text)
        self._count_cache(text)
        n, finish = self._output_length(body)
        stall = ordinal in cfg.stall
        if stall and cfg.stall_after_chunks < 0:
            await asyncio.sleep(STALL_S)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if body.get("stream"):
                return await self._stream(request, body, chat, n, finish, prompt_tokens, t0, entry, stall)
            await self._pace(t0, n)
            payload = self._full_body(chat, n, finish, prompt_tokens, body)
            entry["first_us"] = entry["last_us"] = now_us()
            return web.json_response(payload)
        finally:
            self.in_flight -= 1

    def _output_length(self, body: dict) -> tuple[int, str]:
        max_tokens = body.get("max_tokens")
        min_tokens = 0 if self.config.ignore_min_tokens else int(body.get("min_tokens") or 0)
        if max_tokens is None:
            n = max(self.config.default_output_tokens, min_tokens)
            return n, "stop"
        max_tokens = int(max_tokens)
        if min_tokens >= max_tokens:
            n = max_tokens
        else:
            n = max(min_tokens, min(max_tokens, self.config.default_output_tokens))
        return n, ("length" if n >= max_tokens else "stop")

    async def _pace(self, t0: float, tokens: int) -> None:
        """Wait until the last of `tokens` tokens is due (non-streaming: sent in one piece)."""
        cfg = self.config
        due = t0 + cfg.ttft_ms / 1000
        for k in range(1, tokens):
            due += cfg.itl_ms / 1000 * (1 + cfg.slowdown * max(self.in_flight - 1, 0))
            delay = due - time.monotonic()
            if delay > 0.002:  # sleep per token only when it matters, so the slowdown tracks load
                await asyncio.sleep(delay)
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)

    async def _stream(self, request, body, chat, n, finish, prompt_tokens, t0, entry, stall) -> web.StreamResponse:
        cfg = self.config
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        created = int(time.time())
        base = {"id": "cmpl-test", "created": created, "model": body.get("model", "")}

        async def send(obj) -> None:
            data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
            await resp.write(data)
            t = now_us()
            entry["first_us"] = entry["first_us"] or t
            entry["last_us"] = t

        due = t0 + cfg.ttft_ms / 1000
        for k in range(n):
            if k:
                due += cfg.itl_ms / 1000 * (1 + cfg.slowdown * max(self.in_flight - 1, 0))
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if stall and k >= cfg.stall_after_chunks:
                await asyncio.sleep(STALL_S)
            reason = finish if k == n - 1 else None
            if chat:
                if k == 0:
                    await send({**base, "object": "chat.completion.chunk",
                                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "finish_reason": None}]})
                chunk = {**base, "object": "chat.completion.chunk",
                         "choices": [{"index": 0, "delta": {"content": f" t{k}"}, "finish_reason": reason}]}
            else:
                chunk = {**base, "object": "text_completion",
                         "choices": [{"index": 0, "text": f" t{k}", "finish_reason": reason}]}
            await send(chunk)
        if (body.get("stream_options") or {}).get("include_usage"):
            await send({**base, "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                                         "total_tokens": prompt_tokens + n}})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _full_body(self, chat: bool, n: int, finish: str, prompt_tokens: int, body: dict) -> dict:
        text = "".join(f" t{k}" for k in range(n))
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                  if chat else {"index": 0, "text": text, "finish_reason": finish})
        return {"id": "cmpl-test", "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": body.get("model", ""), "choices": [choice],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}}

    def _count_cache(self, text: str) -> None:
        """vLLM's GPU prefix-cache counters in tokens: a block of words hits when the same
        leading text (up to and including that block) was seen before."""
        words = text.split()
        h = 0
        for i in range(0, len(words) - len(words) % CACHE_BLOCK_WORDS, CACHE_BLOCK_WORDS):
            block = words[i:i + CACHE_BLOCK_WORDS]
            h = hash((h, tuple(block)))
            tokens = count_tokens(" ".join(block))
            self.cache_queries += tokens
            if h in self._seen_blocks:
                self.cache_hits += tokens
            else:
                self._seen_blocks.add(h)

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics_requests += 1
        lines = [
            "# HELP vllm:gpu_prefix_cache_queries_total GPU prefix cache queries, in queried tokens.",
            "# TYPE vllm:gpu_prefix_cache_queries_total counter",
            f'vllm:gpu_prefix_cache_queries_total{{engine="0",model_name="test"}} {float(self.cache_queries)}',
            f'vllm:gpu_prefix_cache_queries_created{{engine="0",model_name="test"}} {time.time()}',
            "# TYPE vllm:gpu_prefix_cache_hits_total counter",
            f'vllm:gpu_prefix_cache_hits_total{{engine="0",model_name="test"}} {float(self.cache_hits)}',
            f"vllm:num_requests_running {self.in_flight}",
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _debug(self, request: web.Request) -> web.Response:
        return web.json_response(self.log)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m blis_jax.observe.testserver",
                                description="Local OpenAI-compatible server with known token timing.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 = any free port (printed on stdout)")
    p.add_argument("--ttft-ms", type=float, default=20.0)
    p.add_argument("--itl-ms", type=float, default=5.0)
    p.add_argument("--slowdown", type=float, default=0.0, help="ITL stretch per extra request in flight")
    p.add_argument("--default-output-tokens", type=int, default=16)
    p.add_argument("--error-status", type=int, default=0)
    p.add_argument("--stall", default="", metavar="I,J,...", help="receipt ordinals that stall")
    p.add_argument("--stall-after-chunks", type=int, default=-1)
    p.add_argument("--reject-priority", action="store_true")
    return p


async def _serve(args) -> None:
    cfg = ServerConfig(ttft_ms=args.ttft_ms, itl_ms=args.itl_ms, slowdown=args.slowdown,
                       default_output_tokens=args.default_output_tokens, error_status=args.error_status,
                       stall=frozenset(int(x) for x in args.stall.split(",") if x),
                       stall_after_chunks=args.stall_after_chunks, reject_priority=args.reject_priority)
    async with OpenAITestServer(cfg, args.host, args.port) as server:
        gc.collect()
        gc.freeze()  # no full collections over the import heap while timing tokens
        print(f"listening on {server.url}", flush=True)
        await asyncio.Event().wait()


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    try:
        asyncio.run(_serve(args))
    except KeyboardInterrupt:
        pass
    sys.exit(0)


if __name__ == "__main__":
    main()
