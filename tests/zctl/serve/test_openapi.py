"""The OpenAPI document (zctl.serve.openapi, at /openapi.json): every route with its reply's
schema (JSON, and the events of those that stream) and its errors' shape, every schema
it names defined."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from zctl.serve.app import create_app

REF = "#/components/schemas/"
JSON_REPLIES = {  # (method, path): the reply's model
    ("post", "/v1/chat/completions"): "ChatCompletion",
    ("post", "/v1/completions"): "Completion",
    ("post", "/v1/responses"): "ResponseBody",
    ("get", "/v1/responses/{response_id}"): "ResponseBody",
    ("delete", "/v1/responses/{response_id}"): "ResponseDeleted",
    ("post", "/tokenize"): "TokenizeReply",
    ("post", "/detokenize"): "DetokenizeReply",
    ("get", "/v1/models"): "ModelList",
    ("get", "/v1/models/{model_id}"): "ModelCard",
    ("post", "/v1/messages"): "Message",
    ("post", "/v1/messages/count_tokens"): "MessageTokensCount",
    ("get", "/health"): "Health"}
STREAMED = {"/v1/chat/completions": "ChatCompletionChunkWithUsage",
            "/v1/completions": "CompletionChunkWithUsage"}


def document() -> dict[str, Any]:
    async def ask() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(None))  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            return await client.get("/openapi.json")

    reply = asyncio.run(ask())
    assert reply.status_code == 200
    return reply.json()


def refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        return set().union(*(refs(v) for k, v in node.items() if k != "$ref"),
                           {node["$ref"]} if "$ref" in node else set())
    if isinstance(node, list):
        return set().union(*(refs(v) for v in node))
    return set()


def test_every_route_lists_its_replys_schema() -> None:
    doc = document()
    for (method, path), model in JSON_REPLIES.items():
        reply = doc["paths"][path][method]["responses"]["200"]["content"]
        assert reply["application/json"]["schema"] == {"$ref": REF + model}, (path, reply)
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    chunk = doc["components"]["schemas"]["ChatCompletionChunkWithUsage"]
    assert list(chunk["properties"]) == ["id", "object", "created", "model", "choices", "usage"]
    assert doc["components"]["schemas"]["ChatCompletion"]["required"] == [
        "id", "created", "model", "choices", "usage"]


def test_streamed_replies_list_their_events() -> None:
    doc = document()
    for path, model in STREAMED.items():
        events = doc["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]
        data = events["itemSchema"]["properties"]["data"]
        assert data["contentMediaType"] == "application/json"
        assert data["contentSchema"] == {"$ref": REF + model}
    for path, member in (("/v1/messages", "MessageStartEvent"),
                         ("/v1/responses", "TextDeltaEvent")):
        events = doc["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]
        members = events["itemSchema"]["properties"]["data"]["contentSchema"]["anyOf"]
        assert {"$ref": REF + member} in members
    for path in ("/v1/models", "/tokenize", "/v1/messages/count_tokens"):
        method = "get" if path == "/v1/models" else "post"
        assert "text/event-stream" not in doc["paths"][path][method]["responses"]["200"][
            "content"]


def test_errors_are_listed_in_each_apis_shape() -> None:
    doc = document()
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert chat["4XX"]["content"]["application/json"]["schema"] == {"$ref": REF + "ErrorReply"}
    assert chat["5XX"]["content"]["application/json"]["schema"] == {"$ref": REF + "ErrorReply"}
    assert "422" not in chat  # a bad field is a 400 in OpenAI's shape, not FastAPI's 422
    message = doc["paths"]["/v1/messages"]["post"]["responses"]
    assert message["4XX"]["content"]["application/json"]["schema"] == {
        "$ref": REF + "AnthropicError"}
    assert message["413"]["content"]["application/json"]["schema"] == {
        "$ref": REF + "ErrorReply"}  # refused before the route: OpenAI's shape


def test_every_schema_named_is_defined() -> None:
    doc = document()
    named = {ref.removeprefix(REF) for ref in refs(doc)}
    assert named and named <= set(doc["components"]["schemas"]), \
        named - set(doc["components"]["schemas"])
