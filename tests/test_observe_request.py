"""observe: what is sent (spec §3, §4; worked examples E1–E6): bodies, headers, prompt words,
prefix strings, the tokens-per-word probe."""

from __future__ import annotations

import json

import pytest
from observe_helpers import client_for, run

from blis_jax.observe import prompts
from blis_jax.observe.http_request import RequestSpec, encode_body, request_body, request_headers
from blis_jax.observe.testserver import OpenAITestServer, ServerConfig
from blis_jax.observe.warmup import probe_ratio


def body(spec: RequestSpec, **kw) -> str:
    return encode_body(request_body(spec, **{"model": "M", "api_format": "completions", **kw})).decode()


# ------------------------------------------------------------------- E1–E3: bodies, headers


def test_e1_batch_class_body_and_gie_headers():
    spec = RequestSpec(prompt="test prompt", output_len=20, slo_class="batch", tenant_id="tenant-a")
    assert body(spec, model="test-model") == (
        '{"max_tokens":20,"min_tokens":20,"model":"test-model","priority":5,"prompt":"test prompt","stream":false}')
    headers = request_headers(spec)
    assert headers["x-gateway-inference-fairness-id"] == "tenant-a"
    assert headers["x-gateway-inference-objective"] == "batch"
    assert len(headers["x-request-id"]) == 36 and headers["x-request-id"].count("-") == 4
    for cls, priority in (("critical", 0), ("standard", 1), ("sheddable", 6), ("background", 7), ("gold", 1)):
        assert json.loads(body(RequestSpec("p", 5, slo_class=cls)))["priority"] == priority
    plain = RequestSpec("p", 5)
    assert "priority" not in json.loads(body(plain))
    assert not {"x-gateway-inference-fairness-id", "x-gateway-inference-objective", "Authorization",
                "x-slo-ttft-ms"} & set(request_headers(plain))
    assert request_headers(plain, api_key="k")["Authorization"] == "Bearer k"


def test_e2_streaming_body_prompt_from_token_ids_and_slo_header():
    prompt = prompts.words([5, 15, 25, 35, 45], prompts.word_count(5, 1.0))
    assert prompt == "foxtrot papa zulu jasmine thyme "
    spec = RequestSpec(prompt=prompt, output_len=3, stream=True, slo_class="critical", slo_target_us=1500)
    assert body(spec) == ('{"max_tokens":3,"min_tokens":3,"model":"M","priority":0,'
                          '"prompt":"foxtrot papa zulu jasmine thyme ","stream":true,'
                          '"stream_options":{"include_usage":true}}')
    assert request_headers(spec)["x-slo-ttft-ms"] == "2"


def test_e3_unconstrained_output_and_missing_length():
    spec = RequestSpec(prompt="…", output_len=20)
    assert body(spec, unconstrained=True) == '{"max_tokens":2147483647,"model":"M","prompt":"…","stream":false}'
    assert body(spec, unconstrained=True, api_format="chat") == (
        '{"messages":[{"content":"…","role":"user"}],"model":"M","stream":false}')
    assert json.loads(body(RequestSpec(prompt="x", output_len=0))) == {
        "max_tokens": 2048, "model": "M", "prompt": "x", "stream": False}


# --------------------------------------------------------------------------- E4: words


def test_e4_word_mapping_and_counts():
    assert prompts.words([0, 1, 50, 99, 100, 200], 6) == "alpha bravo acorn zest alpha alpha "
    assert prompts.words([-1, -100, -50, 7], 4) == "zest alpha acorn hotel "
    assert prompts.words([], 3) == "alpha bravo charlie "
    assert prompts.word_count(100, 2.0) == 50
    assert prompts.word_count(1, 2.0) == 1  # Round(0.5) = 1, half away from zero
    assert prompts.go_round(2.5) == 3 and prompts.go_round(0.49) == 0
    assert prompts.PROBE_PROMPT.split()[:3] == ["alpha", "bravo", "charlie"] and prompts.PROBE_PROMPT[-4:] == "zest"


# ----------------------------------------------------------------------- E5: prefix strings


@pytest.mark.parametrize("seed, group, expected", [
    (42, "shared", -1655931815042992442), (42, "group-a", 5553673035335009408),
    (42, "group-b", 5553676333869894041), (99, "group-a", 2727827635540775335), (7, "sys", 8629412497165663111)])
def test_group_seed_is_fnv1a_of_seed_and_name(seed, group, expected):
    assert prompts.group_seed(seed, group) == expected


@pytest.mark.parametrize("seed, group, n, expected", [
    (42, "shared", 10, "xylem jade tea india clover lily olive garlic spruce birch "),
    (42, "group-a", 20, "oak yucca quebec quebec romeo jade reed violet zest umbra oak jade juniper nutmeg kiwi "
                        "foxtrot verbena november vine lima "),
    (99, "group-a", 20, "jade nutmeg foxtrot mango delta quebec pine india maple nettle quinoa zulu oscar yew "
                        "fennel reed xeris papa fig ginger "),
    (7, "sys", 8, "foxtrot cedar tea zest laurel banana moss kiwi ")])
def test_e5_prefix_strings_with_go_math_rand(seed, group, n, expected):
    assert prompts.prefix_string(seed, group, n, 1.0) == expected  # BLIS's Go stream by default


def test_e5_grouped_prompt_prefix_plus_suffix_words():
    draws = prompts.go_word_draws
    ids = [7] * 10 + [5, 15, 25, 35, 45]
    builder = prompts.PromptBuilder(1.0, prompts.build_prefix_strings(42, {"shared": 10}, 1.0, draws))
    assert builder.build(ids, 15, "shared") == (
        "xylem jade tea india clover lily olive garlic spruce birch foxtrot papa zulu jasmine thyme ")
    at_167 = prompts.PromptBuilder(1.67, prompts.build_prefix_strings(42, {"shared": 10}, 1.67, draws))
    assert at_167.build(ids, 15, "shared") == "xylem jade tea india clover lily foxtrot papa zulu "
    # a 100-token group built at ratio 2.0 has 50 words; a 200-token member at ratio 1.0 takes
    # its 100 suffix words from positions 100..199
    half = prompts.build_prefix_strings(42, {"g": 100}, 2.0, draws)
    assert len(half["g"][0].split()) == 50
    member = prompts.PromptBuilder(1.0, half).build([3 * i for i in range(200)], 200, "g")
    assert member.split()[50:58] == ["alpha", "delta", "golf", "juliet", "mike", "papa", "sierra", "victor"]
    assert len(member.split()) == 150
    assert prompts.word_count(1000, 1.67) == 599


def test_prefix_strings_are_shared_and_nested():
    a = prompts.prefix_string(42, "g", 30, 1.0)
    assert a == prompts.prefix_string(42, "g", 30, 1.0)
    assert a.startswith(prompts.prefix_string(42, "g", 10, 1.0))
    assert a != prompts.prefix_string(42, "h", 30, 1.0)
    assert prompts.group_prefix_lengths([("g", 10), ("h", 0), ("g", 20), ("", 5)]) == {"g": 20, "h": 50}


# --------------------------------------------------------------------------- E6: probe


@pytest.mark.parametrize("api_format, prompt_tokens, expected", [
    ("chat", 167, 1.67), ("completions", 50000, 1.0), ("completions", 50, 1.0), ("completions", None, 1.0)])
def test_e6_probe_ratio_and_fallbacks(api_format, prompt_tokens, expected):
    from aiohttp import web
    from observe_helpers import raw_server

    seen = []

    async def handler(request):
        seen.append(await request.json())
        if prompt_tokens is None:
            return web.Response(status=500, text="boom")
        return web.json_response({"choices": [{"text": "x", "finish_reason": "length"}],
                                  "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 1}})

    async def go():
        path = "/v1/chat/completions" if api_format == "chat" else "/v1/completions"
        async with raw_server(handler, path) as url, client_for(url, api_format=api_format) as client:
            warnings = []
            return await probe_ratio(client, warnings.append), warnings

    ratio, warnings = run(go())
    assert ratio == pytest.approx(expected)
    assert bool(warnings) == (expected == 1.0)
    if api_format == "completions":
        assert encode_body(seen[0]).decode() == (
            '{"max_tokens":1,"model":"M","prompt":"' + prompts.PROBE_PROMPT + '","stream":false}')


def test_probe_against_the_test_server_is_within_range():
    async def go():
        async with OpenAITestServer(ServerConfig()) as server, client_for(server.url) as client:
            return await probe_ratio(client, lambda m: None)

    ratio = run(go())
    assert 1.0 < ratio < 3.0
