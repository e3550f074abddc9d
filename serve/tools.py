"""OpenAI tool calls (pure): the functions a chat reply must call, the grammar that holds
the reply to a call of one of them, the system prompt that shows them to the model, and
the reply's ``tool_calls``.

A request with ``tools`` and ``tool_choice: "required"`` (or a named function) is
answered with a call: the engine holds the output to ``{"name": ..., "arguments": ...}``
for one of the functions, its arguments to the function's parameters schema
(engine.constraints), so the call always parses and names a function that exists.
``"none"`` leaves the tools out. ``"auto"`` (the default with tools) would need a parser
of the model's own tool-call format to tell a call from text, so it is refused, as vLLM
refuses it without ``--tool-call-parser``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_TOOLS = 128
TOOLS_PROMPT = ("You can call one of these functions. Answer with a JSON object "
                '{"name": <the function\'s name>, "arguments": <its arguments>} and nothing '
                "else.\nFunctions:\n")


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


def functions_to_call(tools: list[ToolDef] | None, choice: ToolChoice | None
                      ) -> list[FunctionDef]:
    """The functions one of which the reply must call (empty: it answers in text)."""
    if not tools:
        if choice is not None and choice != "none":
            raise ToolError("tool_choice needs tools")
        return []
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ToolError("tools must have distinct function names")
    if choice == "none":
        return []
    if choice is None or choice == "auto":
        raise ToolError("tool_choice 'auto' needs a parser of the model's tool-call format, "
                        "which this server does not have: ask for 'required' or a named "
                        "function (the reply is then held to a call), or 'none'")
    if choice == "required":
        return [t.function for t in tools]
    named = [t.function for t in tools if t.function.name == choice.function.name]
    if not named:
        raise ToolError(f"tool_choice names {choice.function.name!r}, which is not among "
                        "the tools")
    return named


def call_schema(functions: list[FunctionDef]) -> dict[str, Any]:
    """The JSON Schema of a call of one of ``functions``."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": f.name},
                             "arguments": f.parameters or {"type": "object"}}}
             for f in functions]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def tools_prompt(functions: list[FunctionDef]) -> str:
    """What the system prompt says of the functions."""
    lines = [json.dumps({"name": f.name, **({"description": f.description} if f.description
                                            else {}),
                         "parameters": f.parameters or {"type": "object"}})
             for f in functions]
    return TOOLS_PROMPT + "\n".join(lines)


def with_tools_prompt(messages: list[tuple[str, str]], functions: list[FunctionDef]
                      ) -> list[tuple[str, str]]:
    """The conversation with the functions shown in its system message (one is added
    first when it has none)."""
    text = tools_prompt(functions)
    if messages and messages[0][0] in ("system", "developer"):
        role, content = messages[0]
        return [(role, f"{content}\n\n{text}" if content else text), *messages[1:]]
    return [("system", text), *messages]


def tool_calls(text: str) -> list[dict[str, Any]] | None:
    """The reply's ``tool_calls`` from the call the engine generated (None: the text is
    not a whole call, as when ``max_tokens`` cut it)."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and "arguments" in call):
        return None
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}]


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
