"""inference-perf `shared_prefix` + `stages` expansion (spec §4.11, latency-models §5.3).

`expand_inference_perf(spec)` turns a spec with an `inference_perf` section into an ordinary
v2 spec with explicit clients — P·U per stage (P system prompts × U users), client
`prompt-p-user-u` (multi-stage: `stage-s-prompt-p-user-u`), tenant and prefix group
`prompt-p` (prefix = `system_prompt_len` tokens), SLO class standard, constant input
`question_len` and output `output_len`. This is `convert inference-perf`'s YAML form and the
open-loop extension's generator input; `run` generates inference-perf specs with BLIS's own
expansion instead (`go_generator._expand_inference_perf`, blis-rng §8: normalized-exponential
and Poisson factories that YAML cannot carry, so a converted spec generates differently, as in
BLIS):

* **single stage, single-turn**: N = ⌊rate·duration⌋ requests split evenly (the first N mod
  P·U clients get one more). Each client gets one lifecycle window [0, duration] with
  `trace_rate` = its count / duration, which per-window generation turns into BLIS's
  normalized-exponential sampler: exactly that many Poisson-like arrivals, rescaled to span
  the stage.
* **multi-stage**: per stage a full client set with a lifecycle window at the stage's
  cumulative offset and Poisson arrivals at exactly stage_rate/(P·U) — written as
  `gamma {shape: 1, scale: P·U/stage_rate s}`, an exponential IAT whose explicit scale pins the
  rate (per-phase rate normalization would otherwise rescale it). aggregate_rate = Σ stage
  rates; each rate_fraction is stage_rate/(P·U·Σ rates) for the record.
* **multi-turn** (`enable_multi_turn_chat`): one single-session, closed-loop reasoning client
  per user and stage; max_rounds = the client's even share of ⌊rate·duration⌋, think time
  ⌊P·U/rate·10⁶⌋ µs, no context growth. The session starts at one Poisson draw at
  stage_rate/(P·U) (offset into the stage window for multi-stage). BLIS tags round 0 with
  reason_ratio 0.01: its reason-ratio sampler is a constant-0 length sampler, floored at 1 %.

`num_requests` defaults to Σ ⌊rate·duration⌋ when the spec does not set it.

**`multi_turn_mode`** (blis-jax extension, `inference_perf.multi_turn_mode`, multi-turn chat
only): `closed-loop` (default) is BLIS's encoding above. `open-loop` is inference-perf's own load
generator, which sends at the stage rate whatever the completions: per stage and user a client
with Poisson arrivals at exactly stage_rate/(P·U) inside the stage window — the multi-stage
single-turn clients, for one stage as well — input = system prompt (prefix group `prompt-p`) +
question, output = output_len, no context growth. Every request stays labelled with its user:
after generation `label_open_loop_users` gives each client's requests one session id
(`session-<client>-0`, as a closed-loop session of that client would have) and round indices
0, 1, 2, … in arrival order; nothing in the engine reads these labels. Counts are Poisson
(≈ rate·duration per stage); `num_requests` defaults to 0 (the stage windows bound generation),
and a `num_requests` the spec sets still caps the merged list. `convert inference-perf` writes
the same clients, arrival processes and lengths, but the plain v2 schema cannot carry the user
labels, and plain clients draw BLIS's token IDs between arrivals (this mode draws none, so its
arrivals do not depend on the lengths), so the converted spec's arrivals differ.
"""

from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType

import numpy as np

from blis_jax.workload.spec import (
    MULTI_TURN_MODES,
    ArrivalSpec,
    ClientSpec,
    DistSpec,
    LifecycleSpec,
    MultiTurnSpec,
    ReasoningSpec,
    WindowSpec,
    WorkloadSpec,
    validate_spec,
)

INFERENCE_PERF_SLO_CLASS = "standard"
CLOSED_LOOP, OPEN_LOOP = MULTI_TURN_MODES
# BLIS's inference-perf reason-ratio sampler: constant 0, floored at 1 (percent) → 0.01.
_REASON_RATIO = DistSpec("constant", MappingProxyType({"value": 0.0}))


def stage_request_count(rate: float, duration_s: float) -> int:
    """⌊rate·duration⌋, robust to float noise (5.0 · 60 is 300, not 299)."""
    return math.floor(rate * duration_s + 1e-9)


def even_split(total: int, parts: int) -> list[int]:
    """`total` split into `parts` shares differing by at most one, larger shares first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def expand_inference_perf(spec: WorkloadSpec) -> WorkloadSpec:
    """The explicit v2 spec (clients, rates, lifecycles) of an inference-perf spec."""
    ip = spec.inference_perf
    if ip is None:
        return spec
    sp = ip.shared_prefix
    prompts, users = sp.num_unique_system_prompts, sp.num_users_per_system_prompt
    n_clients = prompts * users
    total_rate = sum(s.rate for s in ip.stages)
    multi_stage = len(ip.stages) > 1
    open_loop = sp.enable_multi_turn_chat and ip.multi_turn_mode == OPEN_LOOP
    constant = {"input": DistSpec("constant", MappingProxyType({"value": float(sp.question_len)})),
                "output": DistSpec("constant", MappingProxyType({"value": float(sp.output_len)}))}
    clients: list[ClientSpec] = []
    offset_us = 0
    counts = []
    for s, stage in enumerate(ip.stages):
        duration_us = round(stage.duration * 1e6)
        count = stage_request_count(stage.rate, stage.duration)
        counts.append(count)
        shares = even_split(count, n_clients)
        window = (offset_us, offset_us + duration_us)
        for i in range(n_clients):
            p, u = divmod(i, users)
            name = f"prompt-{p}-user-{u}" if not multi_stage else f"stage-{s}-prompt-{p}-user-{u}"
            client = ClientSpec(
                id=name, tenant_id=f"prompt-{p}", slo_class=INFERENCE_PERF_SLO_CLASS,
                rate_fraction=stage.rate / (n_clients * total_rate),
                input_distribution=constant["input"], output_distribution=constant["output"],
                prefix_group=f"prompt-{p}" if sp.system_prompt_len > 0 else "",
                prefix_length=sp.system_prompt_len if sp.system_prompt_len > 0 else None)
            if multi_stage or open_loop:
                # Exponential IATs with an explicit scale: Poisson at exactly stage_rate/(P·U).
                mean_iat_us = n_clients / stage.rate * 1e6
                client = dataclasses.replace(
                    client, arrival=ArrivalSpec("gamma", shape=1.0, scale=mean_iat_us),
                    lifecycle=LifecycleSpec((WindowSpec(*window),)))
            else:
                client = dataclasses.replace(client, arrival=ArrivalSpec("poisson"))
            if open_loop:
                pass    # Poisson at stage_rate/(P·U) in the window; users labelled after generation
            elif sp.enable_multi_turn_chat:
                if shares[i] == 0:
                    continue
                think_us = math.floor(n_clients / stage.rate * 1e6)
                client = dataclasses.replace(client, reasoning=ReasoningSpec(
                    reason_ratio_distribution=_REASON_RATIO,
                    multi_turn=MultiTurnSpec(max_rounds=shares[i], think_time_us=think_us,
                                             single_session=True)))
            elif not multi_stage:
                # Normalized exponential: exactly shares[i] arrivals spanning the stage.
                client = dataclasses.replace(client, lifecycle=LifecycleSpec(
                    (WindowSpec(*window, trace_rate=shares[i] / stage.duration),)))
            clients.append(client)
        offset_us += duration_us
    expanded = dataclasses.replace(
        spec, inference_perf=None, aggregate_rate=total_rate, clients=tuple(clients),
        num_requests=spec.num_requests or (0 if open_loop else sum(counts)))
    return validate_spec(expanded)


def is_open_loop_multi_turn(spec: WorkloadSpec) -> bool:
    """Whether `spec` is an inference-perf multi-turn spec in `open-loop` mode."""
    ip = spec.inference_perf
    return ip is not None and ip.shared_prefix.enable_multi_turn_chat and ip.multi_turn_mode == OPEN_LOOP


def label_open_loop_users(generated):
    """`generated` (a `generate.GeneratedWorkload` of an open-loop multi-turn spec) with each
    client's (user's) requests labelled as one session: session id `session-<client index>-0`,
    round index 0, 1, 2, … in arrival order. Arrivals, lengths and order are unchanged."""
    req = generated.requests
    index_of = {rc.spec.id: rc.index for rc in generated.clients}
    users, owner = np.unique(req.client_id, return_inverse=True)
    session_of_user = np.array([f"session-{index_of[str(u)]}-0" for u in users] or [""], dtype=object)
    # Rows are in arrival order (stable), so a row's rank among its user's rows is its round.
    order = np.argsort(owner, kind="stable")
    sorted_owner = owner[order]
    first = np.searchsorted(sorted_owner, sorted_owner, side="left")
    rounds = np.empty(len(req), dtype=np.int64)
    rounds[order] = np.arange(len(req), dtype=np.int64) - first
    labelled = dataclasses.replace(req, session_id=session_of_user[owner].astype(str) if len(req) else req.session_id,
                                   round_index=rounds)
    return dataclasses.replace(generated, requests=labelled)
