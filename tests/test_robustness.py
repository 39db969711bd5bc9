"""Issue #25: every adversarial input ends in one short `error:` line (exit 2, no traceback),
fast, or — for a request that can never fit — in a run that drops it as unservable, as BLIS
does. The output-path cases are in test_output_paths.py; the generated ones in
test_robustness_properties.py."""

from __future__ import annotations

import json

import pytest

from blis_jax.limits import MAX_SCENARIOS

from robust_helpers import (
    COEFFS,
    SPEC,
    assert_one_error_line,
    assert_unchanged,
    cli,
    snapshot,
    trace_row,
    write_trace_files,
)

BIG = str(2**70)
BETA = "0.152128,0.0,1.36252915,0.752037,32.0955,4.41684,126.0248,481.861,0.0,1.94710771,0.752037"
HF = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_attention_heads": 32,
      "num_key_value_heads": 8, "num_hidden_layers": 32, "intermediate_size": 14336, "vocab_size": 128256,
      "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}
BILLION_LAUGHS = ("a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
                  "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
                  "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]\n"
                  "g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f, *f]\nalpha: *g\nbeta: *g\n")


def _file(tmp, name, content):
    path = tmp / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def _trace(tmp, **cells):
    header, data = write_trace_files(tmp, [trace_row(**{"first_chunk_time_us": 2000, "last_chunk_time_us": 3000,
                                                         **cells})])
    return ["replay", "--trace-header", header, "--trace-data", data]


def _hf(tmp, **fields):
    directory = tmp / "hf"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({**HF, **fields}))
    return directory / "config.json"


# name -> (builder(tmp) -> argv, words the one error line must contain)
ERRORS = {
    # -- silently accepted before
    "trace output tokens 2^63-1": (lambda t: _trace(t, output_tokens=2**63 - 1), ("output_tokens", "limit")),
    "negative beta flag": (lambda t: ["run", "--alpha-coeffs", "1,2,3", "--beta-coeffs=-1" + BETA[8:]],
                           ("--beta-coeffs", "beta[0]", "negative")),
    "negative beta in a file": (lambda t: ["run", "--coefficients",
                                           _file(t, "c.yaml", COEFFS.replace("0.152128", "-0.152128"))],
                                ("beta[0]", "negative")),
    "empty --hardware": (lambda t: ["run", "--hardware", ""], ("--hardware", "empty")),
    "coefficient as a string": (lambda t: ["run", "--coefficients",
                                           _file(t, "c.yaml", COEFFS.replace("15563.2", "'15563.2'"))],
                                ("alpha[0]", "not str")),
    "coefficient as a boolean": (lambda t: ["run", "--coefficients",
                                            _file(t, "c.yaml", COEFFS.replace("0.0,", "true,", 1))],
                                 ("beta[1]", "not bool")),
    "spec seed beyond 64 bits": (lambda t: ["run", "--workload-spec", _file(t, "s.yaml", SPEC.replace("seed: 7",
                                                                                                    f"seed: {BIG}"))],
                                 ("seed", "limit")),
    "negative SLO target in plan": (lambda t: ["plan", _file(t, "g.yaml", "axes:\n  rate: [1, 2]\n"),
                                               "--slo", "ttft_p99_ms=-5"], ("--slo", ">= 0")),
    "HF config with more KV heads than heads": (lambda t: ["run", "--model", _hf(t, num_key_value_heads=64)],
                                                ("num_key_value_heads", "num_attention_heads")),
    "HF config heads not dividing hidden size": (lambda t: ["run", "--model", _hf(t, num_attention_heads=30,
                                                                                  num_key_value_heads=6)],
                                                 ("hidden_size", "num_attention_heads")),
    # -- tracebacks before
    "--seed beyond int64": (lambda t: ["run", "--seed", BIG], ("--seed", "64-bit")),
    "--horizon beyond int64": (lambda t: ["run", "--horizon", BIG], ("--horizon", "64-bit")),
    "--num-requests beyond int64": (lambda t: ["run", "--num-requests", BIG], ("--num-requests", "64-bit")),
    "--max-num-seqs beyond int64": (lambda t: ["run", "--max-num-seqs", BIG], ("--max-num-seqs", "64-bit")),
    "trace arrival beyond int64": (lambda t: _trace(t, arrival_time_us=BIG, send_time_us=BIG),
                                   ("arrival_time_us", "limit")),
    "trace request_id beyond int64": (lambda t: _trace(t, request_id=BIG), ("request_id", "limit")),
    "trace whose 2x horizon overflows": (lambda t: _trace(t, arrival_time_us=2**62, send_time_us=2**62),
                                         ("arrival_time_us", "limit")),
    "calibrate id beyond int64": (lambda t: ["calibrate", *_trace(t)[1:], "--sim-results",
                                             _file(t, "r.json", f'[{{"request_id": {BIG}, "ttft_us": 1, "e2e_us": 2, '
                                                                '"input_tokens": 1, "output_tokens": 1}]'),
                                             "--report", t / "report.json"], ("--sim-results", "request_id")),
    "--timeout inf": (lambda t: ["run", "--timeout", "inf"], ("--timeout", "finite")),
    "--rate nan": (lambda t: ["run", "--rate", "nan"], ("--rate", "finite")),
    "--total-kv-blocks 2e9": (lambda t: ["run", "--total-kv-blocks", "2000000000"], ("--total-kv-blocks", "67,108,864")),
    "trace CSV not UTF-8": (lambda t: ["replay", "--trace-header", _file(t, "h.yaml", "trace_version: 3\n"),
                                       "--trace-data", _file(t, "d.csv", b"request_id\xff\xfe\n")],
                            ("--trace-data", "UTF-8")),
    "trace header not UTF-8": (lambda t: ["replay", "--trace-header", _file(t, "h.yaml", b"mode: \xe9t\xe9\n"),
                                          "--trace-data", _file(t, "d.csv", "x\n")], ("--trace-header", "UTF-8")),
    "spec not UTF-8": (lambda t: ["run", "--workload-spec", _file(t, "s.yaml", b"seed: 1\n# \x80\x81\n")],
                       ("--workload-spec", "UTF-8")),
    "coefficient file not UTF-8": (lambda t: ["run", "--coefficients", _file(t, "c.yaml", b"\xff" + COEFFS.encode())],
                                   ("c.yaml", "UTF-8")),
    "HF config not UTF-8": (lambda t: ["run", "--model", _file(t, "config.json", b'{"a": "\xff"}')],
                            ("config.json", "UTF-8")),
    "grid not UTF-8": (lambda t: ["sweep", _file(t, "g.yaml", b"axes:\n  rate: [1, \xff]\n")], ("g.yaml", "UTF-8")),
    "300 kB CSV cell": (lambda t: _trace(t, error_message="x" * 300_000, input_tokens="nan"),
                        ("input_tokens", "integer")),
    "deeply nested spec YAML": (lambda t: ["run", "--workload-spec", _file(t, "s.yaml", "a: " + "[" * 5000 + "]" * 5000)],
                                ("--workload-spec", "nested")),
    "deeply nested HF JSON": (lambda t: ["run", "--model", _file(t, "config.json", "[" * 100_000 + "]" * 100_000)],
                              ("config.json", "nested")),
    "deeply nested coefficient YAML": (lambda t: ["run", "--coefficients", _file(t, "c.yaml", "- " * 3000 + "1\n")],
                                       ("c.yaml", "nested")),
    "deeply nested sim-results JSON": (lambda t: ["calibrate", *_trace(t)[1:], "--sim-results",
                                                  _file(t, "r.json", "[" * 100_000 + "]" * 100_000),
                                                  "--report", t / "rep.json"], ("--sim-results", "nested")),
    "sweep --part auto on one host": (lambda t: ["sweep", _file(t, "g.yaml", "axes:\n  rate: [1, 2]\n"), "--part", "auto",
                                                 "--output-dir", t / "out"], ("--part auto", "K/N")),
    # -- hangs / memory blow-ups before: refused up front with the estimate and the limit
    "--num-requests 4e7": (lambda t: ["run", "--num-requests", "40000000"], ("--num-requests", "GiB", "--max-memory-gib")),
    "spec with 1e8 requests": (lambda t: ["run", "--workload-spec", _file(t, "s.yaml", SPEC.replace("num_requests: 4",
                                                                                                  "num_requests: 100000000"))],
                               ("num_requests", "GiB")),
    "spec with 1e9 system prompts": (lambda t: ["run", "--workload-spec", _file(t, "s.yaml", (
        "version: '2'\ncategory: language\naggregate_rate: 5\ninference_perf:\n  stages: [{rate: 5, duration: 1}]\n"
        "  shared_prefix: {num_unique_system_prompts: 1000000000, num_users_per_system_prompt: 1,\n"
        "    system_prompt_len: 10, question_len: 10, output_len: 10}\n"))], ("system prompts", "GiB")),
    "million-scenario sweep": (lambda t: ["sweep", _file(t, "g.yaml", "axes:\n  rate: [" + ", ".join(map(str, range(1, 1001)))
                                                          + "]\n  seed: [" + ", ".join(map(str, range(1000))) + "]\n"),
                                          "--output-dir", t / "out"], ("1,000,000 scenarios", f"{MAX_SCENARIOS:,}")),
    "plan --candidates 1:40:1000000": (lambda t: ["plan", _file(t, "g.yaml", "base:\n  num-requests: 4\n"), "--slo",
                                                  "ttft_p99_ms=100", "--candidates", "1:40:1000000"],
                                       ("1,000,000 scenarios", "--candidates")),
    "--max-num-batched-tokens beyond tokens": (lambda t: ["run", "--max-num-batched-tokens", str(2**50)],
                                               ("--max-num-batched-tokens",)),
    # -- messy errors before
    "billion laughs coefficient file": (lambda t: ["run", "--coefficients", _file(t, "c.yaml", BILLION_LAUGHS)],
                                        ("c.yaml", "aliases")),
    "unknown model": (lambda t: ["run", "--model", "acme/imaginary-7b"], ("bundled models", "`blis-jax models`")),
    "unknown trace column": (lambda t: ["replay", "--trace-header", _file(t, "h.yaml", "trace_version: 3\n"),
                                        "--trace-data", _file(t, "d.csv", "rid,x\n1,2\n")], ("unknown column", "rid")),
    "--num-requests 1e8 names --num-requests": (lambda t: ["run", "--num-requests", "100000000"], ("--num-requests",)),
    "a 1000-character unknown key": (lambda t: ["run", "--workload-spec", _file(t, "s.yaml", SPEC + "k" * 1000 + ": 1\n")],
                            ("unknown key",)),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_is_one_short_error_line(tmp_path, case):
    build, words = ERRORS[case]
    argv = build(tmp_path)
    inputs = snapshot(*[p for p in tmp_path.rglob("*") if p.is_file()])
    rc, out, err = cli(*argv)
    line = assert_one_error_line(rc, err, *words)
    assert "--horizon" not in line or "horizon" in case
    assert_unchanged(inputs)


def test_utf8_bom_is_accepted(tmp_path):
    """A trace saved by a spreadsheet (UTF-8 with a BOM) reads like one without."""
    header, data = write_trace_files(tmp_path)
    plain_header, plain = write_trace_files(tmp_path, name="plain")
    data.write_bytes(b"\xef\xbb\xbf" + data.read_bytes())
    header.write_bytes(b"\xef\xbb\xbf" + header.read_bytes())
    from blis_jax.workload.tracev2 import read_trace

    _, bom_requests = read_trace(header, data)
    _, plain_requests = read_trace(plain_header, plain)
    assert list(bom_requests.request_id) == list(plain_requests.request_id) == [0, 1, 2]
    assert list(bom_requests.input_len) == list(plain_requests.input_len)


def test_a_300_kB_cell_is_data_not_an_error(tmp_path):
    """Python's csv module refuses cells over 128 kB by default; a long error_message is data."""
    from blis_jax.workload.tracev2 import read_trace

    header, data = write_trace_files(tmp_path, [trace_row(error_message="x" * 300_000)])
    _, requests = read_trace(header, data)
    assert len(requests) == 1 and list(requests.input_len) == [32]


@pytest.mark.slow  # 15 s of simulation: the default suite's time budget
def test_write_failure_message_is_one_clean_line(tmp_path, monkeypatch):
    """A write that fails after the run (e.g. ENOSPC) is one `error: FILE: reason` line."""
    import errno

    from blis_jax import output as output_module

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "m.json"))

    monkeypatch.setattr(output_module, "write_metrics_file", full)
    header, data = write_trace_files(tmp_path)
    rc, _, err = cli("replay", "--trace-header", header, "--trace-data", data, "--metrics-path", tmp_path / "m.json",
                     "--total-kv-blocks", "4096", "--horizon", "100000000")
    line = assert_one_error_line(rc, err, "m.json", "No space left on device")
    assert "error::" not in line


# Requests that can never fit: dropped as unservable and counted (BLIS EnqueueRequest guard 1),
# without sizing any buffer from them, so the run stays fast.
UNSERVABLE = {
    "1e9-token prompt in a trace": dict(input_tokens=10**9),
    "2^31-token output in a trace": dict(output_tokens=2**31),
    "4e9-token prefix group": dict(prefix_group="g", prefix_length=4 * 10**9),
}


@pytest.mark.parametrize("case", list(UNSERVABLE))
def test_unservable_trace_row_is_dropped_and_counted(tmp_path, case):
    second = 10**6
    rows = [trace_row(request_id=i, arrival_time_us=second * (i + 1), send_time_us=second * (i + 1)) for i in range(3)]
    rows[1] = trace_row(request_id=1, arrival_time_us=2 * second, send_time_us=2 * second, **UNSERVABLE[case])
    header, data = write_trace_files(tmp_path, rows)
    rc, out, err = cli("replay", "--trace-header", header, "--trace-data", data, "--total-kv-blocks", "4096",
                       "--horizon", 100 * second, "--metrics-path", tmp_path / "m.json")
    assert rc == 0, err
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["dropped_unservable"] == 1
    assert metrics["completed_requests"] == 2
    assert metrics["injected_requests"] == 3


def test_generated_trillion_token_prompts_are_refused_fast(tmp_path):
    """BLIS draws a token ID per prompt token: such a workload cannot be generated exactly in
    any reasonable time, so it is refused before the first draw."""
    rc, out, err = cli("run", "--num-requests", "5", "--total-kv-blocks", "4096", "--prompt-tokens", "1e12",
                       "--prompt-tokens-min", str(10**12), "--prompt-tokens-max", str(10**12),
                       "--metrics-path", tmp_path / "m.json")
    assert_one_error_line(rc, err, "token IDs")
    assert not (tmp_path / "m.json").exists()


@pytest.mark.parametrize("flags", [("--prefix-tokens", "100000000")], ids=["1e8-token prefix"])
def test_unservable_generated_requests_are_dropped_fast(tmp_path, flags):
    rc, out, err = cli("run", "--num-requests", "5", "--total-kv-blocks", "4096", *flags,
                       "--metrics-path", tmp_path / "m.json")
    assert rc == 0, err
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["dropped_unservable"] == 5 and metrics["completed_requests"] == 0


def test_huge_max_num_seqs_sizes_slots_by_the_requests():
    import numpy as np

    from blis_jax.engine.dims import MAX_PLAIN_SLOTS, choose_dims

    common = dict(input_len=np.full(5, 32), output_len=np.full(5, 4), prefix_group=np.full(5, -1),
                  prefix_len=np.zeros(5, int), max_num_batched_tokens=2048, total_kv_blocks=4096, block_size=16)
    assert choose_dims(max_num_seqs=10**8, **common).batch_slots == MAX_PLAIN_SLOTS
    assert choose_dims(max_num_seqs=256, **common).batch_slots == 256  # ordinary values unchanged


@pytest.mark.slow
def test_huge_max_num_seqs_runs_with_slots_bounded_by_the_requests(tmp_path):
    rc, out, err = cli("run", "--num-requests", "5", "--total-kv-blocks", "4096", "--max-num-seqs", "100000000",
                       "--metrics-path", tmp_path / "m.json")
    assert rc == 0, err
    assert json.loads((tmp_path / "m.json").read_text())["completed_requests"] == 5


def test_choose_dims_ignores_requests_the_guard_drops():
    import numpy as np

    from blis_jax.engine.dims import choose_dims

    common = dict(prefix_group=np.array([-1, 0]), max_num_seqs=64, max_num_batched_tokens=2048,
                  total_kv_blocks=1000, block_size=16, max_model_len=4096)
    small = choose_dims(input_len=np.array([100, 100]), output_len=np.array([10, 10]),
                        prefix_len=np.array([0, 0]), **common)
    absurd = choose_dims(input_len=np.array([100, 10**9]), output_len=np.array([10, 2**31]),
                         prefix_len=np.array([0, 4 * 10**9]), **common)
    assert absurd.blocks_per_request == small.blocks_per_request
    assert absurd.prefix_blocks == small.prefix_blocks
    assert absurd.step_log <= small.step_log


def test_memory_budget_flag_raises_the_limit():
    rc, _, err = cli("run", "--num-requests", "40000000", "--max-memory-gib", "1")
    assert_one_error_line(rc, err, "1 GiB")
    rc, _, err = cli("run", "--num-requests", "40000000", "--max-memory-gib", "0")
    assert_one_error_line(rc, err, "--max-memory-gib")
