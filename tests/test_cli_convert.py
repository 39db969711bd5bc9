"""`blis-jax convert preset`, `convert inference-perf` and `compose` (spec blis-features §1.5):
the YAML they print loads back as a workload spec (one converted spec is simulated with
`run --workload-spec`), and bad input is one error line naming the flag, exit code 2.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import yaml

from blis_jax.cli import main
from blis_jax.workload.generate import generate_requests, resolve_clients
from blis_jax.workload.presets import PRESETS, generate_preset
from blis_jax.workload.spec import load_spec
from blis_jax.workload.tracev2 import read_trace

HEADER = "=== Simulation Metrics ==="

INFERENCE_PERF = {"version": "2", "seed": 3, "inference_perf": {
    "stages": [{"rate": 7.5, "duration": 40}],
    "shared_prefix": {"num_unique_system_prompts": 3, "num_users_per_system_prompt": 4,
                      "system_prompt_len": 64, "question_len": 100, "output_len": 20}}}


def cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = main([str(a) for a in argv], stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def spec_file(path, *clients, **top):
    """A minimal valid spec (one client per id, constant lengths) written as YAML."""
    spec = {"version": "2", "category": "language", "aggregate_rate": 10.0, "num_requests": 50, **top,
            "clients": [{"id": cid, "rate_fraction": fraction, "arrival": {"process": "poisson"},
                         "input_distribution": {"type": "constant", "params": {"value": 64}},
                         "output_distribution": {"type": "constant", "params": {"value": 8}}}
                        for cid, fraction in clients]}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def metrics_block(stdout: str) -> dict:
    return json.JSONDecoder().raw_decode(stdout, stdout.index(HEADER) + len(HEADER) + 1)[0]


@pytest.mark.slow  # a full run of the converted spec (CI time)
def test_convert_preset_then_run_workload_spec(tmp_path):
    rc, out, err = cli("convert", "preset", "--name", "chatbot", "--rate", 50, "--num-requests", 8)
    assert rc == 0 and err == ""
    spec = yaml.safe_load(out)
    assert spec["aggregate_rate"] == 50 and spec["num_requests"] == 8
    (client,) = spec["clients"]
    chatbot = PRESETS["chatbot"]
    assert client["arrival"] == {"process": "constant"}
    assert client["input_distribution"]["params"] == {"mean": chatbot.prompt.mean, "std_dev": chatbot.prompt.std,
                                                      "min": chatbot.prompt.min, "max": chatbot.prompt.max}
    assert client["timeout"] == 300_000_000        # run's default client timeout, in µs
    path = tmp_path / "chatbot.yaml"
    path.write_text(out)
    rc, out, err = cli("run", "--workload-spec", path, "--num-requests", 8, "--trace-output", tmp_path / "trace")
    assert rc == 0, err
    assert metrics_block(out)["completed_requests"] == 8
    _, simulated = read_trace(tmp_path / "trace.yaml", tmp_path / "trace.csv")
    preset = generate_preset("chatbot", seed=42, rate=50, num_requests=8)
    np.testing.assert_array_equal(simulated.arrival_us, preset.arrival_us)   # same constant arrivals
    np.testing.assert_array_equal(simulated.deadline_us, preset.deadline_us)
    assert simulated.input_len.min() >= chatbot.prompt.min and simulated.input_len.max() <= chatbot.prompt.max


def test_convert_output_file_equals_stdout(tmp_path):
    rc, out, _ = cli("convert", "preset", "--name", "multidoc", "--rate", 2)
    assert rc == 0
    rc, again, err = cli("convert", "preset", "--name", "multidoc", "--rate", 2, "--output", tmp_path / "s.yaml")
    assert rc == 0 and again == "" and err == ""
    assert (tmp_path / "s.yaml").read_text() == out
    assert load_spec(tmp_path / "s.yaml").num_requests == 100      # BLIS default --num-requests


def test_convert_inference_perf_expands_clients(tmp_path):
    source = tmp_path / "ip.yaml"
    source.write_text(yaml.safe_dump(INFERENCE_PERF))
    rc, out, err = cli("convert", "inference-perf", "--spec", source, "--output", tmp_path / "expanded.yaml")
    assert rc == 0 and out == "" and err == ""
    expanded = load_spec(tmp_path / "expanded.yaml")
    assert expanded.inference_perf is None and len(expanded.clients) == 12   # 3 prompts × 4 users
    # YAML cannot carry BLIS's normalized-exponential factory: as with BLIS's convert, the expanded
    # spec generates per window instead (blis-rng §8, §5.6): same clients and stage, each client's
    # 25 rescaled IATs minus the last (on the stage end), vs exactly 25 from the inference-perf spec.
    direct, converted = generate_requests(INFERENCE_PERF), generate_requests(expanded)
    assert len(direct) == 300 and len(converted) == 12 * 24
    assert set(converted.client_id) == set(direct.client_id)


def test_compose_sums_rates_and_keeps_each_spec_rate(tmp_path):
    a = spec_file(tmp_path / "a.yaml", ("x", 0.75), ("y", 0.25), aggregate_rate=8.0)
    b = spec_file(tmp_path / "b.yaml", ("z", 1.0), aggregate_rate=24.0, num_requests=30, category="reasoning")
    rc, out, err = cli("compose", "--from", a, "--from", b)
    assert rc == 0 and err == ""
    merged = yaml.safe_load(out)
    assert merged["aggregate_rate"] == 32 and merged["num_requests"] == 80
    assert merged["category"] == "language"                     # from the first spec
    path = tmp_path / "merged.yaml"
    path.write_text(out)
    rates = {rc.spec.id: rc.rate for rc in resolve_clients(load_spec(path))}
    assert rates == pytest.approx({"x": 6.0, "y": 2.0, "z": 24.0})


@pytest.mark.parametrize("argv, flag", [
    (["convert", "preset", "--name", "chitchat"], "--name"),
    (["convert", "preset", "--rate", "2"], "--name"),
    (["convert", "preset", "--name", "chatbot", "--rate", "0"], "--rate"),
    (["convert", "preset", "--name", "chatbot", "--rate", "fast"], "--rate"),
    (["convert", "preset", "--name", "chatbot", "--num-requests", "0"], "--num-requests"),
    (["convert", "preset", "--name", "chatbot", "--output", "no/such/dir/s.yaml"], "--output"),
    (["convert", "inference-perf", "--spec", "no-such-file.yaml"], "--spec no-such-file.yaml"),
    (["convert", "inference-perf"], "--spec"),
    (["convert", "servegen", "--path", "x"], "servegen"),
    (["compose"], "--from"),
    (["compose", "--from", "no-such-file.yaml"], "--from no-such-file.yaml"),
])
def test_bad_input_is_one_error_line(argv, flag):
    rc, out, err = cli(*argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"blis-jax {argv[0]}")   # e.g. `blis-jax convert preset:`
    assert ": error: " in err and flag in err


def test_spec_errors_name_the_file_and_key(tmp_path):
    plain = spec_file(tmp_path / "plain.yaml", ("x", 1.0))
    rc, _, err = cli("convert", "inference-perf", "--spec", plain)
    assert rc == 2 and f"--spec {plain}" in err and "inference_perf" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text(plain.read_text().replace("aggregate_rate", "aggregate_rat"))
    rc, _, err = cli("compose", "--from", plain, "--from", bad)
    assert rc == 2 and f"--from {bad}" in err and "aggregate_rat" in err
    # compose's own errors name the input by its file, not its position.
    a = spec_file(tmp_path / "a.yaml", ("x", 1.0), goodput_slo_targets={"critical": {"ttft_ms": 100.0}})
    b = spec_file(tmp_path / "b.yaml", ("y", 1.0), goodput_slo_targets={"critical": {"ttft_ms": 200.0}})
    rc, _, err = cli("compose", "--from", a, "--from", b)
    assert rc == 2 and f"--from {b}" in err and "goodput_slo_targets.critical.ttft_ms" in err
