"""Multi-tier KV offload configuration, host side (config/kv_offload.py; blis-features §2.10, §1.2):
the `--kv-offload-config` YAML resolved as BLIS resolves it (G03 / G04's trace headers hold BLIS's
resolution), the trace header block read and written back, every bad input refused with the
field named, the flag on `run` and `replay`, the header's block authoritative on replay, and the
chain's KV Thrashing Rate. Simulating the chain is the engine's (tests of engine/offload.py)."""

from __future__ import annotations

import copy
import io
import math

import numpy as np
import pytest
import yaml

from blis_jax.config import load_model
from blis_jax.config.kv_capacity import kv_block_bytes
from blis_jax.config.kv_offload import (
    OffloadConfig,
    OffloadTier,
    device_classes,
    from_header_block,
    load_offload_config,
    parse_offload_config,
    to_header_block,
)
from blis_jax.errors import ConfigError
from blis_jax.scenario import ScenarioConfig, TraceWorkload, resolve
from blis_jax.scenario.config import Deployment
from blis_jax.workload.requests import make_request_set
from blis_jax.workload.tracev2 import TraceHeader, format_header, read_header, write_trace
from shared_data import BLIS_DIFF, BLIS_REF, needs_blis_diff, needs_blis_ref

G03 = BLIS_DIFF / "G03_multitier_cpu_fs_nvme_llama8b"
G04 = BLIS_DIFF / "G04_multitier_cpu_fs_jitter_llama8b"
LLAMA8B_BLOCK = 16 * 131072   # KV bytes of one 16-token block of Llama-3.1-8B at TP1 (G03's case notes)


def header_block(case) -> dict:
    return yaml.safe_load((case / "trace.yaml").read_text())["kv_offload"]


def good_yaml(**tier) -> dict:
    """A valid config (G03's shape) with the tier's fields replaced (None: removed)."""
    base = {"type": "fs", "root_dir": "kv/nvme0", "n_read_threads": 8, "n_write_threads": 8, "direct_io": True,
            "device_class": "nvme_gen4"}
    base.update(tier)
    return {"kv_offload": {"cpu_bytes_to_use": 3 << 30, "offload_prompt_only": True,
                           "secondary_tiers": [{k: v for k, v in base.items() if v is not None}]}}


def parse(raw: dict, per_block: int = LLAMA8B_BLOCK, block_size: int = 16, devices=None) -> OffloadConfig:
    return parse_offload_config(raw, per_block, block_size, devices=devices, source="offload.yaml")


# ------------------------------------------------------------------------ BLIS's resolution


@needs_blis_diff
@pytest.mark.parametrize("case", [G03, G04], ids=["G03", "G04"])
def test_resolution_equals_the_generating_runs_header_block(case):
    devices = device_classes()
    if (case / "defaults.yaml").exists():   # G04: BLIS's defaults.yaml plus the class nvme_gen4_jitter
        devices = {**devices, **device_classes(case / "defaults.yaml")}
    cfg = load_offload_config(case / "kv_offload.yaml", LLAMA8B_BLOCK, 16, devices=devices)
    assert to_header_block(cfg) == header_block(case)
    # key order too: BLIS's struct order
    assert list(to_header_block(cfg)) == list(header_block(case))
    assert list(to_header_block(cfg)["secondary_tiers"][0]) == list(header_block(case)["secondary_tiers"][0])


@needs_blis_diff
def test_cpu_capacity_in_blocks():
    # case notes: 3 GiB = 1536 blocks of 2 MiB (G03), 1 GiB = 512 blocks (G04)
    assert load_offload_config(G03 / "kv_offload.yaml", LLAMA8B_BLOCK, 16).cpu_blocks == 1536
    g04 = from_header_block(header_block(G04))
    assert g04.cpu_blocks == 512
    assert g04.tiers[0].saturation_queue_depth == 8 and g04.tiers[0].single_transfer_fraction == 0.4
    assert g04.tiers[0].latency_jitter_stddev == 0.25


@needs_blis_diff
def test_an_unknown_device_class_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"device_class 'nvme_gen4_jitter': unknown; known classes: cpu_dram, "
                                          r"nvme_gen3, nvme_gen4, s3, sata_ssd"):
        load_offload_config(G04 / "kv_offload.yaml", LLAMA8B_BLOCK, 16)


@needs_blis_ref
def test_shipped_device_classes_are_blis_defaults():
    assert device_classes() == device_classes(BLIS_REF / "defaults.yaml")
    assert device_classes()["nvme_gen4"] == {"read_bandwidth": 7000.0, "write_bandwidth": 5000.0,
                                             "base_latency": 80.0}


def test_per_block_bytes_is_one_gpu_block_of_kv_at_the_tp():
    arch = load_model("meta-llama/llama-3.1-8b-instruct")
    assert kv_block_bytes(arch, 1, 16) == LLAMA8B_BLOCK == 2097152
    assert kv_block_bytes(arch, 2, 16) == LLAMA8B_BLOCK // 2   # 8 KV heads split over 2 GPUs
    assert kv_block_bytes(arch, 1, 32) == 2 * LLAMA8B_BLOCK


# ------------------------------------------------------------------------ defaults and overrides


def test_defaults():
    cfg = parse({"kv_offload": {"cpu_bytes_to_use": LLAMA8B_BLOCK * 10}})
    assert (cfg.cpu_blocks, cfg.tiers, cfg.offload_prompt_only) == (10, (), True)
    assert (cfg.block_size, cfg.blocks_per_chunk, cfg.tokens_per_hash, cfg.eviction_policy) == (16, 1, 16, "lru")
    tier = parse(good_yaml(n_read_threads=None, n_write_threads=None)).tiers[0]
    assert (tier.n_read_threads, tier.n_write_threads) == (16, 16)
    assert (tier.saturation_queue_depth, tier.single_transfer_fraction, tier.latency_jitter_stddev) == (1, 1.0, 0.0)
    # the block size follows the deployment's (blocks_per_chunk 1)
    assert parse({"kv_offload": {"cpu_bytes_to_use": 1 << 30}}, block_size=32).block_size == 32


def test_a_tiers_own_figures_override_its_class_field_by_field():
    tier = parse(good_yaml(read_bandwidth=1234, latency_jitter_stddev=0.1)).tiers[0]
    assert (tier.read_bandwidth, tier.write_bandwidth, tier.base_latency) == (1234.0, 5000.0, 80.0)
    assert (tier.latency_jitter_stddev, tier.device_class) == (0.1, "nvme_gen4")
    explicit = parse(good_yaml(device_class=None, read_bandwidth=100, write_bandwidth=50, base_latency=3,
                               saturation_queue_depth=4, single_transfer_fraction=0.5)).tiers[0]
    assert (explicit.read_bandwidth, explicit.write_bandwidth, explicit.base_latency) == (100.0, 50.0, 3.0)
    assert (explicit.saturation_queue_depth, explicit.single_transfer_fraction) == (4, 0.5)
    no_class = parse(good_yaml(device_class=None, read_bandwidth=1, write_bandwidth=1, base_latency=0))
    assert "device_class" not in to_header_block(no_class)["secondary_tiers"][0]


def test_buffered_io_takes_the_buffered_figures_with_fallback():
    devices = {"disk": {"read_bandwidth": 1000.0, "write_bandwidth": 800.0, "base_latency": 50.0,
                        "buffered_read_bandwidth": 3000.0, "buffered_base_latency": 5.0,
                        "buffered_latency_jitter_stddev": 0.2}}
    direct = parse(good_yaml(device_class="disk"), devices=devices).tiers[0]
    assert (direct.read_bandwidth, direct.write_bandwidth, direct.base_latency, direct.latency_jitter_stddev) == \
        (1000.0, 800.0, 50.0, 0.0)
    buffered = parse(good_yaml(device_class="disk", direct_io=False), devices=devices).tiers[0]
    assert (buffered.read_bandwidth, buffered.write_bandwidth, buffered.base_latency,
            buffered.latency_jitter_stddev, buffered.direct_io) == (3000.0, 800.0, 5.0, 0.2, False)


def test_yaml_1_2_numbers_as_blis_writes_them():
    # BLIS's defaults.yaml writes 7.0e3, which PyYAML (YAML 1.1) reads as a string; Go reads a number
    raw = yaml.safe_load("kv_offload:\n  cpu_bytes_to_use: 3.0e9\n  secondary_tiers:\n"
                         "    - {type: fs, direct_io: true, read_bandwidth: 7.0e3, write_bandwidth: 5e3, "
                         "base_latency: 8.0e1}\n")
    cfg = parse(raw)
    assert cfg.cpu_bytes_to_use == 3_000_000_000
    assert (cfg.tiers[0].read_bandwidth, cfg.tiers[0].write_bandwidth, cfg.tiers[0].base_latency) == \
        (7000.0, 5000.0, 80.0)


# ------------------------------------------------------------------------ the header block


@needs_blis_diff
@pytest.mark.parametrize("case", [G03, G04], ids=["G03", "G04"])
def test_header_block_round_trip(case):
    block = header_block(case)
    assert to_header_block(from_header_block(block)) == block
    # and through a written trace header, byte for byte
    header = read_header(case / "trace.yaml")
    again = TraceHeader(mode=header.mode, workload_seed=header.workload_seed,
                        extra={"kv_offload": to_header_block(from_header_block(header.extra["kv_offload"]))})
    assert format_header(again) == (case / "trace.yaml").read_text()


def test_header_block_round_trip_with_every_figure():
    tier = OffloadTier(n_read_threads=3, n_write_threads=5, read_bandwidth=123.5, write_bandwidth=77.25,
                       base_latency=12.0, saturation_queue_depth=6, single_transfer_fraction=0.3,
                       latency_jitter_stddev=0.125, root_dir="/x", direct_io=False, enable_kv_events=True,
                       device_class="mine")
    cfg = OffloadConfig(cpu_bytes_to_use=10 * LLAMA8B_BLOCK, per_block_bytes=LLAMA8B_BLOCK, offload_prompt_only=False,
                        tiers=(tier, dataclass_copy(tier, device_class="")), self_describing_kv_events=True)
    assert from_header_block(to_header_block(cfg)) == cfg
    block = to_header_block(cfg)
    assert block["secondary_tiers"][0]["base_latency"] == 12 and isinstance(
        block["secondary_tiers"][0]["base_latency"], int)   # Go writes an integral float64 bare


def dataclass_copy(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


def test_header_block_errors():
    block = {"cpu_bytes_to_use": 1 << 30, "per_block_bytes": 1 << 20, "secondary_tiers": [
        {"type": "fs", "read_bandwidth": 1, "write_bandwidth": 1, "base_latency": 0}]}
    assert from_header_block(block).cpu_blocks == 1024
    for change, match in ((dict(per_block_bytes=None), r"per_block_bytes: missing"),
                          (dict(cpu_bytes_to_use=10), r"cpu_bytes_to_use 10: smaller than one KV block"),
                          (dict(blocks_per_chunk=2), r"blocks_per_chunk 2: only 1"),
                          (dict(eviction_policy="arc"), r"eviction_policy 'arc'"),
                          (dict(bogus=1), r"unknown key\(s\) 'bogus'"),
                          (dict(secondary_tiers=[{"type": "fs", "read_bandwidth": 1}]),
                           r"secondary_tiers\[0\]: write_bandwidth, base_latency missing"),
                          (dict(secondary_tiers=[{"type": "s3", "read_bandwidth": 1, "write_bandwidth": 1,
                                                  "base_latency": 0}]), r"type 's3': only fs")):
        bad = {**block, **change}
        bad = {k: v for k, v in bad.items() if v is not None}
        with pytest.raises(ConfigError, match=match):
            from_header_block(bad, "hdr")


# ------------------------------------------------------------------------ bad input


def _tier0(**fields):
    return good_yaml(**fields)


def _top(**fields):
    raw = good_yaml()
    for k, v in fields.items():
        if v is None:
            raw["kv_offload"].pop(k, None)
        else:
            raw["kv_offload"][k] = v
    return raw


BAD = [
    ("missing cpu_bytes_to_use", _top(cpu_bytes_to_use=None), r"kv_offload.cpu_bytes_to_use: missing; give"),
    ("cpu below one block", _top(cpu_bytes_to_use=LLAMA8B_BLOCK - 1),
     r"cpu_bytes_to_use 2097151: smaller than one KV block \(2097152 bytes"),
    ("cpu not a number", _top(cpu_bytes_to_use="lots"), r"cpu_bytes_to_use 'lots': expected a whole number"),
    ("blocks_per_chunk 2", _top(blocks_per_chunk=2), r"blocks_per_chunk 2: only 1 is supported"),
    ("offload block size", _top(block_size=32), r"block_size 32: must be the GPU block size \(16 tokens"),
    ("tokens_per_hash", _top(tokens_per_hash=8), r"tokens_per_hash 8: only the GPU block size"),
    ("arc", _top(eviction_policy="arc"), r"eviction_policy arc: not supported .*; use lru"),
    ("fifo", _top(eviction_policy="fifo"), r"eviction_policy 'fifo': use lru"),
    ("prompt only not bool", _top(offload_prompt_only="yes"), r"offload_prompt_only 'yes': expected true or false"),
    ("tiers not a list", _top(secondary_tiers={"type": "fs"}), r"secondary_tiers: expected a list"),
    ("unknown top key", _top(cpu_gib=3), r"kv_offload: unknown key\(s\) 'cpu_gib'; known: cpu_bytes_to_use"),
    ("no kv_offload", {"cpu_bytes_to_use": 1}, r"expected a top-level `kv_offload:` mapping"),
    ("type s3", _tier0(type="s3"), r"secondary_tiers\[0\].type 's3': only fs is supported; set type: fs"),
    ("type missing", _tier0(type=None), r"secondary_tiers\[0\].type: missing; set type: fs"),
    ("direct_io missing", _tier0(direct_io=None), r"secondary_tiers\[0\].direct_io: missing; set true"),
    ("unknown class", _tier0(device_class="optane"), r"device_class 'optane': unknown; known classes: cpu_dram, "
                                                     r"nvme_gen3, nvme_gen4, s3, sata_ssd"),
    ("no class, no triple", _tier0(device_class=None, read_bandwidth=5),
     r"secondary_tiers\[0\]: write_bandwidth, base_latency missing; give a device_class"),
    ("negative bandwidth", _tier0(read_bandwidth=-1), r"read_bandwidth -1: a bandwidth must be > 0"),
    ("zero bandwidth", _tier0(write_bandwidth=0), r"write_bandwidth 0: a bandwidth must be > 0"),
    ("nan bandwidth", _tier0(read_bandwidth=math.nan), r"read_bandwidth nan: expected a finite number"),
    ("inf latency", _tier0(base_latency=math.inf), r"base_latency inf: expected a finite number"),
    ("negative latency", _tier0(base_latency=-5), r"base_latency -5: a latency must be >= 0"),
    ("read threads 0", _tier0(n_read_threads=0), r"n_read_threads 0: must be >= 1 threads"),
    ("write threads -2", _tier0(n_write_threads=-2), r"n_write_threads -2: must be >= 1 threads"),
    ("threads 1.5", _tier0(n_write_threads=1.5), r"n_write_threads 1.5: expected a whole number"),
    ("sigma < 0", _tier0(latency_jitter_stddev=-0.1), r"latency_jitter_stddev -0.1: the jitter sigma must be >= 0"),
    ("f1 = 0", _tier0(single_transfer_fraction=0), r"single_transfer_fraction 0: must be in \(0, 1\]"),
    ("f1 > 1", _tier0(single_transfer_fraction=1.5), r"single_transfer_fraction 1.5: must be in \(0, 1\]"),
    ("qsat 0", _tier0(saturation_queue_depth=0), r"saturation_queue_depth 0: must be >= 1"),
    ("unknown tier key", _tier0(speed=3), r"secondary_tiers\[0\]: unknown key\(s\) 'speed'"),
    ("tier not a mapping", {"kv_offload": {"cpu_bytes_to_use": 1 << 30, "secondary_tiers": ["fs"]}},
     r"secondary_tiers\[0\]: expected a mapping"),
]


@pytest.mark.parametrize("raw, match", [pytest.param(raw, match, id=i) for i, raw, match in BAD])
def test_bad_input_names_the_field_and_the_fix(raw, match):
    with pytest.raises(ConfigError, match=match) as err:
        parse(copy.deepcopy(raw))
    assert str(err.value).startswith("offload.yaml: ")


def test_bad_device_class_files(tmp_path):
    path = tmp_path / "defaults.yaml"
    path.write_text("kv_offload_devices:\n  slow: {read_bandwidth: 1.0}\n")
    with pytest.raises(ConfigError, match=r"kv_offload_devices.slow: write_bandwidth, base_latency missing"):
        device_classes(path)
    path.write_text("kv_offload_devices:\n  slow: {read_bandwidth: 1.0, write_bandwidth: 1, base_latency: -1}\n")
    with pytest.raises(ConfigError, match=r"kv_offload_devices.slow.base_latency -1: a latency must be >= 0"):
        device_classes(path)
    path.write_text("models: {}\n")
    with pytest.raises(ConfigError, match="top-level `kv_offload_devices:`"):
        device_classes(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"nope.yaml: no such file"):
        load_offload_config(tmp_path / "nope.yaml", LLAMA8B_BLOCK, 16)


def test_deployment_refuses_both_cpu_tiers():
    # blis-features §1.1: --kv-offload-config is mutually exclusive with --kv-cpu-blocks
    with pytest.raises(ConfigError, match="kv_cpu_blocks and deployment.kv_offload_config both set"):
        Deployment(kv_cpu_blocks=10, kv_offload_config="offload.yaml")
    with pytest.raises(ConfigError, match="deployment.kv_offload_config: give the path"):
        Deployment(kv_offload_config=" ")
    assert Deployment(kv_offload_config="offload.yaml").kv_offload_config == "offload.yaml"


# ------------------------------------------------------------------------ CLI and scenario


def _write_yaml(tmp_path, raw: dict, name: str = "offload.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_run_flag_resolves_the_chain(tmp_path):
    from blis_jax.cli.app import Diagnostics, build_parser, resolve_scenario
    from blis_jax.cli.scenario_flags import scenario_config

    path = _write_yaml(tmp_path, good_yaml())
    args = build_parser().parse_args(["run", "--kv-offload-config", str(path), "--tp", "2"])
    assert scenario_config(args, seed_given=False).deployment.kv_offload_config == str(path)
    scenario = resolve_scenario(args, Diagnostics(io.StringIO()), None)
    # 3 GiB / (1 MiB per block at TP2)
    assert (scenario.offload.per_block_bytes, scenario.offload.cpu_blocks) == (LLAMA8B_BLOCK // 2, 3072)
    assert scenario.offload.tiers[0].read_bandwidth == 7000.0
    assert resolve_scenario(build_parser().parse_args(["run"]), Diagnostics(io.StringIO()), None).offload is None


def _cli(*argv):
    from blis_jax.cli.app import main

    out, err = io.StringIO(), io.StringIO()
    rc = main([str(a) for a in argv], stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def test_cli_errors_name_the_flag(tmp_path):
    rc, _, err = _cli("run", "--kv-offload-config", tmp_path / "missing.yaml", "--num-requests", "2")
    assert rc != 0 and "--kv-offload-config" in err and "no such file" in err
    bad = _write_yaml(tmp_path, _tier0(direct_io=None))
    rc, _, err = _cli("run", "--kv-offload-config", bad, "--num-requests", "2")
    assert rc != 0 and f"--kv-offload-config {bad}: kv_offload.secondary_tiers[0].direct_io: missing" in err
    good = _write_yaml(tmp_path, good_yaml(), "good.yaml")
    rc, _, err = _cli("run", "--kv-offload-config", good, "--kv-cpu-blocks", "100", "--num-requests", "2")
    assert rc != 0 and "--kv-cpu-blocks and --kv-offload-config both set" in err
    # clusters run it (tests/test_cluster_cpu_tiers.py); PD pools do not yet
    rc, _, err = _cli("run", "--kv-offload-config", good, "--num-instances", "2", "--prefill-instances", "1",
                      "--decode-instances", "1", "--num-requests", "2")
    assert rc != 0 and "--kv-offload-config: a CPU KV tier with PD disaggregation is not simulated yet" in err


def test_run_trace_header_carries_the_resolved_block(tmp_path):
    path = _write_yaml(tmp_path, good_yaml())
    config = ScenarioConfig(deployment=Deployment(kv_offload_config=path, total_kv_blocks=1600))
    scenario = resolve(config)
    block = scenario.header.extra["kv_offload"]
    assert block == to_header_block(scenario.offload)
    assert block["per_block_bytes"] == LLAMA8B_BLOCK and block["secondary_tiers"][0]["read_bandwidth"] == 7000
    yaml_path, _ = write_trace(tmp_path / "t", scenario.header, scenario.requests)
    assert read_header(yaml_path).extra["kv_offload"] == block
    assert "kv_offload" not in resolve(ScenarioConfig(deployment=Deployment(total_kv_blocks=1600))).header.extra


# ------------------------------------------------------------------------ replay


@needs_blis_diff
def test_replay_of_g03_takes_the_header_block():
    warnings = []
    config = ScenarioConfig(deployment=Deployment(total_kv_blocks=1600),
                            workload=TraceWorkload(header=G03 / "trace.yaml", data=G03 / "trace.csv"))
    scenario = resolve(config, warn=warnings.append)
    assert scenario.offload == from_header_block(header_block(G03))
    assert scenario.offload.cpu_blocks == 1536 and not warnings
    # re-exported with the replayed trace, as read
    assert scenario.header.mode == "replayed" and scenario.header.extra["kv_offload"] == header_block(G03)


@needs_blis_diff
def test_replay_header_block_wins_over_the_flag(tmp_path):
    other = _write_yaml(tmp_path, _top(cpu_bytes_to_use=LLAMA8B_BLOCK * 7))
    warnings = []
    config = ScenarioConfig(deployment=Deployment(total_kv_blocks=1600, kv_offload_config=other),
                            workload=TraceWorkload(header=G03 / "trace.yaml", data=G03 / "trace.csv"))
    scenario = resolve(config, warn=warnings.append)
    assert scenario.offload.cpu_blocks == 1536
    assert len(warnings) == 1 and "ignored" in warnings[0] and "header is authoritative" in warnings[0]
    with pytest.raises(ConfigError, match="kv_cpu_blocks: the trace header's kv_offload block"):
        resolve(ScenarioConfig(deployment=Deployment(total_kv_blocks=1600, kv_cpu_blocks=10),
                               workload=TraceWorkload(header=G03 / "trace.yaml", data=G03 / "trace.csv")))
    with pytest.raises(ConfigError, match=r"kv_offload.block_size 16 differs from deployment.block_size 32"):
        resolve(ScenarioConfig(deployment=Deployment(total_kv_blocks=1600, block_size=32),
                               workload=TraceWorkload(header=G03 / "trace.yaml", data=G03 / "trace.csv")))


def _small_trace(tmp_path, header: TraceHeader):
    requests = make_request_set(request_id=np.arange(2), arrival_us=np.array([0, 10]), input_len=np.array([8, 8]),
                                output_len=np.array([2, 2]))
    return write_trace(tmp_path / "t", header, requests)


def test_replay_of_a_header_block_resolves_and_warns_on_other_block_bytes(tmp_path):
    block = {"cpu_bytes_to_use": 1 << 30, "per_block_bytes": 1 << 20}
    yaml_path, csv_path = _small_trace(tmp_path, TraceHeader(extra={"kv_offload": block}))
    warnings = []
    scenario = resolve(ScenarioConfig(workload=TraceWorkload(header=yaml_path, data=csv_path)), warn=warnings.append)
    assert scenario.offload.cpu_blocks == 1024   # the header's per_block_bytes, as BLIS
    assert any("per_block_bytes 1048576 is not this deployment's KV bytes per block (2097152" in w for w in warnings)
    bad = {"cpu_bytes_to_use": 1 << 30, "per_block_bytes": 1 << 20, "eviction_policy": "arc"}
    yaml_path, csv_path = _small_trace(tmp_path, TraceHeader(extra={"kv_offload": bad}))
    with pytest.raises(ConfigError, match=r"^workload.header .*t.yaml: kv_offload.eviction_policy 'arc': use lru"):
        resolve(ScenarioConfig(workload=TraceWorkload(header=yaml_path, data=csv_path)))


def test_a_tiered_observed_trace_needs_an_offload_chain(tmp_path):
    # blis-features §1.2: a tiered observed trace without an offload config is a hard error
    observed = {"source": "tiered", "hit_rate": 0.5, "block_hits": 300, "block_queries": 600}
    yaml_path, csv_path = _small_trace(tmp_path, TraceHeader(mode="real", extra={"observed_kv_metrics": observed}))
    with pytest.raises(ConfigError, match=r"source: tiered\) but no offload chain is configured; give "
                                          r"deployment.kv_offload_config"):
        resolve(ScenarioConfig(workload=TraceWorkload(header=yaml_path, data=csv_path)))
    offload = _write_yaml(tmp_path, good_yaml())
    scenario = resolve(ScenarioConfig(deployment=Deployment(kv_offload_config=offload),
                                      workload=TraceWorkload(header=yaml_path, data=csv_path)))
    assert scenario.offload is not None
    # another source needs none
    yaml_path, csv_path = _small_trace(tmp_path, TraceHeader(mode="real", extra={"observed_kv_metrics": {
        **observed, "source": "prefix_cache"}}))
    assert resolve(ScenarioConfig(workload=TraceWorkload(header=yaml_path, data=csv_path))).offload is None


# ------------------------------------------------------------------------ thrashing rate


def with_offload_counts(out, counts):
    """`out` carrying the engine chain's counters (SimOutput.offload_counts, engine/offload.py)."""
    import dataclasses

    if "offload_counts" in {f.name for f in dataclasses.fields(out)}:
        return dataclasses.replace(out, offload_counts=counts)
    object.__setattr__(out, "offload_counts", counts)   # a build whose SimOutput lacks the field yet
    return out


def test_thrashing_rate_is_the_mean_of_per_instance_refused_over_attempted():
    from test_metrics import _synthetic

    from blis_jax.engine.output import COMPLETED
    from blis_jax.metrics import kv_cache_metrics
    from blis_jax.output import render_stdout

    requests, out = _synthetic([COMPLETED] * 3, instances=3, handled=np.array([0, 1, 2]))
    assert kv_cache_metrics(out).thrashing_rate == 0.0
    out = with_offload_counts(out, {"promotions_attempted": np.array([10, 0, 4]),
                                    "promotions_refused": np.array([1, 0, 2]), "cpu_stores": np.array([5, 5, 5])})
    # instance rates 0.1, 0 (no attempts), 0.5
    assert kv_cache_metrics(out).thrashing_rate == pytest.approx(0.2)
    # the chain's CPU staging tier may fill the legacy tier's counters too: its rate stays the promotions'
    import dataclasses

    legacy = (np.zeros(3, np.int64), np.array([4, 4, 4]), np.array([9, 9, 9]))
    out = with_offload_counts(dataclasses.replace(out, cpu_tier_counts=legacy), out.offload_counts)
    assert kv_cache_metrics(out).thrashing_rate == pytest.approx(0.2)
    assert "KV Thrashing Rate: 0.2000\n" in render_stdout(out, requests)


def test_sweeps_batches_and_sensitivity_refuse_the_chain(tmp_path):
    import types

    from blis_jax.scenario.batch import simulate_batch
    from blis_jax.sweep.settings import resolve as sweep_resolve

    path = _write_yaml(tmp_path, good_yaml())
    with pytest.raises(ConfigError, match=r"scenarios\[0\].kv-offload-config: .* not supported in sweeps"):
        sweep_resolve({"kv-offload-config": str(path), "num-requests": 2}, types.SimpleNamespace(warn=print),
                      "scenarios[0]")
    scenario = resolve(ScenarioConfig(deployment=Deployment(kv_offload_config=path, total_kv_blocks=1600)))
    with pytest.raises(ConfigError, match="scenario 0 has a multi-tier KV offload chain"):
        simulate_batch([scenario])
    rc, _, err = _cli("sensitivity", "--kv-offload-config", path, "--num-requests", "2")
    assert rc != 0 and "--kv-offload-config: sensitivity does not simulate" in err


@needs_blis_diff
def test_a_replay_simulates_the_header_s_offload_chain(tmp_path):
    """`blis-jax replay` of G03's trace (its header's kv_offload block, no flag) runs the chain:
    the report has the chain's thrashing line, and the results are BLIS's for the requests the
    chain matches (the first 260, 262 in all: tests/blis_diff.py OFFLOAD_GAPS)."""
    import json

    from test_cli import replay_case

    case_dir, out = replay_case("G03", tmp_path)
    assert "KV Thrashing Rate: 0.0000" in out
    got = {r["request_id"]: (r["ttft_us"], r["e2e_us"]) for r in json.loads((tmp_path / "results.json").read_text())}
    ref = {r["request_id"]: (r["ttft_us"], r["e2e_us"]) for r in json.loads((case_dir / "results.json").read_text())}
    first_off = min((r for r in sorted(ref) if got[r] != ref[r]), default=len(ref))
    assert first_off >= 260 and sum(got[r] == ref[r] for r in ref) >= 262

