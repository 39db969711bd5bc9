"""The encode pool of E/P/D disaggregation (blis-features §3.10, §4.10; blis-rng §10.2).

* `--encode-instances N`: the last pool indices (after prefill, decode and shared; pd.pool_masks)
  are Encode instances. They serve nothing: no request, sub-request or prefill/decode/normal
  routing decision ever lands on them, so they stay idle (their metrics block is an idle
  instance's).
* `--encode-decider`: `never`, `always`, or `multimodal` (fires for a request with image, audio
  or video tokens, §4.10; the counts are the workload's per-request `*_tokens` columns).
  When it fires, an encode-pool routing decision is made with the cluster's main routing policy
  (its round-robin counter, or a `router`-stream tie-break draw for least-loaded / weighted),
  before the prefill/decode (or normal) decision, and takes zero time: no encode sub-request.
  With no routable encode instance the request ends as an encode routing rejection (its own
  terminal bucket in request conservation, INV-1), never reaching an instance.

The decision per request is known before the run (it reads only the request), so the host
computes it (`fires`) and the loop reads one bool per request.
"""

from __future__ import annotations

import numpy as np

from blis_jax.errors import ConfigError
from blis_jax.workload.requests import RequestSet

ENCODE_DECIDERS = ("never", "always", "multimodal")
MODALITY_COLUMNS = ("image_tokens", "audio_tokens", "video_tokens")


def check_decider(decider: str) -> str:
    if decider not in ENCODE_DECIDERS:
        raise ConfigError(f"--encode-decider {decider!r} is not supported; use one of {', '.join(ENCODE_DECIDERS)}")
    return decider


def multimodal(requests: RequestSet) -> np.ndarray:
    """Per request: it carries image, audio or video tokens (generated multimodal clients and
    replayed TraceV2 rows keep the counts in `trace_columns`; a missing column counts 0)."""
    has = np.zeros(len(requests), bool)
    for column in MODALITY_COLUMNS:
        raw = requests.trace_columns.get(column)
        if raw is None:
            continue
        text = np.char.strip(np.asarray(raw, dtype=str))
        try:
            counts = np.where(text == "", "0", text).astype(np.float64)
        except ValueError as e:
            raise ConfigError(f"trace column {column}: expected token counts (integers), got {e}") from None
        has |= counts > 0
    return has


def fires(decider: str, requests: RequestSet) -> np.ndarray:
    """Per request: the encode decider fires (an encode routing decision is made)."""
    check_decider(decider)
    if decider == "always":
        return np.ones(len(requests), bool)
    if decider == "multimodal":
        return multimodal(requests)
    return np.zeros(len(requests), bool)
