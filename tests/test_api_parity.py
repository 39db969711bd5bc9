"""The library API and the CLI are one simulator: a `ScenarioConfig` built in Python from a
blis-diff case's recorded configuration (case.json's fields, not its flags) simulates to the
same text, byte for byte, as `blis-jax replay` with the case's BLIS flags. The replay tests of
tests/test_cli.py (`-m slow`: every single-instance case and the deterministic cluster cases)
make that comparison with `case_config` after each CLI replay (one compiled program for both);
here, a small `run` the same way."""

from __future__ import annotations

import io
import json

import pytest

from blis_jax.cli import main
from blis_jax.cluster.simulate import ClusterConfig
from blis_jax.scenario import (
    Deployment,
    EngineSettings,
    LoraSettings,
    ScenarioConfig,
    SyntheticWorkload,
    TraceWorkload,
    simulate,
)

CLUSTER_FIELDS = ("num_instances", "routing_policy", "routing_scorers", "admission_policy",
                  "snapshot_refresh_interval_us", "cache_signal_delay_us", "admission_latency_us",
                  "routing_latency_us")
# case.json `other_flags` that are cluster settings of the replay (categories A-E)
OTHER_CLUSTER_FLAGS = ("token_bucket_capacity", "token_bucket_refill_rate", "prefill_instances",
                       "decode_instances", "pd_decider", "prefill_routing_scorers", "decode_routing_scorers",
                       "prefill_decode_instances", "pd_prefix_threshold", "pd_transfer_contention",
                       "pd_transfer_bandwidth")
# ... and deployment settings (per-pool overrides, the legacy CPU KV tier)
OTHER_DEPLOYMENT_FLAGS = ("prefill_latency_model", "decode_latency_model", "prefill_tp", "decode_tp",
                          "kv_cpu_blocks", "kv_transfer_bandwidth", "kv_transfer_base_latency")


def case_config(case_dir) -> ScenarioConfig:
    """The scenario of a replay case, from its recorded configuration."""
    case = json.loads((case_dir / "case.json").read_text())
    explicit_blocks = case["total_kv_blocks_source"].startswith("explicit")
    explicit_len = case["max_model_len_source"].startswith("explicit")
    other = dict(case["other_flags"])
    # LoRA: the file and the capacity flag; the scorer weight is already in routing_scorers
    lora = LoraSettings(config=case_dir / other.pop("lora_config"),
                        adapter_capacity=other.pop("lora_adapter_capacity", None)) if "lora_config" in other \
        else LoraSettings()
    other.pop("lora_scorer_weight", None)
    unknown = set(other) - set(OTHER_CLUSTER_FLAGS) - set(OTHER_DEPLOYMENT_FLAGS)
    assert not unknown, f"case {case['id']}: other_flags {unknown} not mapped"
    pools = {k: other[k] for k in OTHER_DEPLOYMENT_FLAGS if k in other}
    other = {k: v for k, v in other.items() if k in OTHER_CLUSTER_FLAGS}
    return ScenarioConfig(
        deployment=Deployment(model=case["model"], hardware=case["hardware"], tp=case["tp"],
                              latency_model=case["latency_model"],
                              total_kv_blocks=case["total_kv_blocks"] if explicit_blocks else None,
                              block_size=case["block_size"], gpu_memory_utilization=case["gpu_memory_utilization"],
                              max_model_len=case["max_model_len"] if explicit_len else 0, **pools),
        engine=EngineSettings(max_num_seqs=case["max_num_seqs"], max_num_batched_tokens=case["max_num_batched_tokens"],
                              long_prefill_token_threshold=case["long_prefill_token_threshold"],
                              scheduler=case["scheduler"], preemption_policy=case["preemption_policy"]),
        workload=TraceWorkload(header=case_dir / "trace.yaml", data=case_dir / "trace.csv"),
        cluster=ClusterConfig(**{f: case[f] for f in CLUSTER_FIELDS}, **other),
        horizon_us=case["horizon_us"] if case["horizon_source"].startswith("explicit") else None,
        seed=case["seed"], lora=lora)


@pytest.mark.slow  # a run of its own; default suite time
def test_api_equals_cli_run():
    config = ScenarioConfig(workload=SyntheticWorkload(rate=20.0, num_requests=30), seed=7,
                            engine=EngineSettings(max_num_seqs=8))
    out = io.StringIO()
    assert main(["run", "--rate", "20", "--num-requests", "30", "--seed", "7", "--max-num-seqs", "8"],
                stdout=out, stderr=io.StringIO()) == 0
    result = simulate(config)
    assert result.report() == out.getvalue()
    assert result.metrics["completed_requests"] == 30


def test_default_config_is_the_default_run():
    config = ScenarioConfig()
    assert config.deployment.model == "meta-llama/llama-3.1-8b-instruct" and config.effective_seed == 42
    assert config.workload == SyntheticWorkload() and config.workload.num_requests == 100
