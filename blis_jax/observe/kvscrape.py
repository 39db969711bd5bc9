"""Observed KV-cache hit rate from the server's Prometheus `/metrics` (spec §7).

Scraped right before dispatching and after it drained; the difference of vLLM's counters over
that window gives `observed_kv_metrics`, which `calibrate --sim-metrics` compares with the
simulated cache hit rate. Any failure only drops the block (a warning), never the run.
"""

from __future__ import annotations

import math

from blis_jax.observe.client import Client

TIERED = ("vllm:kv_offload_tiering_block_hits", "vllm:kv_offload_tiering_block_queries")
TIERED_TIMES = ("vllm:kv_offload_tiering_read_time", "vllm:kv_offload_tiering_write_time")
GPU = ("vllm:gpu_prefix_cache_hits", "vllm:gpu_prefix_cache_queries")
GPU_GAUGE = "vllm:gpu_prefix_cache_hit_rate"


class ScrapeError(Exception):
    pass


def parse_prometheus(text: str) -> dict[str, float]:
    """Text exposition → family → sum over its series (`_total` folded into the family)."""
    out: dict[str, float] = {}
    for raw in text.split("\n"):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        brace, space = line.find("{"), line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name = line[:brace]
            close = line.find("}", brace)
            if close == -1:
                continue
            rest = line[close + 1:]
        elif space != -1:
            name, rest = line[:space], line[space + 1:]
        else:
            continue
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        name = name.removesuffix("_total")
        out[name] = out.get(name, 0.0) + value
    return out


async def scrape(client: Client, url: str) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {client.config.api_key}"} if client.config.api_key else {}
    import aiohttp

    try:
        async with client.session.get(url, headers=headers,
                                      timeout=aiohttp.ClientTimeout(total=client.config.timeout_s)) as resp:
            text = await resp.text(errors="replace")
            if resp.status != 200:
                raise ScrapeError(f"GET {url}: HTTP {resp.status}")
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        raise ScrapeError(f"GET {url}: {e or type(e).__name__}") from None
    return parse_prometheus(text)


def derive_kv_metrics(start: dict[str, float], end: dict[str, float], vllm_commit: str = "") -> dict:
    """The `observed_kv_metrics` block, or ScrapeError naming why there is none."""
    def delta(name: str) -> float:
        return end.get(name, 0.0) - start.get(name, 0.0)

    def counters(hits: str, queries: str) -> tuple[float, float]:
        dh, dq = delta(hits), delta(queries)
        if dh < 0 or dq < 0:
            raise ScrapeError(f"counter {hits if dh < 0 else queries} went backwards between scrapes")
        if dq <= 0:
            raise ScrapeError(f"no {queries} during the observation window")
        if dh > dq:
            raise ScrapeError(f"{hits} grew more than {queries} ({dh:g} > {dq:g})")
        return dh, dq

    if TIERED[1] in end:
        dh, dq = counters(*TIERED)
        block = {"source": "tiered", "hit_rate": dh / dq, "block_hits": math.floor(dh + 0.5),
                 "block_queries": math.floor(dq + 0.5)}
        read, write = max(delta(TIERED_TIMES[0]), 0.0), max(delta(TIERED_TIMES[1]), 0.0)
        if read:
            block["read_time_total"] = read
        if write:
            block["write_time_total"] = write
    elif GPU[1] in end:
        dh, dq = counters(*GPU)
        block = {"source": "gpu-prefix-cache-fallback", "hit_rate": dh / dq, "block_hits": math.floor(dh + 0.5),
                 "block_queries": math.floor(dq + 0.5)}
    elif GPU_GAUGE in end:
        block = {"source": "gpu-prefix-cache-fallback", "hit_rate": end[GPU_GAUGE], "block_hits": 0, "block_queries": 0}
    else:
        raise ScrapeError("no recognized KV cache counters found in /metrics")
    if vllm_commit:
        block["vllm_commit"] = vllm_commit
    return block
