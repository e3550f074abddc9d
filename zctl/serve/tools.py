"""OpenAI tool calls (pure): which functions a chat reply may call, the grammar that holds
the reply to a call of one of them (or to text), the system prompt that shows them to the
model, and the reply's ``tool_calls``.

A call is the JSON object ``{"name": ..., "arguments": ...}`` for one of the functions,
its arguments held to the function's parameters schema (zctl.engine.constraints), so a call
always parses and names a function that exists. ``tool_choice: "required"`` (or a named
function) holds the reply to a call. ``"auto"`` (the default with tools) lets it be a call
or text: the grammar is a call or text that does not begin with ``{``, so the reply's
first character tells which, with no parser of a model's own tool-call format (vLLM's
``--tool-call-parser``). ``"none"`` leaves the tools out.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from zctl.engine.requests import GenerationDone

MAX_TOOLS = 128
CALL_FORM = '{"name": <the function\'s name>, "arguments": <its arguments>}'
TOOLS_PROMPT = (f"You can call one of these functions. Answer with a JSON object {CALL_FORM} "
                "and nothing else.\nFunctions:\n")
AUTO_TOOLS_PROMPT = ("You can call one of these functions. To call one, answer with a JSON "
                     f"object {CALL_FORM} and nothing else; otherwise answer in text."
                     "\nFunctions:\n")


class ToolError(ValueError):
    """A request's tools or tool choice cannot be served (a 400)."""


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str = ""
    parameters: dict[str, Any] | None = None  # a JSON Schema; none: any object


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    """The function a tool call calls, its arguments as a JSON text."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """A reply's tool call, as the chat API's ``tool_calls`` carry it."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolPlan(NamedTuple):
    """What a chat reply does with its tools: it calls one of ``functions`` (none: it
    answers in text), or, ``optional`` ("auto"), either calls one or answers in text."""
    functions: list[FunctionDef]
    optional: bool = False


class ToolOutput:
    """A reply's output under a ``ToolPlan``, choice by choice: whether a choice's text is
    held back while streaming (a call comes whole at its end), and the calls it ended
    with."""

    def __init__(self, plan: ToolPlan = ToolPlan([])) -> None:
        self.plan = plan
        self._calling: dict[int, bool] = {}  # "auto": whether choice i's output is a call

    def holds(self, index: int, text: str = "") -> bool:
        """Whether choice ``index``'s streamed text is held back, as a call is (it comes
        whole at its end); ``text`` is its next chunk's. Under "auto" the output's first
        character tells: a call begins with ``{`` and text never does."""
        if not self.plan.functions:
            return False
        if not self.plan.optional:
            return True
        if index not in self._calling:
            if not text:
                return True  # nothing shown yet: undecided
            self._calling[index] = text.startswith("{")
        return self._calling[index]

    def calls(self, done: GenerationDone) -> list[ToolCall] | None:
        """A finished choice's tool calls (None: it is text, or was cut short)."""
        if self.plan.functions and done.stop_reason in ("eos", "stop"):
            return tool_calls(done.text)
        return None


def plan_tools(tools: list[ToolDef] | None, choice: ToolChoice | None) -> ToolPlan:
    """The request's ``tools`` and ``tool_choice`` as a plan (ToolError: a 400)."""
    if not tools:
        if choice is not None and choice != "none":
            raise ToolError("tool_choice needs tools")
        return ToolPlan([])
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ToolError("tools must have distinct function names")
    if choice == "none":
        return ToolPlan([])
    if choice is None or choice == "auto":
        return ToolPlan([t.function for t in tools], optional=True)
    if choice == "required":
        return ToolPlan([t.function for t in tools])
    named = [t.function for t in tools if t.function.name == choice.function.name]
    if not named:
        raise ToolError(f"tool_choice names {choice.function.name!r}, which is not among "
                        "the tools")
    return ToolPlan(named)


def call_schema(functions: list[FunctionDef]) -> dict[str, Any]:
    """The JSON Schema of a call of one of ``functions``."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": f.name},
                             "arguments": f.parameters or {"type": "object"}}}
             for f in functions]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def tool_grammar(plan: ToolPlan) -> tuple[str, str]:
    """The engine's (grammar_kind, grammar) for a reply under ``plan`` (which has
    functions): a call, or with ``optional`` a call or text that does not begin with ``{``
    (zctl.engine.constraints' ``json_or_text``: free text once its first token shows it)."""
    return "json_or_text" if plan.optional else "json_schema", \
        json.dumps(call_schema(plan.functions))


def tools_prompt(plan: ToolPlan) -> str:
    """What the system prompt says of the functions."""
    lines = [json.dumps({"name": f.name, **({"description": f.description} if f.description
                                            else {}),
                         "parameters": f.parameters or {"type": "object"}})
             for f in plan.functions]
    return (AUTO_TOOLS_PROMPT if plan.optional else TOOLS_PROMPT) + "\n".join(lines)


def with_tools_prompt(messages: list[tuple[str, str]], plan: ToolPlan
                      ) -> list[tuple[str, str]]:
    """The conversation with the plan's functions shown in its system message (one is
    added first when it has none)."""
    text = tools_prompt(plan)
    if messages and messages[0][0] in ("system", "developer"):
        role, content = messages[0]
        return [(role, f"{content}\n\n{text}" if content else text), *messages[1:]]
    return [("system", text), *messages]


def tool_calls(text: str) -> list[ToolCall] | None:
    """The reply's ``tool_calls`` from the call the engine generated (None: the text is
    not a whole call, as when ``max_tokens`` cut it, or text that does not begin as a
    call does)."""
    if not text.startswith("{"):
        return None
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and "arguments" in call):
        return None
    return [ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(
        name=call["name"], arguments=json.dumps(call["arguments"])))]


def called_text(calls: list[dict[str, Any]]) -> str:
    """An assistant turn's earlier tool calls as the model's own text, for the history."""
    return "\n".join(json.dumps({"name": c.get("function", {}).get("name", ""),
                                 "arguments": _arguments(c.get("function", {}))})
                     for c in calls)


def _arguments(function: dict[str, Any]) -> Any:
    raw = function.get("arguments", "{}")
    try:
        return json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return raw
