"""The Responses API (zctl.serve.openai.responses and its protocol and store) through the
official ``openai`` client, sync and async, and raw SSE: a response equals the chat completion of the same
conversation, whole and streamed; ``previous_response_id`` continues a stored
conversation; function calls and JSON output; logprobs; errors in OpenAI's shape;
a client that leaves has its generation cancelled; the store stays in its budget."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

import tests.zctl.serve.test_app as ts
from tests.zctl.serve.test_app import ASK, greedy_text, wait_for
from tests.zctl.serve.test_tools import TIME, WEATHER
from zctl.engine.requests import GenerationDone
from zctl.serve.errors import ApiError
from zctl.serve.openai.response_store import ResponseStore, output_turns
from zctl.serve.openai.responses_protocol import (
    InputItem,
    MessageItem,
    OutputText,
    ResponseEvent,
    ResponseEvents,
    ResponseObject,
    ResponsesRequest,
    items_as_turns,
)
from zctl.serve.tools import ToolOutput

tiny, server, started = ts.tiny, ts.server, ts.started  # the API's fixtures, shared

NO_EOS = {"zctl": {"ignore_eos": True}}
FLAT = [{"type": "function", **t["function"]} for t in (WEATHER, TIME)]  # Responses' tools


def as_pairs(messages: list[dict]) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in messages]


def test_a_response_equals_greedy_whole_and_streamed(server, tiny) -> None:
    client = server.client()
    want, _ = greedy_text(tiny, as_pairs(ASK), 12)
    reply = client.responses.create(model=ts.MODEL, instructions="be brief", input="the sky is",
                                    max_output_tokens=12, temperature=0, extra_body=NO_EOS)
    assert reply.output_text == want and reply.status == "incomplete"
    assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.id.startswith("resp_") and reply.model == ts.MODEL and reply.object == "response"
    prompt_tokens = len(tiny[2].encode_chat(as_pairs(ASK)))
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (prompt_tokens, 12)
    assert reply.usage.total_tokens == prompt_tokens + 12
    (item,) = reply.output
    assert item.type == "message" and item.role == "assistant" and item.status == "incomplete"

    events = list(client.responses.create(model=ts.MODEL, input=ASK, max_output_tokens=12,
                                          temperature=0, stream=True, extra_body=NO_EOS))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == want == events[-4].text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 12


BOOL = {"format": {"type": "json_schema", "name": "b", "schema": {  # an output that ends
    "type": "object", "additionalProperties": False, "required": ["ok"],
    "properties": {"ok": {"type": "boolean"}}}}}


def test_an_ended_answer_is_completed_and_the_stream_helper_reads_it(server) -> None:
    client = server.client()
    whole = client.responses.create(model=ts.MODEL, input="hello", max_output_tokens=200,
                                    temperature=0, text=BOOL)
    assert whole.status == "completed" and whole.incomplete_details is None
    with client.responses.stream(model=ts.MODEL, input="hello", max_output_tokens=200,
                                 temperature=0, text=BOOL) as stream:
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and final.status == "completed"
    assert final.usage.output_tokens == whole.usage.output_tokens < 200


def test_async_client_and_seeded_sampling(server) -> None:
    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        texts = []
        for seed in (5, 5, 6):
            reply = await client.responses.create(
                model=ts.MODEL, input="tell a story", max_output_tokens=16, temperature=1.0,
                top_p=0.9, extra_body={"seed": seed, **NO_EOS})
            texts.append(reply.output_text)
        stream = await client.responses.create(
            model=ts.MODEL, input="tell a story", max_output_tokens=16, temperature=1.0,
            top_p=0.9, stream=True, extra_body={"seed": 5, **NO_EOS})
        texts.append("".join([e.delta async for e in stream
                              if e.type == "response.output_text.delta"]))
        await client.close()
        return texts

    first, again, other, streamed = asyncio.run(run())
    assert first == again == streamed and other != first


def test_previous_response_id_continues_the_conversation(server, tiny) -> None:
    client = server.client()
    first = client.responses.create(model=ts.MODEL, instructions="be brief", input="the sky is",
                                    max_output_tokens=6, temperature=0, extra_body=NO_EOS)
    second = client.responses.create(model=ts.MODEL, previous_response_id=first.id,
                                     input="and the sea?", max_output_tokens=6, temperature=0,
                                     extra_body=NO_EOS)
    # the stored conversation, without the first's instructions (as OpenAI carries it)
    turns = [("user", "the sky is"), ("assistant", first.output_text), ("user", "and the sea?")]
    want, _ = greedy_text(tiny, turns, 6)
    assert second.output_text == want and second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    empty = client.responses.create(model=ts.MODEL, instructions="", input="the sky is",
                                    max_output_tokens=6, temperature=0, extra_body=NO_EOS)
    again = client.responses.create(model=ts.MODEL, previous_response_id=empty.id,
                                    input="and the sea?", max_output_tokens=6, temperature=0,
                                    extra_body=NO_EOS)
    turns[1] = ("assistant", empty.output_text)  # empty instructions are none: all is kept
    assert again.output_text == greedy_text(tiny, turns, 6)[0]
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError, match="no stored response"):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=ts.MODEL, previous_response_id=first.id, input="more")
    unstored = client.responses.create(model=ts.MODEL, input="hi", max_output_tokens=2,
                                       store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_function_calls_and_their_outputs(server) -> None:
    client = server.client()
    reply = client.responses.create(model=ts.MODEL, input="weather in Paris?", tools=FLAT,
                                    tool_choice="required", max_output_tokens=60, temperature=0)
    (call,) = reply.output
    assert call.type == "function_call" and call.name in ("weather", "time")
    assert call.call_id.startswith("call_") and isinstance(json.loads(call.arguments), dict)
    named = client.responses.create(model=ts.MODEL, input="time?", tools=FLAT, max_output_tokens=60,
                                    tool_choice={"type": "function", "name": "time"},
                                    temperature=0, stream=True)
    events = list(named)
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == ["function_call"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments)["zone"] in ("UTC", "CET")
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[0].name == "time"
    # the call's output sent back, in a conversation carried by id: it goes on in text
    after = client.responses.create(
        model=ts.MODEL, previous_response_id=reply.id, tools=FLAT, tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        max_output_tokens=8, temperature=0)
    assert after.output[0].type == "message" and after.status in ("completed", "incomplete")


def test_json_output_and_logprobs(server) -> None:
    client = server.client()
    reply = client.responses.create(model=ts.MODEL, input="answer", max_output_tokens=40,
                                    temperature=0.8, text=BOOL, extra_body={"seed": 2})
    assert set(json.loads(reply.output_text)) == {"ok"}
    loose = client.responses.create(model=ts.MODEL, input="answer", max_output_tokens=40,
                                    temperature=0, text={"format": {"type": "json_object"}})
    assert loose.status == "incomplete" or isinstance(json.loads(loose.output_text), dict)
    assert reply.text.format.type == "json_schema"
    scored = client.responses.create(model=ts.MODEL, input="the sky is", max_output_tokens=4,
                                     temperature=0, top_logprobs=2, extra_body=NO_EOS,
                                     include=["message.output_text.logprobs"])
    part = scored.output[0].content[0]
    assert len(part.logprobs) == 4 and "".join(lp.token for lp in part.logprobs) == part.text
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in part.logprobs)
    assert part.logprobs[0].logprob == pytest.approx(part.logprobs[0].top_logprobs[0].logprob)


def test_raw_sse_names_each_event(server) -> None:
    body = {"model": ts.MODEL, "input": "hi", "max_output_tokens": 3, "stream": True, **NO_EOS}
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, timeout=30) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        blocks = resp.read().decode().strip().split("\n\n")
    for block in blocks:
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == event[7:]
    assert "[DONE]" not in "".join(blocks)


@pytest.mark.parametrize("extra, param", [
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"background": True}, "background"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"temperature": 3}, "temperature"),
    ({"max_output_tokens": 600}, None),  # beyond the 512 context
    ({"tool_choice": "required"}, "tool_choice"),  # without tools
    ({"tools": FLAT, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"truncation": "auto"}, "truncation"),
    ({"zctl": {"speculative": "magic"}}, None),
])
def test_bad_requests_are_400s(server, extra, param) -> None:
    body = {"model": ts.MODEL, "input": "hi", **extra}
    resp = httpx.post(f"{server.url}/v1/responses", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"].startswith(param)


def test_model_key_and_queue_errors(started) -> None:
    srv = started(ts.ServeSettings(api_key="right", max_queue=1), delay_s=0.02)
    with pytest.raises(openai.AuthenticationError):
        srv.client("wrong").responses.create(model=ts.MODEL, input="hi")
    client = srv.client("right")
    with pytest.raises(openai.BadRequestError, match="not served here"):
        client.responses.create(model="gpt-5", input="hi")
    with pytest.raises(openai.AuthenticationError):
        srv.client("wrong").responses.retrieve("resp_x")
    body = {"model": ts.MODEL, "input": "count", "max_output_tokens": 200, "stream": True,
            **NO_EOS}
    headers = {"Authorization": "Bearer right"}
    with httpx.stream("POST", f"{srv.url}/v1/responses", json=body, headers=headers,
                      timeout=30) as resp:
        lines = resp.iter_lines()  # (kept: a dropped iterator closes the connection)
        assert resp.status_code == 200 and next(lines) == "event: response.created"
        with pytest.raises(openai.RateLimitError, match="in flight"):
            client.responses.create(model=ts.MODEL, input="hi")
    # the stream was left: its generation is cancelled, and the next request runs
    wait_for(lambda: srv.service.counters["cancelled"] == 1 and not srv.service.engine.busy)
    assert srv.chain.steps < 200
    assert client.responses.create(model=ts.MODEL, input="hi", max_output_tokens=2).usage


def test_the_pure_parts() -> None:
    items = [InputItem(role="user", content="q"),
             InputItem(type="function_call", call_id="c1", name="f", arguments="{}"),
             InputItem(type="function_call", call_id="c2", name="g", arguments='{"a": 1}'),
             InputItem(type="function_call_output", call_id="c1", output="r1"),
             InputItem(role="assistant", content=[{"type": "output_text", "text": "ok"}])]
    turns = items_as_turns(items)
    assert [t["role"] for t in turns] == ["user", "assistant", "tool", "assistant"]
    assert [c["id"] for c in turns[1]["tool_calls"]] == ["c1", "c2"]
    assert turns[2]["content"] == "r1" and turns[3]["content"] == "ok"
    chat = ResponsesRequest(model="m", input=items, instructions="sys").chat([])
    assert [t.role for t in chat.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert chat.messages[1].text() == "q" and '"name": "g"' in chat.messages[2].text()
    assert output_turns([MessageItem(id="m", status="completed", content=[
        OutputText(text="a"), OutputText(text="b")])]) == [{"role": "assistant", "content": "ab"}]

    store = ResponseStore(budget=2000)
    for i in range(20):
        store.put({"id": f"r{i}", "pad": "x" * 100}, [{"role": "user", "content": "y" * 100}])
        assert store.used <= store.budget
    held = [i for i in range(20) if f"r{i}" in store]
    assert held == list(range(20 - len(held), 20)) and 1 < len(held) < 20  # the newest
    with pytest.raises(ApiError, match="no stored response") as refused:
        store.body("r0")
    assert refused.value.status == 404
    store.body(f"r{held[0]}")  # used: it now outlives the next oldest
    store.put({"id": "r20", "pad": "x" * 100}, [{"role": "user", "content": "y" * 100}])
    assert f"r{held[0]}" in store and f"r{held[1]}" not in store
    assert store.conversation(f"r{held[0]}") == [{"role": "user", "content": "y" * 100}]
    assert store.delete(f"r{held[0]}") and not store.delete(f"r{held[0]}")
    store.put({"id": "huge", "pad": "x" * 5000}, [])  # beyond the budget: not kept
    assert "huge" not in store and store.used <= store.budget


def streamed(req: ResponsesRequest, pieces: list[str], done: GenerationDone) -> list[dict]:
    """The events of a stream of ``pieces`` ending in ``done``, as the route sends them."""
    tools = ToolOutput(req.chat([]).tool_plan())
    stream = ResponseEvents(ResponseObject(req, "m", tools))
    events: list[ResponseEvent] = stream.opening()
    for text in pieces:
        if not tools.holds(0, text):
            events += stream.delta(text, [])
    return [e.model_dump() for e in events + stream.ending(done, None, held=tools.holds(0))]


def test_the_events_of_text_calls_and_failures() -> None:
    ended = GenerationDone("r", [1, 2], '{"name": "time", "arguments": {"zone": "UTC"}}', 5,
                           0, 0, stop_reason="eos")
    tools = ResponsesRequest(model="m", input="q", tools=FLAT, tool_choice="required")
    events = streamed(tools, ['{"name"', ': "time", ...'], ended)
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]  # the call, whole at its end: no text events
    assert events[-1]["response"]["output"][0]["arguments"] == '{"zone": "UTC"}'
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    # a call cut by max_output_tokens is the text it was cut to, whole at the end
    cut = GenerationDone("r", [1], '{"na', 5, 0, 0, stop_reason="max_tokens")
    events = streamed(tools, ['{"na'], cut)
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == ['{"na']
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["output"][0]["status"] == "incomplete"
    # under "auto" a text answer streams as it comes
    text = GenerationDone("r", [1, 2], "hi there", 5, 0, 0, stop_reason="eos")
    auto = ResponsesRequest(model="m", input="q", tools=FLAT)
    events = streamed(auto, ["hi", " there"], text)
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == [
        "hi", " there"]
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "hi there"
    # a failure after the stream started: response.failed with the error
    stream = ResponseEvents(ResponseObject(auto, "m", ToolOutput()))
    (failed,) = [e.model_dump() for e in stream.failure(ApiError(
        503, "stage 1 is down", "service_unavailable", code="pipeline_down"))]
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "pipeline_down", "message": "stage 1 is down"}
