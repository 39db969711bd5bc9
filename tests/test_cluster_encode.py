"""The E/P/D encode pool (blis_jax/cluster/encode.py; blis-features §3.10, §4.10, INV-1;
blis-rng §10.2): `--encode-instances` and `--encode-decider never|always|multimodal`.

No BLIS reference case exists for it; the expectations here are computed independently from
the spec's rules: an encode decision (when the decider fires) uses the main routing policy
before the normal / decode decision, so under round-robin it takes one counter step; it takes
no time and creates no sub-request (the encode instances serve nothing); with no encode
instance the request is an encode routing rejection and goes no further.

Requests are light (a few per second, short prompts) so that instance load never matters;
round-robin reads no instance state, so `handled_by` alone follows from the counter.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from cluster_helpers import after_each_chunk
from engine_helpers import latency_model

from blis_jax.cluster import encode
from blis_jax.cluster.simulate import ClusterConfig, simulate_cluster
from blis_jax.engine import output as so
from blis_jax.engine.params import make_engine_params
from blis_jax.errors import ConfigError
from blis_jax.metrics import anomaly_counters
from blis_jax.output import format_anomaly_section
from blis_jax.workload.requests import make_request_set

N = 24
# request k carries image tokens iff k is in this set (others: none), as a replayed trace or a
# generated multimodal client stores them
MULTIMODAL = frozenset({1, 2, 3, 7, 10, 11, 12, 20})


def requests(multimodal=MULTIMODAL):
    rng = np.random.default_rng(5)
    image = np.array([str(64 * (k in multimodal)) for k in range(N)])
    return make_request_set(request_id=np.arange(N), arrival_us=np.arange(N) * 200_000,
                            input_len=rng.integers(32, 200, N), output_len=rng.integers(4, 40, N),
                            trace_columns={"text_tokens": np.full(N, "10"), "image_tokens": image,
                                           "audio_tokens": np.full(N, "0"), "video_tokens": np.full(N, "")})


def run(reqs=None, capture: list | None = None, **cluster):
    params = make_engine_params(max_num_seqs=32, max_num_batched_tokens=2048, total_kv_blocks=4000)
    config = ClusterConfig(**{"routing_policy": "round-robin", **cluster})
    if capture is None:
        return simulate_cluster(reqs or requests(), params, latency_model(), config)
    with after_each_chunk(capture.append):
        return simulate_cluster(reqs or requests(), params, latency_model(), config)


def conserved(out) -> None:
    """INV-1: every request is in exactly one bucket (status codes are exclusive by construction;
    here: the encode rejections are nowhere else and never reached an instance)."""
    rejected = out.status == so.ENCODE_REJECTED
    assert np.all(out.handled_by[rejected] == -1)
    assert np.all(out.ttft_us[rejected] == -1) and np.all(out.e2e_us[rejected] == -1)
    assert np.all(so.is_completed(out.status) | rejected)  # light load, no horizon: the rest complete


def test_empty_encode_pool_with_always_rejects_every_request():
    out = run(num_instances=2, encode_decider="always")
    assert np.all(out.status == so.ENCODE_REJECTED) and np.all(out.encode_by == -1)
    conserved(out)
    counters = anomaly_counters(out, requests())
    assert counters.encode_routing_rejections == N and counters.rejected_routing == 0
    assert f"Encode Routing Rejections: {N}" in format_anomaly_section(counters)


def test_multimodal_decider_rejects_only_multimodal_requests_and_leaves_the_counter():
    out = run(num_instances=2, encode_decider="multimodal")
    mm = np.isin(np.arange(N), sorted(MULTIMODAL))
    np.testing.assert_array_equal(out.status == so.ENCODE_REJECTED, mm)
    conserved(out)
    # a rejected encode decision picked nothing: the round-robin counter moves only for the rest
    np.testing.assert_array_equal(out.handled_by[~mm], np.arange((~mm).sum()) % 2)
    assert anomaly_counters(out, requests()).encode_routing_rejections == len(MULTIMODAL)


def expected_round_robin(fires, encode_slots, normal_slots):
    """(encode slot, serving slot) per request from one shared round-robin counter: the encode
    decision (when it fires) takes a step first, then the normal decision."""
    counter, enc, served = 0, [], []
    for f in fires:
        if f:
            enc.append(encode_slots[counter % len(encode_slots)])
            counter += 1
        else:
            enc.append(-1)
        served.append(normal_slots[counter % len(normal_slots)])
        counter += 1
    return np.array(enc), np.array(served)


@pytest.mark.parametrize("decider", ["always", "multimodal"])
def test_encode_decision_advances_the_round_robin_counter(decider):
    states = []
    out = run(capture=states, num_instances=4, encode_instances=2, encode_decider=decider)
    fires = np.isin(np.arange(N), sorted(MULTIMODAL)) if decider == "multimodal" else np.ones(N, bool)
    # without PD pools the encode pool is the first indices (pools by index: prefill, decode,
    # shared, encode; the instances after the pools serve normally)
    want_enc, want_served = expected_round_robin(fires, encode_slots=[0, 1], normal_slots=[2, 3])
    if decider == "always":  # two steps per request: every encode pick is slot 0, every request slot 3
        assert set(want_enc) == {0} and set(want_served) == {3}
    np.testing.assert_array_equal(out.handled_by, want_served)
    np.testing.assert_array_equal(out.encode_by, want_enc)
    assert np.all(so.is_completed(out.status))
    # the encode instances receive nothing: no request, no step
    assert not np.isin(out.handled_by, [0, 1]).any()
    final = states[-1].instances
    assert np.all(np.asarray(final.steps)[:2] == 0) and np.all(np.asarray(final.finished)[:2] == 0)


@pytest.mark.slow  # a cluster program of its own (~10-20 s on 2 cores): the default suite stays under 10 min
def test_encode_pool_with_pd_pools_takes_the_last_indices_and_a_step_before_decode():
    """Prefill slot 0, decode slot 1, encode slots 2-3; pd-decider always: per request the
    encode, decode and prefill decisions take three counter steps."""
    from blis_jax.config.kv_capacity import kv_bytes_per_token
    from blis_jax.config.model import load_model

    states = []
    params = make_engine_params(max_num_seqs=32, max_num_batched_tokens=2048, total_kv_blocks=4000)
    config = ClusterConfig(num_instances=4, prefill_instances=1, decode_instances=1, pd_decider="always",
                           encode_instances=2, encode_decider="always")
    with after_each_chunk(states.append):
        out = simulate_cluster(requests(), params, latency_model(), config,
                               kv_bytes_per_token=kv_bytes_per_token(load_model("meta-llama/llama-3.1-8b-instruct"), 1))
    np.testing.assert_array_equal(out.encode_by, [2 + (3 * k) % 2 for k in range(N)])
    assert np.all(out.handled_by == 1) and np.all(so.is_completed(out.status))
    assert np.all(np.asarray(states[-1].instances.steps)[2:] == 0)


@pytest.mark.slow  # a cluster program of its own (~10-20 s on 2 cores): the default suite stays under 10 min
@pytest.mark.parametrize("cluster", [dict(encode_instances=2),   # never: the pool sits idle
                                     dict(encode_instances=2, encode_decider="multimodal")])
def test_encode_instances_without_a_firing_decider_change_nothing(cluster):
    """A 2-instance cluster plus an idle encode pool of 2 (slots 0-1; a decider that never
    fires here) serves every request exactly as the plain 2-instance cluster, on slots 2-3."""
    reqs = requests(multimodal=frozenset())
    plain = run(reqs, num_instances=2)
    with_pool = run(reqs, num_instances=4, **cluster)
    np.testing.assert_array_equal(with_pool.handled_by, plain.handled_by + 2)
    assert plain.encode_by is None and np.all(with_pool.encode_by == -1)  # no decision was made
    for field in ("status", "ttft_us", "e2e_us", "itl_sum_us", "sched_delay_us"):
        np.testing.assert_array_equal(getattr(with_pool, field), getattr(plain, field), err_msg=field)


def test_never_decider_without_a_pool_is_the_default_program():
    config = ClusterConfig(num_instances=2, encode_decider="never")
    assert not config.encode and config == ClusterConfig(num_instances=2)


def test_multimodal_flag_reads_the_modality_columns():
    reqs = requests()
    np.testing.assert_array_equal(encode.multimodal(reqs), np.isin(np.arange(N), sorted(MULTIMODAL)))
    video = dataclasses.replace(reqs, trace_columns={"video_tokens": np.array(["0"] * (N - 1) + ["5"])})
    assert encode.multimodal(video).tolist() == [False] * (N - 1) + [True]
    assert not encode.fires("multimodal", dataclasses.replace(reqs, trace_columns={})).any()
    assert encode.fires("always", reqs).all() and not encode.fires("never", reqs).any()


@pytest.mark.parametrize("settings, message", [
    (dict(encode_instances=-1), "--encode-instances must be an integer >= 0"),
    (dict(encode_instances=3), "sum to 3 but --num-instances is 2"),
    (dict(encode_instances=1, prefill_instances=1, decode_instances=1), "sum to 3 but --num-instances is 2"),
    (dict(encode_decider="audio"), "--encode-decider 'audio' is not supported"),
    (dict(encode_instances=1, model_autoscaler_interval_us=1e6), "with the autoscaler are not simulated"),
])
def test_flag_validation(settings, message):
    with pytest.raises(ConfigError, match=message):
        ClusterConfig(num_instances=2, **settings).validate()


def test_idle_encode_pool_warns_has_no_effect():
    from blis_jax.scenario.config import ScenarioConfig, SyntheticWorkload
    from blis_jax.scenario.resolve import resolve_deployment

    warnings = []
    run_config = ScenarioConfig(cluster=ClusterConfig(num_instances=3, encode_instances=1),
                                workload=SyntheticWorkload(num_requests=4))
    resolve_deployment(run_config, horizon_us=None, warn=warnings.append)
    assert any('encode_instances=1 has no effect because' in w for w in warnings), warnings
    warnings.clear()
    resolve_deployment(dataclasses.replace(run_config, cluster=ClusterConfig(
        num_instances=3, encode_instances=1, encode_decider="always")), horizon_us=None, warn=warnings.append)
    assert not any("has no effect" in w for w in warnings)


def test_cli_flags_reach_the_cluster_config():
    from blis_jax.cli.app import UsageError, build_parser
    from blis_jax.cli.scenario_flags import cluster

    args = build_parser().parse_args(["run", "--num-instances", "3", "--encode-instances", "1",
                                      "--encode-decider", "multimodal"])
    config = cluster(args)
    assert (config.encode_instances, config.encode_decider) == (1, "multimodal")
    with pytest.raises(UsageError, match="--encode-decider: invalid choice: 'sometimes'"):
        build_parser().parse_args(["run", "--encode-decider", "sometimes"])


def test_generated_and_replayed_multimodal_requests_fire_the_decider(tmp_path):
    """A workload spec's multimodal client (half its requests carry 2 images) and the same
    requests written as a TraceV2 and read back: the decider fires exactly on those with images."""
    from blis_jax.workload.generate import generate_requests
    from blis_jax.workload.tracev2 import TraceHeader, read_trace, write_trace

    const = lambda v: {"type": "constant", "params": {"value": v}}  # noqa: E731
    mm = {"text_distribution": const(40), "image_distribution": const(500),
          "image_count_distribution": {"type": "empirical", "params": {"0": 0.5, "2": 0.5}}}
    spec = {"version": "2", "seed": 11, "aggregate_rate": 20.0, "num_requests": 60,
            "clients": [{"id": "mm", "rate_fraction": 1.0, "arrival": {"process": "poisson"}, "multimodal": mm,
                         "output_distribution": const(8)}]}
    generated = generate_requests(spec)
    with_images = generated.input_len > 40  # input = text + images
    assert 0 < with_images.sum() < len(generated)
    np.testing.assert_array_equal(encode.fires("multimodal", generated), with_images)
    header_path, data_path = write_trace(tmp_path / "t", TraceHeader(), generated)
    _, replayed = read_trace(header_path, data_path)
    np.testing.assert_array_equal(encode.fires("multimodal", replayed), replayed.input_len > 40)


@pytest.mark.slow  # a cluster program of its own (~10-20 s on 2 cores): the default suite stays under 10 min
def test_least_loaded_encode_decision_draws_from_the_router_stream():
    """Least-loaded with idle instances ties everywhere: each decision is one Intn(2) of the
    `router` stream (blis-rng §10.1-10.2). With the encode decider always, the encode draw comes
    first, so the request's own pick is the second draw of each pair (the reference Go
    generator, GoRand, gives the expected sequence)."""
    from blis_jax.rng.go_rand import GoRand
    from blis_jax.rng.streams import ROUTER, subsystem_seed

    # sparse, short requests: every instance is idle (live signals) at every decision
    reqs = make_request_set(request_id=np.arange(N), arrival_us=np.arange(N) * 500_000,
                            input_len=np.full(N, 64), output_len=np.full(N, 4))
    states = []
    out = run(reqs, capture=states, num_instances=4, encode_instances=2, encode_decider="always",
              routing_policy="least-loaded", snapshot_refresh_interval_us=0)
    go = GoRand(subsystem_seed(42, ROUTER))
    draws = np.array([go.intn(2) for _ in range(2 * N)])
    np.testing.assert_array_equal(out.encode_by, draws[0::2])
    np.testing.assert_array_equal(out.handled_by, 2 + draws[1::2])
    plain = run(reqs, num_instances=2, routing_policy="least-loaded", snapshot_refresh_interval_us=0)
    go = GoRand(subsystem_seed(42, ROUTER))
    np.testing.assert_array_equal(plain.handled_by, [go.intn(2) for _ in range(N)])
