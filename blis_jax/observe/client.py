"""One HTTP exchange with the server (spec §5), on aiohttp.

aiohttp because its client streams response bodies line by line on asyncio (thousands of
in-flight requests on one thread, no per-request thread) and the same library provides the
test server (aiohttp.web). The overall `--timeout` is an `asyncio.timeout` around the whole
exchange, headers and body, as BLIS's `http.Client.Timeout` is; a per-read timeout would let a
slowly dripping stream run forever.

Times are wall-clock epoch µs; `send_us` is taken right before the request is handed to the
connection pool (after the concurrency slot and the body were ready), so it includes
connection set-up but not queueing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid

import aiohttp

from blis_jax.observe.http_request import RequestSpec, encode_body, endpoint_url, request_body, request_headers
from blis_jax.observe.sse import StreamState, usage_tokens

CANCELED = "context canceled"  # BLIS's (Go's) wording for an interrupted request
DRAIN_S = 0.05


def now_us() -> int:
    return time.time_ns() // 1000


@dataclasses.dataclass
class Outcome:
    """What the client saw of one request (the observed half of a trace row)."""

    status: str = "ok"              # ok | error | timeout
    error_message: str = ""
    send_us: int = 0
    first_chunk_us: int = 0
    last_chunk_us: int = 0
    num_chunks: int = 0
    output_tokens: int = 0          # server-reported completion_tokens
    server_input_tokens: int = 0    # server-reported prompt_tokens
    finish_reason: str = ""
    x_request_id: str = ""
    streaming: bool = False
    chunk_times_us: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    server_url: str
    model: str
    api_format: str = "completions"
    api_key: str = ""
    timeout_s: float = 300.0
    unconstrained: bool = False


class Client:
    """Sends requests through one aiohttp session; `interrupt()` aborts those in flight."""

    def __init__(self, config: ClientConfig, session: aiohttp.ClientSession, warn=None) -> None:
        self.config = config
        self.session = session
        self.url = endpoint_url(config.server_url, config.api_format)
        self.warn = warn or (lambda message: None)
        self.interrupted = False
        self._in_flight: set[asyncio.Task] = set()

    @staticmethod
    def make_session(max_connections: int) -> aiohttp.ClientSession:
        # No session-level timeout (ours covers the exchange); no automatic decompression
        # surprises; a pool as large as the concurrency limit so connections are reused.
        connector = aiohttp.TCPConnector(limit=max_connections + 8, limit_per_host=0)
        return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None),
                                     auto_decompress=True)

    def interrupt(self) -> None:
        """Abort every in-flight exchange (recorded as `error`, context canceled)."""
        self.interrupted = True
        for task in list(self._in_flight):
            task.cancel()

    async def send(self, spec: RequestSpec, *, timeout_s: float | None = None) -> Outcome:
        """Send one request and read its response; never raises for server or transport trouble."""
        cfg = self.config
        body = encode_body(request_body(spec, model=cfg.model, api_format=cfg.api_format,
                                        unconstrained=cfg.unconstrained))
        rid = str(uuid.uuid4())
        headers = request_headers(spec, api_key=cfg.api_key, request_id=rid)
        out = Outcome(x_request_id=rid, streaming=spec.stream)
        if self.interrupted:
            out.status, out.error_message = "error", f"HTTP error: {CANCELED}"
            return out
        task = asyncio.create_task(self._guarded(body, headers, spec.stream, out,
                                                 cfg.timeout_s if timeout_s is None else timeout_s))
        self._in_flight.add(task)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not (self.interrupted and task.cancelled()):
                raise
            _fail(out, "error", ["headers", 0], CANCELED)  # interrupted before it could start
            return out
        finally:
            self._in_flight.discard(task)

    async def _guarded(self, body: bytes, headers: dict, stream: bool, out: Outcome, timeout_s: float) -> Outcome:
        phase = ["headers", 0]  # where the exchange is, for the error message; [1] = HTTP status
        try:
            async with asyncio.timeout(timeout_s):
                await self._exchange(body, headers, stream, out, phase)
        except TimeoutError as e:
            _fail(out, "timeout", phase, _describe(e, f"timeout after {timeout_s:g}s"))
        except asyncio.CancelledError:
            if not self.interrupted:
                raise
            asyncio.current_task().uncancel()
            _fail(out, "error", phase, CANCELED)
        except (aiohttp.ClientError, OSError, ValueError) as e:
            _fail(out, "error", phase, _describe(e, type(e).__name__))
        return out

    async def _exchange(self, body: bytes, headers: dict, stream: bool, out: Outcome, phase: list) -> None:
        out.send_us = now_us()
        async with self.session.post(self.url, data=body, headers=headers) as resp:
            if resp.status != 200:
                phase[0], phase[1] = "error-body", resp.status
                text = await resp.read()
                out.status = "error"
                out.error_message = f"HTTP {resp.status}: {text.decode(errors='replace')}"
                return
            if stream:
                phase[0] = "stream"
                await self._read_stream(resp, out)
            else:
                phase[0] = "read"
                await self._read_body(resp, out)

    async def _read_stream(self, resp: aiohttp.ClientResponse, out: Outcome) -> None:
        state = StreamState()
        try:
            while not state.done:
                line = await resp.content.readline()
                if not line:
                    break  # EOF without [DONE] is fine
                state.feed(line, now_us())
        finally:
            _take_stream(out, state)
        if state.done:
            await _drain(resp)
        if state.num_chunks and state.usage is None:
            self.warn(f"streaming response had {state.num_chunks} chunks but no usage data "
                      "(missing stream_options?)")

    async def _read_body(self, resp: aiohttp.ClientResponse, out: Outcome) -> None:
        parts = []
        first = 0
        async for data in resp.content.iter_any():
            if not first:
                first = now_us()
            parts.append(data)
        last = now_us()
        out.first_chunk_us, out.last_chunk_us, out.num_chunks = first or last, last, 1
        try:
            obj = json.loads(b"".join(parts))
        except ValueError as e:
            out.status, out.error_message = "error", f"JSON parse error: {e}"
            return
        if not isinstance(obj, dict):
            return
        out.output_tokens, out.server_input_tokens = usage_tokens(obj.get("usage"))
        choices = obj.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            reason = choices[0].get("finish_reason")
            if isinstance(reason, str):
                out.finish_reason = reason


async def _drain(resp: aiohttp.ClientResponse) -> None:
    """Read the end of the body after `[DONE]` (normally just the chunked-encoding end) so the
    keep-alive connection goes back to the pool: a connection released half-read is closed,
    and a new TCP connection per request adds set-up time to the next send. Bounded: a server
    that keeps the stream open after `[DONE]` only loses its connection."""
    try:
        await asyncio.wait_for(resp.content.read(), DRAIN_S)
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
        pass


def _take_stream(out: Outcome, state: StreamState) -> None:
    """Keep what a stream delivered, also when it ended in an error."""
    out.chunk_times_us = state.chunk_times_us
    out.num_chunks = state.num_chunks
    if state.chunk_times_us:
        out.first_chunk_us, out.last_chunk_us = state.chunk_times_us[0], state.chunk_times_us[-1]
    out.output_tokens, out.server_input_tokens = usage_tokens(state.usage)
    out.finish_reason = state.finish_reason


def _fail(out: Outcome, status: str, phase: list, why: str) -> None:
    """Status and BLIS's message for a failure in the given phase (spec §5.5)."""
    out.status = status
    where = phase[0]
    if where == "headers":
        out.error_message = f"HTTP {'timeout' if status == 'timeout' else 'error'}: {why}"
    elif where == "error-body":
        what = "body read timed out" if status == "timeout" else "body read failed"
        out.error_message = f"HTTP {phase[1]}: ({what}: {why})"
    elif where == "stream":
        out.error_message = f"streaming {'timeout' if status == 'timeout' else 'error'}: {why}"
    else:  # non-streaming body read: times and chunk count are not kept
        out.error_message = f"read {'timeout' if status == 'timeout' else 'error'}: {why}"
        out.first_chunk_us = out.last_chunk_us = out.num_chunks = 0


def _describe(e: BaseException, default: str) -> str:
    text = str(e)
    return text if text else default
