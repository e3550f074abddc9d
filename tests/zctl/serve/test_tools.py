"""Tool calls through the API (zctl.serve.tools): ``tool_choice`` "required" or a named function
holds the reply to a call of one of the tools, answered as ``tool_calls`` (whole and
streamed, with the official client); "auto" (the default) answers with a call or with
text, streamed as text; "none" leaves the tools out; bad tools are 400s; a conversation
carrying earlier calls and their results goes on."""

from __future__ import annotations

import json

import openai
import pytest

import tests.zctl.serve.test_app as ts
from tests.zctl.serve.test_app import ASK
from zctl.serve.tools import (
    FunctionDef,
    ToolDef,
    ToolPlan,
    call_schema,
    called_text,
    plan_tools,
    tool_calls,
    tool_grammar,
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


def streamed(client, **kwargs) -> tuple[str, list, str | None, int]:  # noqa: ANN001
    """A streamed chat reply's content, tool calls, finish reason and content chunks."""
    content, calls, finish, pieces = "", [], None, 0
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        pieces += bool(delta.content)
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish, pieces


@pytest.mark.parametrize("choice", [None, "auto"])
def test_auto_answers_with_a_call_or_with_text(server, tiny, choice) -> None:
    client = server.client()
    brace = tiny[2].encode("{", chat=False)[-1]
    ask = dict(model=ts.MODEL, messages=ASK, max_tokens=60, temperature=0, tools=[TIME],
               **({"tool_choice": choice} if choice else {}))
    # a random model's first token: "{" favoured, the reply is a call...
    call = client.chat.completions.create(logit_bias={str(brace): 100}, **ask)
    assert call.choices[0].finish_reason == "tool_calls"
    assert call.choices[0].message.content is None
    check_call(call.choices[0].message.tool_calls[0])
    content, calls, finish, pieces = streamed(client, logit_bias={str(brace): 100}, **ask)
    assert (content, finish, len(calls)) == ("", "tool_calls", 1)
    whole = call.choices[0].message.tool_calls[0].function
    assert (calls[0].function.name, calls[0].function.arguments) == (whole.name, whole.arguments)
    # ... "{" barred, it is text: never beginning as a call, and streamed as it comes
    text = client.chat.completions.create(logit_bias={str(brace): -100}, **ask)
    content = text.choices[0].message.content
    assert text.choices[0].finish_reason in ("stop", "length") and content
    assert not text.choices[0].message.tool_calls and not content.startswith("{")
    assert streamed(client, logit_bias={str(brace): -100}, **ask)[:3] == (
        content, [], text.choices[0].finish_reason)
    assert streamed(client, logit_bias={str(brace): -100}, **ask)[3] > 1


def test_auto_samples_both_branches(server, tiny) -> None:
    """Sampled replies under "auto", "{" favoured so that about half begin with it: each
    is a call that parses or text that does not begin with "{", and both come."""
    brace = tiny[2].encode("{", chat=False)[-1]
    reply = server.client().chat.completions.create(
        model=ts.MODEL, messages=ASK, max_tokens=60, temperature=1.0, seed=11, n=12,
        tools=[TIME], tool_choice="auto", logit_bias={str(brace): 8})
    kinds = set()
    for choice in reply.choices:
        kinds.add(bool(choice.message.tool_calls))
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            check_call(choice.message.tool_calls[0])
        else:
            assert not choice.message.content.startswith("{")
    assert kinds == {True, False}


@pytest.mark.parametrize(("extra", "why"), [
    ({"tool_choice": "auto"}, "tool_choice needs tools"),
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
    both = [weather.function, time_fn.function]
    assert plan_tools([weather, time_fn], "required") == ToolPlan(both)
    assert plan_tools([weather, time_fn], None) == plan_tools([weather, time_fn], "auto") \
        == ToolPlan(both, optional=True)
    assert plan_tools([weather], "none") == ToolPlan([]) == plan_tools(None, None)
    assert tool_grammar(ToolPlan(both))[0] == "json_schema"
    kind, schema = tool_grammar(ToolPlan(both, optional=True))
    assert kind == "json_or_text" and json.loads(schema) == call_schema(both)
    one = call_schema([weather.function])
    assert one["properties"]["name"] == {"const": "weather"} and "anyOf" not in one
    assert len(call_schema([weather.function, time_fn.function])["anyOf"]) == 2
    assert call_schema([FunctionDef(name="f")])["properties"]["arguments"] == {"type": "object"}
    merged = with_tools_prompt([("system", "Be brief."), ("user", "hi")],
                               ToolPlan([weather.function]))
    assert merged[0][0] == "system" and merged[0][1].startswith("Be brief.\n\nYou can call")
    assert '"name": "weather"' in merged[0][1] and merged[1] == ("user", "hi")
    added = with_tools_prompt([("user", "hi")], ToolPlan([weather.function], optional=True))
    assert "otherwise answer in text" in added[0][1]
    assert "otherwise" not in merged[0][1]
    assert added[0][0] == "system" and added[1] == ("user", "hi")
    (call,) = tool_calls('{"name": "time", "arguments": {"zone": "UTC"}}')
    assert call.function.model_dump() == {"name": "time", "arguments": '{"zone": "UTC"}'}
    assert call.id.startswith("call_") and call.type == "function"
    assert tool_calls('{"name": "time"') is None and tool_calls('{"x": 1}') is None
    assert tool_calls(' {"name": "time", "arguments": {}}') is None  # text, not a call
    assert json.loads(called_text([call.model_dump()])) == {"name": "time",
                                                            "arguments": {"zone": "UTC"}}
    assert '"description"' not in with_tools_prompt([], ToolPlan([time_fn.function]))[0][1]


def test_streamed_auto_choices_each_decide_alone(server, tiny) -> None:
    """Streamed, each of n sampled choices under "auto" streams its text or sends its call
    whole at its end, whatever the others do."""
    brace = tiny[2].encode("{", chat=False)[-1]
    content: dict[int, str] = {}
    calls: dict[int, list] = {}
    finish: dict[int, str] = {}
    for chunk in server.client().chat.completions.create(
            model=ts.MODEL, messages=ASK, max_tokens=60, temperature=1.0, seed=11, n=12,
            tools=[TIME], tool_choice="auto", logit_bias={str(brace): 8}, stream=True):
        for choice in chunk.choices:
            content[choice.index] = content.get(choice.index, "") + (choice.delta.content or "")
            calls.setdefault(choice.index, []).extend(choice.delta.tool_calls or [])
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    assert sorted(finish) == list(range(12))
    for i in range(12):
        if calls[i]:
            assert content[i] == "" and len(calls[i]) == 1 and finish[i] == "tool_calls"
            assert calls[i][0].function.name == "time"
        else:
            assert content[i] and not content[i].startswith("{")
            assert finish[i] in ("stop", "length")
    assert {bool(calls[i]) for i in range(12)} == {True, False}  # both, side by side
