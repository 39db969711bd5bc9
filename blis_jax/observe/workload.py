"""The workload observe sends: the project's generators, as `run` builds it (spec §1.3).

Four sources, one result (`ObservedWorkload`: a RequestSet whose static rows are sent at their
arrival, plus session links for closed-loop follow-ups):

* a workload spec (`--workload-spec FILE`) → `from_spec`: `workload.generate.generate_workload(...,
  sessions="first_round")`;
* `run`'s own workload (`--workload PRESET --rate R`, `--rate R`) → `from_synthetic`: a
  `SyntheticWorkload` and `scenario.resolve.distribution_workload`, as `run` builds it;
* `--concurrency N` users → `concurrency_spec`, a one-client spec, then `from_spec`.

The CLI (`cli/observe.py`) maps observe's flags onto these.

Observe differs from `run` in two ways (BLIS): no client timeout is pushed into the workload
(deadlines only from the spec), and the request cap defaults to 0 (unbounded; a horizon or
num_requests must bound generation).

Token IDs are not part of a RequestSet (the simulator needs lengths only), so observe draws
them here: uniform in [0, 128000) per request from a NumPy stream keyed by (seed, row), the
prefix-group part shared by every member of the group (`token_ids`). Follow-ups of an
`accumulate` session repeat the previous round's IDs, then the IDs 1..n of its n output
tokens, then fresh IDs (spec §4.7).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from blis_jax.errors import ConfigError
from blis_jax.observe.prompts import group_prefix_lengths
from blis_jax.workload.distribution import (
    DISTRIBUTION_CLIENT,
    OUTPUT_DEFAULT,
    PROMPT_DEFAULT,
    SHARED_PREFIX_GROUP,
    GaussianLength,
    generate_distribution,
)
from blis_jax.workload.requests import RequestSet
from blis_jax.workload.sessions import SessionLinks

TOKEN_ID_RANGE = 128_000
_TOKEN_STREAM, _PREFIX_STREAM = 0x746F6B, 0x707265  # "tok", "pre"


@dataclasses.dataclass(frozen=True, eq=False)
class ObservedWorkload:
    requests: RequestSet               # static rows first (arrival order), then follow-up rows
    links: SessionLinks                # per row; SessionLinks.none when there are no sessions
    seed: int
    workload_spec: str | None          # header `workload_spec`: the path, `preset:<name>`, or None
    prefix_lengths: dict[str, int]     # group → prefix target length (prefix strings)
    accumulate: tuple[bool, ...]       # per session slot: context_growth == accumulate
    goodput_targets: dict | None = None
    num_sessions: int = 0
    horizon_us: int | None = None      # the spec's horizon (follow-ups beyond it are not created)

    @property
    def static_rows(self) -> np.ndarray:
        return np.flatnonzero(~self.links.follow_up)

    def streaming(self, row: int) -> bool:
        """The client's `streaming` flag (spec clients only; follow-ups never stream)."""
        col = self.requests.trace_columns.get("streaming")
        return bool(col is not None and not self.links.follow_up[row] and col[row] == "true")

    def slo_target_us(self, row: int) -> int:
        col = self.requests.trace_columns.get("slo_target_us")
        return int(col[row]) if col is not None and col[row] else 0


def token_ids(seed: int, row: int, length: int, prefix_group: str = "", prefix_len: int = 0) -> list[int]:
    """Token IDs of a static request: the group's shared prefix IDs, then fresh IDs."""
    prefix_len = min(prefix_len, length) if prefix_group else 0
    ids: list[int] = []
    if prefix_len:
        ids = group_token_ids(seed, prefix_group, prefix_len)
    return ids + fresh_ids(seed, row, length - prefix_len)


def fresh_ids(seed: int, row: int, n: int, round_index: int = 0) -> list[int]:
    rng = np.random.Generator(np.random.PCG64([_TOKEN_STREAM, seed & 0xFFFFFFFF, row, round_index]))
    return rng.integers(0, TOKEN_ID_RANGE, size=max(n, 0)).tolist()


def group_token_ids(seed: int, group: str, n: int) -> list[int]:
    key = [_PREFIX_STREAM, seed & 0xFFFFFFFF, *group.encode()]
    return np.random.Generator(np.random.PCG64(key)).integers(0, TOKEN_ID_RANGE, size=n).tolist()


def follow_up_ids(seed: int, row: int, length: int, previous: list[int] | None, completion_tokens: int,
                  round_index: int, prefix_ids: list[int]) -> list[int]:
    """IDs of a follow-up: [previous | 1..n | fresh] with accumulate (`previous` given),
    else [prefix | fresh]; cut or filled with fresh IDs to `length`."""
    head = previous + list(range(1, completion_tokens + 1)) if previous is not None else list(prefix_ids)
    head = head[:length]
    return head + fresh_ids(seed, row, length - len(head), round_index)


# --------------------------------------------------------------------------- sources


def from_synthetic(synthetic, seed: int, horizon_us: int | None, label: str | None = None,
                   warn=None) -> ObservedWorkload:
    """`run`'s own workload (a `scenario.SyntheticWorkload`: distribution or preset), as `run`
    builds it; observe passes `timeout_s` < 0 (no client deadline) and 0 requests = unbounded.
    `label` is the trace header's `workload_spec` (BLIS: `preset:NAME`)."""
    from blis_jax.scenario.resolve import distribution_workload

    check_bounded(synthetic.num_requests, horizon_us)
    workload = distribution_workload(synthetic, horizon_us or None, warn=warn)
    requests = generate_distribution(workload, seed)
    groups = {SHARED_PREFIX_GROUP: workload.prefix_tokens} if workload.prefix_tokens > 0 else {}
    return ObservedWorkload(requests=requests, links=SessionLinks.none(len(requests)), seed=seed,
                            workload_spec=label,
                            prefix_lengths=groups, accumulate=())


def _length_dist(length: GaussianLength) -> dict:
    return {"type": "gaussian", "params": {"mean": float(length.mean), "std_dev": float(length.std),
                                           "min": int(length.min), "max": int(length.max)}}


def concurrency_spec(concurrency: int, think_time_us: int, seed: int, num_requests: int,
                     prompt: GaussianLength = PROMPT_DEFAULT, output: GaussianLength = OUTPUT_DEFAULT,
                     prefix_tokens: int = 0) -> dict:
    """The workload spec v2 of `concurrency` users of one client (BLIS's --concurrency)."""
    client = {"id": DISTRIBUTION_CLIENT, "concurrency": int(concurrency), "think_time_us": int(think_time_us),
              "input_distribution": _length_dist(prompt), "output_distribution": _length_dist(output)}
    if prefix_tokens > 0:
        client.update(prefix_group=SHARED_PREFIX_GROUP, prefix_length=int(prefix_tokens))
    return {"version": "2", "seed": int(seed), "num_requests": int(num_requests), "clients": [client]}


def from_spec(source, seed: int | None, num_requests: int | None, horizon_us: int | None,
              label: str | None) -> ObservedWorkload:
    """A workload spec v2 (a YAML path or a parsed mapping); `num_requests` and `horizon_us`
    override the spec's, `seed` None keeps the spec's own. `label` is the trace header's
    `workload_spec`."""
    from blis_jax.workload.generate import generate_workload
    from blis_jax.workload.inference_perf import expand_inference_perf
    from blis_jax.workload.sessions import closed_loop_requests
    from blis_jax.workload.spec import load_spec, parse_spec

    spec = load_spec(source) if isinstance(source, str) else parse_spec(source)
    check_bounded(num_requests or spec.num_requests or 0, horizon_us or spec.horizon or 0)
    generated = generate_workload(spec, seed, num_requests=num_requests or None,
                                  horizon_us=horizon_us or None, timeout_s=None, sessions="first_round")
    expanded = expand_inference_perf(spec)
    # prefix strings for every group a listed client names (the last client's length wins);
    # cohort members are not listed, so their groups get none (BLIS)
    listed = [(c.prefix_group or "", c.prefix_length or 0) for c in expanded.clients]
    requests, links = generated.requests, SessionLinks.none(len(generated.requests))
    accumulate: tuple[bool, ...] = ()
    if generated.sessions:
        requests, links = closed_loop_requests(generated)
        accumulate = tuple(p.context_growth == "accumulate" for p in generated.sessions)
    targets = spec.goodput_slo_targets
    return ObservedWorkload(requests=requests, links=links, seed=generated.seed, workload_spec=label,
                            prefix_lengths=group_prefix_lengths(listed), accumulate=accumulate,
                            goodput_targets={k: dict(v) for k, v in targets.items()} if targets else None,
                            num_sessions=links.num_sessions, horizon_us=spec.horizon or None)


def check_bounded(num_requests: int | None, horizon_us: int | None) -> None:
    """Generation must be bounded by a request count or a horizon (BLIS's message)."""
    if (num_requests or 0) <= 0 and not horizon_us:
        raise ConfigError("Workload requires either num_requests, --num-requests, or --horizon to bound generation")
