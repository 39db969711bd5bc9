"""What one request sends (spec §3): endpoint, JSON body, headers.

Bodies are compact JSON with keys in alphabetical order, as BLIS's Go encoder writes them
(servers do not care; it makes bodies comparable byte for byte with BLIS's tests).
"""

from __future__ import annotations

import dataclasses
import json
import math
import uuid

from blis_jax.workload.requests import PRIORITY_BY_SLO_CLASS, DEFAULT_PRIORITY

API_FORMATS = ("completions", "chat")
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
UNCONSTRAINED_MAX_TOKENS = 2_147_483_647  # completions --unconstrained-output (int32 max)
DEFAULT_MAX_TOKENS = 2048                 # a request without a sampled output length
PROBE_MAX_TOKENS = 1
PREWARM_MAX_TOKENS = 64
PREWARM_PROMPT = "warm " * 256


def vllm_priority(slo_class: str) -> int:
    """vLLM priority of an SLO class (lower = more urgent); unknown classes as standard."""
    return PRIORITY_BY_SLO_CLASS.get(slo_class, DEFAULT_PRIORITY)


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """The per-request inputs of a body: prompt text and the workload's labels."""

    prompt: str
    output_len: int = 0
    stream: bool = False
    slo_class: str = ""
    tenant_id: str = ""
    slo_target_us: int = 0
    max_tokens: int | None = None   # probe / prewarm: fixed max_tokens, never min_tokens


def request_body(spec: RequestSpec, *, model: str, api_format: str, unconstrained: bool = False) -> dict:
    body: dict = {"model": model, "stream": spec.stream}
    if api_format == "chat":
        body["messages"] = [{"content": spec.prompt, "role": "user"}]
    else:
        body["prompt"] = spec.prompt
    if spec.max_tokens is not None:
        body["max_tokens"] = spec.max_tokens
    elif unconstrained:
        if api_format == "completions":
            body["max_tokens"] = UNCONSTRAINED_MAX_TOKENS
    else:
        # vLLM's min_tokens = max_tokens makes the server generate exactly the sampled length.
        body["max_tokens"] = spec.output_len if spec.output_len > 0 else DEFAULT_MAX_TOKENS
        if spec.output_len > 0:
            body["min_tokens"] = spec.output_len
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    if spec.slo_class:
        body["priority"] = vllm_priority(spec.slo_class)
    return dict(sorted(body.items()))


def encode_body(body: dict) -> bytes:
    return json.dumps(body, separators=(",", ":"), sort_keys=True, ensure_ascii=False).encode()


def request_headers(spec: RequestSpec, *, api_key: str = "", request_id: str | None = None) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "x-request-id": request_id or str(uuid.uuid4())}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    if spec.tenant_id:
        headers["x-gateway-inference-fairness-id"] = spec.tenant_id
    if spec.slo_class:
        headers["x-gateway-inference-objective"] = spec.slo_class
    if spec.slo_target_us > 0:
        headers["x-slo-ttft-ms"] = str(math.ceil(spec.slo_target_us / 1000))
    return headers


def endpoint_url(server_url: str, api_format: str) -> str:
    """All trailing slashes stripped, the endpoint path appended verbatim (BLIS)."""
    return server_url.rstrip("/") + ENDPOINTS[api_format]
