"""``GET /v1/models`` and ``GET /v1/models/{id}``: the served model under each name it
answers to, with its context length and stages."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from zctl.serve.context import ServingContext
from zctl.service.messages import ServiceStats


def model_card(name: str, info: ServiceStats) -> dict[str, Any]:
    """The model's object in /v1/models under ``name``."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "zctl",
            "max_model_len": info.max_context, "context_length": info.max_context,
            "stages": [{"index": s.index, "node": s.node_id} for s in info.stages]}


class Models:
    """The models listed over ``context``."""

    def __init__(self, context: ServingContext) -> None:
        self.context = context

    async def list(self, request: Request) -> dict[str, Any]:
        self.context.check_key(request)
        info = await self.context.current_stats()
        return {"object": "list",
                "data": [model_card(name, info) for name in self.context.names(info)]}

    async def retrieve(self, model_id: str, request: Request) -> dict[str, Any]:
        """The served model's object under ``model_id``, one of its names (else a 404)."""
        self.context.check_key(request)
        info = self.context.check_model(await self.context.current_stats(), model_id, 404)
        return model_card(model_id, info)
