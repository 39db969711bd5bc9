"""Shared pieces of the observe tests: an event loop runner, a raw-response aiohttp server for
exact wire behaviour, and small workloads built directly from a RequestSet. Every server binds
127.0.0.1 (no other network in tests)."""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from blis_jax.observe.client import Client, ClientConfig
from blis_jax.observe.workload import ObservedWorkload
from blis_jax.workload.requests import make_request_set
from blis_jax.workload.sessions import SessionLinks

HOST = "127.0.0.1"


def run(coro):
    return asyncio.run(coro)


@contextlib.asynccontextmanager
async def raw_server(handler, path: str = "/v1/completions", method: str = "POST"):
    """Serve `handler` (an aiohttp handler) on 127.0.0.1; yields the base URL."""
    app = web.Application()
    app.router.add_route(method, path, handler)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, HOST, 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://{HOST}:{port}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def client_for(url: str, *, timeout_s: float = 5.0, api_format: str = "completions", **kw):
    async with Client.make_session(16) as session:
        yield Client(ClientConfig(server_url=url, model=kw.pop("model", "M"), api_format=api_format,
                                  timeout_s=timeout_s, **kw), session)


def workload(arrivals, input_len=None, output_len=None, seed=42, **columns) -> ObservedWorkload:
    n = len(arrivals)
    requests = make_request_set(request_id=list(range(n)), arrival_us=list(arrivals),
                                input_len=input_len or [8] * n, output_len=output_len or [3] * n, **columns)
    return ObservedWorkload(requests=requests, links=SessionLinks.none(n), seed=seed, workload_spec=None,
                            prefix_lengths={}, accumulate=())
