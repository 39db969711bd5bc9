"""Before the measured window (spec §4.3, §6.5): the tokens-per-word probe and the prewarm.

The probe sends the 100 vocabulary words once (max_tokens 1) and reads `usage.prompt_tokens`;
the ratio P/100 sizes every prompt. Outside [1, 3] or on any failure the ratio is 1.0 (BLIS).
The prewarm keeps four workers sending `warm ` × 256 (max_tokens 64) for the given duration so
the server's caches and CUDA graphs are warm; nothing of it is recorded.
"""

from __future__ import annotations

import asyncio
import time

from blis_jax.observe.client import Client
from blis_jax.observe.http_request import PREWARM_MAX_TOKENS, PREWARM_PROMPT, PROBE_MAX_TOKENS, RequestSpec
from blis_jax.observe.prompts import PROBE_PROMPT, VOCABULARY

PROBE_DEADLINE_S = 30.0
RATIO_RANGE = (1.0, 3.0)
PREWARM_WORKERS = 4
PREWARM_PAUSE_S = 0.5


async def probe_ratio(client: Client, warn) -> float:
    """Tokens per word of the server's tokenizer (1.0 when it cannot be measured)."""
    timeout = min(client.config.timeout_s, PROBE_DEADLINE_S)
    out = await client.send(RequestSpec(prompt=PROBE_PROMPT, max_tokens=PROBE_MAX_TOKENS), timeout_s=timeout)
    tokens = out.server_input_tokens
    if out.status != "ok" or tokens <= 0:
        why = out.error_message or "no usage.prompt_tokens in the response"
        warn(f"Prefix token calibration failed ({why}); using 1:1 word-to-token ratio")
        return 1.0
    ratio = tokens / len(VOCABULARY)
    if not RATIO_RANGE[0] <= ratio <= RATIO_RANGE[1]:
        warn(f"Prefix token calibration ratio {ratio:g} outside expected range [1.0, 3.0]; using 1:1 fallback")
        return 1.0
    return ratio


async def prewarm(client: Client, duration_s: float, stop: asyncio.Event, info) -> tuple[int, int]:
    """Send prewarm requests from four workers for `duration_s` (or until `stop`); (sent, failed)."""
    end = time.monotonic() + duration_s
    counts = [0, 0]

    async def worker() -> None:
        while time.monotonic() < end and not stop.is_set():
            out = await client.send(RequestSpec(prompt=PREWARM_PROMPT, max_tokens=PREWARM_MAX_TOKENS))
            counts[0] += 1
            if out.status != "ok":
                counts[1] += 1
                try:
                    await asyncio.wait_for(stop.wait(), timeout=min(PREWARM_PAUSE_S, max(end - time.monotonic(), 0)))
                except TimeoutError:
                    pass

    await asyncio.gather(*(worker() for _ in range(PREWARM_WORKERS)))
    sent, failed = counts
    if sent and failed == sent:
        info(f"Prewarm: {failed}/{sent} requests failed (is the server reachable at {client.config.server_url}?)")
    else:
        info(f"Prewarm: {sent} requests sent, {failed} failed")
    return sent, failed
