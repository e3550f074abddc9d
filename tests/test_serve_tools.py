"""Tool calls through the API (serve.tools): ``tool_choice`` "required" or a named function
holds the reply to a call of one of the tools, answered as ``tool_calls`` (whole and
streamed, with the official client); "none" leaves the tools out; "auto" and bad tools
are 400s; a conversation carrying earlier calls and their results goes on."""

from __future__ import annotations

import json

import openai
import pytest
import test_serve as ts
from test_serve import ASK

from serve.tools import (
    FunctionDef,
    ToolDef,
    call_schema,
    called_text,
    functions_to_call,
    tool_calls,
    with_tools_prompt,
)

tiny, server, started = ts.tiny, ts.server, ts.started  # the API's fixtures, shared
# small, for the tiny model's 512-token context; every value bounded, so a call ends
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 8}}}}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}


def check_call(call) -> None:  # noqa: ANN001 - the client's tool call object
    arguments = json.loads(call.function.arguments)
    assert call.type == "function" and call.id.startswith("call_")
    if call.function.name == "weather":
        assert set(arguments) == {"city"} and len(arguments["city"]) <= 8
    else:
        assert call.function.name == "time" and arguments == {"zone": arguments["zone"]}
        assert arguments["zone"] in ("UTC", "CET")


def test_required_and_named_tool_choices_answer_with_a_call(server) -> None:
    client = server.client()
    reply = client.chat.completions.create(model=ts.MODEL, messages=ASK, max_tokens=60,
                                           temperature=0, tools=[WEATHER, TIME],
                                           tool_choice="required")
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    check_call(call)
    named = client.chat.completions.create(
        model=ts.MODEL, messages=ASK, max_tokens=60, temperature=1.0, seed=3, n=2,
        tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "time"}})
    for choice in named.choices:
        (call,) = choice.message.tool_calls
        assert call.function.name == "time" and choice.finish_reason == "tool_calls"
        check_call(call)


def test_a_streamed_call_comes_whole_at_its_end(server) -> None:
    client = server.client()
    whole = client.chat.completions.create(model=ts.MODEL, messages=ASK, max_tokens=60,
                                           temperature=0, tools=[WEATHER],
                                           tool_choice="required")
    stream = client.chat.completions.create(model=ts.MODEL, messages=ASK, max_tokens=60,
                                            temperature=0, tools=[WEATHER],
                                            tool_choice="required", stream=True)
    calls, content, finish = [], "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert content == "" and finish == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "weather"
    assert calls[0].function.arguments == whole.choices[0].message.tool_calls[0].function.arguments


def test_a_call_cut_by_max_tokens_is_text(server) -> None:
    reply = server.client().chat.completions.create(
        model=ts.MODEL, messages=ASK, max_tokens=3, temperature=0, tools=[WEATHER],
        tool_choice="required")
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content.startswith("{")


def test_none_leaves_the_tools_out_and_a_conversation_goes_on(server) -> None:
    client = server.client()
    plain = client.chat.completions.create(model=ts.MODEL, messages=ASK, max_tokens=10,
                                           temperature=0)
    none = client.chat.completions.create(model=ts.MODEL, messages=ASK, max_tokens=10,
                                          temperature=0, tools=[WEATHER], tool_choice="none")
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert not none.choices[0].message.tool_calls
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 4}'}]
    after = client.chat.completions.create(model=ts.MODEL, messages=history, max_tokens=8,
                                           temperature=0, tools=[WEATHER], tool_choice="none")
    assert after.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(("extra", "why"), [
    ({"tools": [WEATHER]}, "tool_choice 'auto'"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice 'auto'"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "distinct function names"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "'x', which is not among"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "give one of"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_tool_requests_are_400s(server, extra, why) -> None:
    with pytest.raises(openai.BadRequestError, match=why):
        server.client().chat.completions.create(model=ts.MODEL, messages=ASK, max_tokens=8,
                                                extra_body=extra)


def test_the_pure_parts() -> None:
    weather = ToolDef.model_validate(WEATHER)
    time_fn = ToolDef.model_validate(TIME)
    assert functions_to_call([weather, time_fn], "required") == [weather.function,
                                                                  time_fn.function]
    assert functions_to_call([weather], "none") == [] and functions_to_call(None, None) == []
    one = call_schema([weather.function])
    assert one["properties"]["name"] == {"const": "weather"} and "anyOf" not in one
    assert len(call_schema([weather.function, time_fn.function])["anyOf"]) == 2
    assert call_schema([FunctionDef(name="f")])["properties"]["arguments"] == {"type": "object"}
    merged = with_tools_prompt([("system", "Be brief."), ("user", "hi")], [weather.function])
    assert merged[0][0] == "system" and merged[0][1].startswith("Be brief.\n\nYou can call")
    assert '"name": "weather"' in merged[0][1] and merged[1] == ("user", "hi")
    added = with_tools_prompt([("user", "hi")], [weather.function])
    assert added[0][0] == "system" and added[1] == ("user", "hi")
    (call,) = tool_calls('{"name": "time", "arguments": {"zone": "UTC"}}')
    assert call["function"] == {"name": "time", "arguments": '{"zone": "UTC"}'}
    assert tool_calls('{"name": "time"') is None and tool_calls('{"x": 1}') is None
    assert json.loads(called_text([call])) == {"name": "time", "arguments": {"zone": "UTC"}}
    assert '"description"' not in with_tools_prompt([], [time_fn.function])[0][1]
