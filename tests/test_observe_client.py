"""observe: reading responses (spec §5; worked examples E7–E10): SSE chunk timing and counts,
finish_reason rules, errors and timeouts, the recorded row."""

from __future__ import annotations

import asyncio

from aiohttp import web
from observe_helpers import client_for, raw_server, run, workload

from blis_jax.observe.client import Outcome
from blis_jax.observe.dispatcher import Record
from blis_jax.observe.http_request import RequestSpec
from blis_jax.observe.records import format_trace_csv, go_csv_field
from blis_jax.observe.sessions import Planned
from blis_jax.observe.sse import StreamState


def sse_handler(lines, gap_s=0.0, stall_after=None, seen=None):
    """Writes `lines` (each + a blank separator), `gap_s` apart; stalls after `stall_after` lines."""
    async def handler(request):
        if seen is not None:
            seen.append((dict(request.headers), await request.json()))
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, line in enumerate(lines):
            if stall_after is not None and i == stall_after:
                await asyncio.sleep(30)
            if i:
                await asyncio.sleep(gap_s)
            await resp.write(line.encode() + b"\n\n")
        await resp.write_eof()
        return resp
    return handler


def send(handler, spec=None, timeout_s=5.0, path="/v1/completions", api_format="completions") -> Outcome:
    spec = spec or RequestSpec(prompt="p", output_len=5, stream=True)

    async def go():
        async with raw_server(handler, path) as url, client_for(url, timeout_s=timeout_s,
                                                                api_format=api_format) as client:
            return await client.send(spec)
    return run(go())


def test_e7_streaming_times_and_counts():
    lines = ['data: {"choices":[{"delta":{"content":"tok"}}]}'] * 5 + [
        'data: {"choices":[{"delta":{}}],"usage":{"prompt_tokens":100,"completion_tokens":5}}', "data: [DONE]"]
    out = send(sse_handler(lines, gap_s=0.005))
    assert out.status == "ok" and out.error_message == ""
    assert out.num_chunks == 6 and len(out.chunk_times_us) == 6
    assert out.first_chunk_us == out.chunk_times_us[0] and out.last_chunk_us == out.chunk_times_us[-1]
    assert out.last_chunk_us - out.first_chunk_us >= 4 * 5000 * 0.9  # five gaps of 5 ms before the usage line
    assert out.first_chunk_us > out.send_us > 0
    assert (out.output_tokens, out.server_input_tokens, out.finish_reason) == (5, 100, "")


def test_e8_finish_reason_null_never_overwrites():
    lines = ['data: {"choices":[{"text":"tok","finish_reason":null}]}',
             'data: {"choices":[{"text":"end","finish_reason":"length"}]}',
             'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}', "data: [DONE]"]
    out = send(sse_handler(lines))
    assert (out.finish_reason, out.output_tokens, out.num_chunks) == ("length", 2, 3)
    state = StreamState()
    for i, line in enumerate([b'data: {"choices":[{"text":"a","finish_reason":"stop"}]}\r\n',
                              b'data: {"choices":[],"usage":{"completion_tokens":1}}\n', b": comment\n",
                              b"event: x\n", b'data:{"no":"space"}\n', b"data: not json\n", b"data: [DONE]\n",
                              b'data: {"after":"done"}\n']):
        if not state.done:
            state.feed(line, i)
    assert state.finish_reason == "stop" and state.num_chunks == 3 and state.chunk_times_us == [0, 1, 5]


def test_e9_http_error_with_body():
    async def handler(request):
        return web.Response(status=502, text="upstream timeout")
    out = send(handler)
    assert (out.status, out.error_message) == ("error", "HTTP 502: upstream timeout")
    assert (out.first_chunk_us, out.last_chunk_us, out.num_chunks) == (0, 0, 0)
    assert out.x_request_id and out.send_us > 0


def test_e9_error_body_that_stalls_is_a_timeout():
    async def handler(request):
        resp = web.StreamResponse(status=502)
        await resp.prepare(request)
        await resp.write(b"partial")
        await asyncio.sleep(30)
        return resp
    out = send(handler, timeout_s=0.3)
    assert out.status == "timeout" and out.error_message.startswith("HTTP 502: (body read timed out: ")


def test_e9_stream_that_stalls_after_one_chunk_is_a_timeout():
    lines = ['data: {"choices":[{"text":"a"}]}', 'data: {"choices":[{"text":"b"}]}']
    out = send(sse_handler(lines, stall_after=1), timeout_s=0.4)
    assert out.status == "timeout" and out.error_message.startswith("streaming timeout: ")
    assert out.num_chunks == 1 and out.first_chunk_us > 0 and out.output_tokens == 0
    assert out.first_chunk_us - out.send_us < 0.4e6  # the chunk came before the timeout


def test_e9_server_that_never_answers_is_an_http_timeout():
    async def handler(request):
        await asyncio.sleep(30)
    out = send(handler, timeout_s=0.3)
    assert out.status == "timeout" and out.error_message.startswith("HTTP timeout: ")
    assert (out.first_chunk_us, out.num_chunks) == (0, 0)


def test_connection_refused_is_an_error_row():
    async def go():
        async with client_for("http://127.0.0.1:9", timeout_s=2) as client:
            return await client.send(RequestSpec(prompt="p", output_len=1))
    out = run(go())
    assert out.status == "error" and out.error_message.startswith("HTTP error: ")


def test_non_streaming_body_times_and_bad_json():
    async def ok(request):
        await asyncio.sleep(0.02)
        return web.json_response({"choices": [{"text": "x", "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 7, "completion_tokens": 3}})
    out = send(ok, RequestSpec(prompt="p", output_len=3))
    assert out.status == "ok" and out.num_chunks == 1 and out.first_chunk_us - out.send_us >= 15_000
    assert (out.output_tokens, out.server_input_tokens, out.finish_reason) == (3, 7, "stop")

    async def bad(request):
        return web.Response(text="not json")
    out = send(bad, RequestSpec(prompt="p", output_len=3))
    assert out.status == "error" and out.error_message.startswith("JSON parse error: ") and out.num_chunks == 1


def test_chat_request_sends_messages_and_counts_role_chunk():
    seen = []
    lines = ['data: {"choices":[{"delta":{"role":"assistant"}}]}', 'data: {"choices":[{"delta":{"content":"a"}}]}',
             'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":1}}', "data: [DONE]"]
    out = send(sse_handler(lines, seen=seen), path="/v1/chat/completions", api_format="chat")
    assert out.num_chunks == 3
    assert seen[0][1]["messages"] == [{"content": "p", "role": "user"}]


def test_e10_full_row():
    w = workload([500_000], input_len=[100], output_len=[50], client_id=["client-1"], tenant_id=["tenant-1"],
                 slo_class=["standard"], session_id=["session-1"], model=["test-model"])
    planned = Planned(row=0, arrival_us=500_000, deadline_us=0, streaming=True, token_ids=[],
                      session_id="session-1", round_index=0)
    out = Outcome(status="ok", send_us=1_000_000, first_chunk_us=1_000_100, last_chunk_us=1_000_500, num_chunks=10,
                  output_tokens=50, server_input_tokens=95, x_request_id="0f1e2d3c-0000-4000-8000-000000000000",
                  streaming=True)
    lines = format_trace_csv(w, [Record(1, planned, out)]).splitlines()
    assert lines[0] == (
        "request_id,client_id,tenant_id,slo_class,vllm_priority,session_id,round_index,prefix_group,prefix_length,"
        "streaming,input_tokens,output_tokens,text_tokens,image_tokens,audio_tokens,video_tokens,reason_ratio,model,"
        "deadline_us,server_input_tokens,arrival_time_us,send_time_us,first_chunk_time_us,last_chunk_time_us,"
        "num_chunks,status,error_message,finish_reason,x_request_id")
    assert lines[1] == ("1,client-1,tenant-1,standard,1,session-1,0,,0,true,100,50,0,0,0,0,0,test-model,0,95,"
                        "500000,1000000,1000100,1000500,10,ok,,,0f1e2d3c-0000-4000-8000-000000000000")


def test_grouped_row_input_tokens_exclude_the_prefix_and_csv_quoting():
    w = workload([0], input_len=[200], prefix_group=["shared"], prefix_len=[128])
    planned = Planned(row=0, arrival_us=0, deadline_us=0, streaming=False, token_ids=[])
    out = Outcome(status="error", error_message="HTTP 500: a, \"b\"\nc")
    row = format_trace_csv(w, [Record(0, planned, out)]).split("\n", 1)[1]
    assert ",shared,128,false,72," in row
    assert '"HTTP 500: a, ""b""\nc"' in row
    assert go_csv_field(" lead") == '" lead"' and go_csv_field("") == "" and go_csv_field("x") == "x"


def test_non_streaming_body_that_stalls_is_a_read_timeout():
    async def handler(request):
        resp = web.StreamResponse(status=200)
        await resp.prepare(request)
        await resp.write(b'{"choices": [')
        await asyncio.sleep(30)
        return resp
    out = send(handler, RequestSpec(prompt="p", output_len=3), timeout_s=0.3)
    assert out.status == "timeout" and out.error_message.startswith("read timeout: ")
    assert (out.first_chunk_us, out.last_chunk_us, out.num_chunks) == (0, 0, 0) and out.send_us > 0
