"""Anthropic's Messages API (zctl.serve.anthropic.protocol, zctl.serve.anthropic.messages)
through the official ``anthropic`` client, sync and async, and raw SSE: a message equals
the chat completion of the same conversation, whole and streamed; stop sequences; tool use and its results;
count_tokens; errors in Anthropic's shape; a client that leaves has its generation
cancelled."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import openai
import pytest

import tests.zctl.serve.test_app as ts
from tests.zctl.serve.test_app import ASK, greedy_text, wait_for
from tests.zctl.serve.test_tools import TIME, WEATHER
from zctl.cli.serve import model_names
from zctl.serve.anthropic.protocol import MessagesRequest, turn_as_chat
from zctl.serve.openai.protocol import to_generation

tiny, server, started = ts.tiny, ts.server, ts.started  # the API's fixtures, shared

NO_EOS = {"zctl": {"ignore_eos": True}}
GREEDY = {"temperature": 0, **NO_EOS}  # (sampling fields: through extra_body in new clients)
T0 = {"temperature": 0}
TOOLS = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
         for t in (WEATHER, TIME)]
USER = [{"role": "user", "content": "the sky is"}]


def client_of(srv, key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=key, max_retries=0, timeout=60)


def test_a_message_equals_greedy_whole_and_streamed(server, tiny) -> None:
    client = client_of(server)
    want, _ = greedy_text(tiny, [(m["role"], m["content"]) for m in ASK], 12)
    reply = client.messages.create(model=ts.MODEL, system="be brief", messages=USER,
                                   max_tokens=12, extra_body=GREEDY)
    assert reply.content[0].type == "text" and reply.content[0].text == want
    assert reply.stop_reason == "max_tokens" and reply.stop_sequence is None
    prompt_tokens = len(tiny[2].encode_chat([(m["role"], m["content"]) for m in ASK]))
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (prompt_tokens, 12)
    assert reply.id.startswith("msg_") and reply.model == ts.MODEL and reply.role == "assistant"
    blocks = client.messages.create(model=ts.MODEL, max_tokens=12,
                                    system=[{"type": "text", "text": "be brief"}],
                                    messages=[{"role": "user", "content": [
                                        {"type": "text", "text": "the sky is"}]}],
                                    extra_body=GREEDY)
    assert blocks.content[0].text == want
    with client.messages.stream(model=ts.MODEL, system="be brief", messages=USER,
                                max_tokens=12, extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == want == final.content[0].text and final.stop_reason == "max_tokens"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (prompt_tokens, 12)
    count = client.messages.count_tokens(model=ts.MODEL, system="be brief", messages=USER)
    assert count.input_tokens == prompt_tokens


def test_async_client_and_raw_events(server, tiny) -> None:
    async def run() -> tuple[str, str]:
        client = anthropic.AsyncAnthropic(base_url=server.url, api_key="x", max_retries=0)
        whole = await client.messages.create(model=ts.MODEL, messages=USER, max_tokens=8,
                                             extra_body=GREEDY)
        stream = await client.messages.create(model=ts.MODEL, messages=USER, max_tokens=8,
                                              stream=True, extra_body=GREEDY)
        text = "".join([e.delta.text async for e in stream if e.type == "content_block_delta"])
        await client.close()
        return whole.content[0].text, text

    whole, streamed = asyncio.run(run())
    assert whole == streamed
    body = {"model": ts.MODEL, "messages": USER, "max_tokens": 3, "stream": True, **NO_EOS}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, timeout=30) as resp:
        blocks = resp.read().decode().strip().split("\n\n")
    kinds = []
    for block in blocks:
        event, data = block.split("\n")
        kinds.append(json.loads(data.removeprefix("data: "))["type"])
        assert event == f"event: {kinds[-1]}"
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_stop_sequences_end_the_message_and_say_which(server, tiny) -> None:
    client = client_of(server)
    want, _ = greedy_text(tiny, [("user", "the sky is")], 24)
    stop = want[8:11]
    assert stop.strip() and stop not in want[:8]
    for stops in ([stop], ["never-seen-zz", stop]):
        reply = client.messages.create(model=ts.MODEL, messages=USER, max_tokens=24,
                                       stop_sequences=stops, extra_body=GREEDY)
        assert reply.content[0].text == want[:8]
        assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", stop)
        with client.messages.stream(model=ts.MODEL, messages=USER, max_tokens=24,
                                    stop_sequences=stops,
                                    extra_body=GREEDY) as stream:
            final = stream.get_final_message()
        assert (final.content[0].text, final.stop_sequence) == (want[:8], stop)


def test_tool_use_and_its_results(server) -> None:
    client = client_of(server)
    reply = client.messages.create(model=ts.MODEL, messages=[{"role": "user", "content": "w?"}],
                                   max_tokens=60, extra_body=T0, tools=TOOLS,
                                   tool_choice={"type": "any"})
    (call,) = reply.content
    assert reply.stop_reason == "tool_use" and call.type == "tool_use"
    assert call.id.startswith("toolu_") and call.name in ("weather", "time")
    assert isinstance(call.input, dict)
    with client.messages.stream(model=ts.MODEL, messages=[{"role": "user", "content": "t?"}],
                                max_tokens=60, extra_body=T0, tools=TOOLS,
                                tool_choice={"type": "tool", "name": "time"}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].name == "time"
    assert final.content[0].input["zone"] in ("UTC", "CET")
    after = client.messages.create(
        model=ts.MODEL, max_tokens=6, tools=TOOLS, extra_body=GREEDY,
        tool_choice={"type": "none"}, messages=[
            {"role": "user", "content": "w?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm",
                                               "signature": "s"},
                                              {"type": "tool_use", "id": call.id,
                                               "name": call.name, "input": call.input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                          "content": "sunny"}]}])
    assert after.content[0].type == "text" and after.stop_reason == "max_tokens"


def test_json_output(server) -> None:
    schema = {"type": "object", "additionalProperties": False, "required": ["ok"],
              "properties": {"ok": {"type": "boolean"}}}
    reply = client_of(server).messages.create(
        model=ts.MODEL, messages=USER, max_tokens=40, extra_body={"seed": 3},
        output_config={"format": {"type": "json_schema", "schema": schema}})
    assert set(json.loads(reply.content[0].text)) == {"ok"} and reply.stop_reason == "end_turn"


@pytest.mark.parametrize("extra", [
    {"temperature": 1.5},
    {"max_tokens": 0},
    {"messages": []},
    {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
    {"messages": [{"role": "system", "content": "hi"}]},
    {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
    {"tool_choice": {"type": "any"}},  # without tools
    {"max_tokens": 600},  # beyond the 512 context
])
def test_bad_requests_are_400s_in_anthropic_shape(server, extra) -> None:
    body = {"model": ts.MODEL, "max_tokens": 4, "messages": USER, **extra}
    resp = httpx.post(f"{server.url}/v1/messages", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    answer = resp.json()
    assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["message"]


def test_keys_models_and_a_full_queue(started) -> None:
    srv = started(ts.ServeSettings(api_key="right", max_queue=1), delay_s=0.02)
    with pytest.raises(anthropic.AuthenticationError):
        client_of(srv, "wrong").messages.create(model=ts.MODEL, messages=USER, max_tokens=2)
    client = client_of(srv, "right")  # x-api-key, as Anthropic's clients send it
    with pytest.raises(anthropic.NotFoundError, match="not served here"):
        client.messages.create(model="claude-x", messages=USER, max_tokens=2)
    bearer = httpx.post(f"{srv.url}/v1/messages", headers={"Authorization": "Bearer right"},
                        json={"model": ts.MODEL, "messages": USER, "max_tokens": 2}, timeout=30)
    assert bearer.status_code == 200
    body = {"model": ts.MODEL, "messages": USER, "max_tokens": 200, "stream": True, **NO_EOS}
    with httpx.stream("POST", f"{srv.url}/v1/messages", json=body, timeout=30,
                      headers={"x-api-key": "right"}) as resp:
        lines = resp.iter_lines()  # (kept: a dropped iterator closes the connection)
        assert resp.status_code == 200 and next(lines) == "event: message_start"
        with pytest.raises(anthropic.RateLimitError):
            client.messages.create(model=ts.MODEL, messages=USER, max_tokens=2)
    # the stream was left: its generation is cancelled, and the next request runs
    wait_for(lambda: srv.service.counters["cancelled"] == 1 and not srv.service.engine.busy)
    assert srv.chain.steps < 200
    assert client.messages.create(model=ts.MODEL, messages=USER, max_tokens=2).usage


def test_the_model_under_the_names_it_is_served_as(started) -> None:
    srv = started(ts.ServeSettings(model_names=("claude-haiku-4-5", "smol")))
    reply = client_of(srv).messages.create(model="claude-haiku-4-5", messages=USER,
                                           max_tokens=2)
    assert reply.model == "claude-haiku-4-5"
    chat = srv.client().chat.completions.create(model="smol", messages=USER, max_tokens=2)
    assert chat.model == "claude-haiku-4-5"  # replies carry the first name
    assert [m.id for m in srv.client().models.list()] == ["claude-haiku-4-5", "smol"]
    assert srv.client().models.retrieve("smol").id == "smol"
    with pytest.raises(anthropic.NotFoundError):  # the export's own name is not one of them
        client_of(srv).messages.create(model=ts.MODEL, messages=USER, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        srv.client().chat.completions.create(model=ts.MODEL, messages=USER, max_tokens=2)
    assert httpx.get(f"{srv.url}/health").json()["model"] == "claude-haiku-4-5"
    assert 'model_name="claude-haiku-4-5"' in httpx.get(f"{srv.url}/metrics").text
    assert model_names([" a", "b", "a"]) == ("a", "b")
    with pytest.raises(ValueError, match="non-empty"):
        model_names(["a", " "])


def test_a_request_reads_as_the_chat_completion_it_asks_for() -> None:
    req = MessagesRequest(model="m", max_tokens=4, system="sys", messages=[
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "let me look"},
            {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
            {"type": "tool_use", "id": "t2", "name": "g", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "r1"},
            {"type": "tool_result", "tool_use_id": "t2",
             "content": [{"type": "text", "text": "r2"}]},
            {"type": "text", "text": "thanks"}]}])
    chat = req.chat()
    assert [t.role for t in chat.messages] == ["system", "user", "assistant", "tool", "tool",
                                               "user"]
    assert [c["id"] for c in chat.messages[2].tool_calls] == ["t1", "t2"]
    assert [t.text() for t in chat.messages[3:]] == ["r1", "r2", "thanks"]
    assert turn_as_chat(req.messages[0]) == [{"role": "user", "content": "q"}]


def test_a_message_without_sampling_keeps_anthropics_defaults() -> None:
    plain = MessagesRequest(model="m", max_tokens=4, messages=[{"role": "user", "content": "q"}])
    generation = to_generation(plain.chat(), "a")
    assert (generation.temperature, generation.top_p, generation.top_k, generation.min_p,
            generation.repetition_penalty) == (1.0, 1.0, 0, 0.0, 1.0)  # never the model's
    given = MessagesRequest(model="m", max_tokens=4, temperature=0.2, top_k=3,
                            messages=[{"role": "user", "content": "q"}])
    generation = to_generation(given.chat(), "b")
    assert (generation.temperature, generation.top_k, generation.top_p) == (0.2, 3, 1.0)
