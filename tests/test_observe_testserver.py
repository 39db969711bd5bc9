"""The local OpenAI-compatible test server (spec §11): exact output lengths, chat chunks, its
tokenizer, and the concurrency-dependent slowdown of its token timing."""

from __future__ import annotations

import asyncio

from observe_helpers import client_for, run

from blis_jax.observe.http_request import RequestSpec
from blis_jax.observe.prompts import PROBE_PROMPT
from blis_jax.observe.testserver import CHAT_TEMPLATE_TOKENS, OpenAITestServer, ServerConfig, count_tokens


def test_tokenizer_puts_the_probe_in_observes_range():
    assert 100 <= count_tokens(PROBE_PROMPT) <= 300
    assert count_tokens("alpha fig") == 3


def test_min_tokens_exact_length_and_chat_role_chunk():
    async def go():
        async with OpenAITestServer(ServerConfig(ttft_ms=1.0, itl_ms=0.5)) as server:
            async with client_for(server.url, api_format="chat") as chat:
                streamed = await chat.send(RequestSpec(prompt="alpha " * 10, output_len=7, stream=True))
                whole = await chat.send(RequestSpec(prompt="alpha " * 10, output_len=7))
            return streamed, whole
    streamed, whole = run(go())
    # role chunk + 7 token chunks + usage chunk; exactly min_tokens = max_tokens tokens
    assert (streamed.num_chunks, streamed.output_tokens, streamed.finish_reason) == (9, 7, "length")
    assert streamed.server_input_tokens == 20 + CHAT_TEMPLATE_TOKENS
    assert (whole.num_chunks, whole.output_tokens, whole.finish_reason) == (1, 7, "length")


def test_slowdown_stretches_inter_token_time_with_requests_in_flight():
    def span(outcome):
        return (outcome.chunk_times_us[-2] - outcome.chunk_times_us[0]) / 1000  # first → last token

    async def go(n):
        cfg = ServerConfig(ttft_ms=1.0, itl_ms=5.0, slowdown=1.0)
        async with OpenAITestServer(cfg) as server, client_for(server.url) as client:
            spec = RequestSpec(prompt="alpha", output_len=11, stream=True)
            return await asyncio.gather(*(client.send(spec) for _ in range(n)))
    alone = span(run(go(1))[0])
    pair = [span(o) for o in run(go(2))]
    assert 40 <= alone < 85  # 10 gaps of 5 ms (timer slack: 44.0 measured under load; the upper
    # bound leaves room for a loaded machine)
    assert all(90 <= s < 160 for s in pair)  # 10 gaps of 5 ms × (1 + 1·(2 − 1))
