"""The OpenAPI document (``/openapi.json``): FastAPI's, which describes each route's JSON
reply by the route's ``response_model``, with each streamed reply's events added.

A route that streams when asked (``"stream": true``) answers with JSON or with server-sent
events; FastAPI describes only the JSON. Its events' model (``STREAMS`` of each API's
routes) is added as the route's ``text/event-stream`` content, each event's ``data`` that
model's JSON, as FastAPI describes the events of a route that only streams, and the
models it names are added to the document's schemas."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import TypeAdapter

REF = "#/components/schemas/{model}"


def event_schema(data: dict[str, Any]) -> dict[str, Any]:
    """A server-sent event whose ``data`` is JSON of the ``data`` schema."""
    return {"type": "object", "required": ["data"], "properties": {
        "data": {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": data},
        "event": {"type": "string"}}}


def with_streams(document: dict[str, Any], streams: dict[str, Any]) -> dict[str, Any]:
    """``document`` with each path of ``streams`` (a POST) answering also with server-sent
    events of its type, and the schemas those name."""
    adapters = [(path, "serialization", TypeAdapter(events)) for path, events in streams.items()]
    schemas, named = TypeAdapter.json_schemas(adapters, ref_template=REF)
    components = document.setdefault("components", {}).setdefault("schemas", {})
    for name, schema in named.get("$defs", {}).items():
        components.setdefault(name, schema)
    for (path, _), schema in schemas.items():
        reply = document["paths"][path]["post"]["responses"]["200"]
        reply.setdefault("content", {})["text/event-stream"] = {
            "itemSchema": event_schema(schema)}
    return document


def openapi_document(app: FastAPI, streams: dict[str, Any]) -> dict[str, Any]:
    """The application's document (made once), its streamed replies' events included."""
    if app.openapi_schema is None:
        app.openapi_schema = with_streams(FastAPI.openapi(app), streams)
    return app.openapi_schema
