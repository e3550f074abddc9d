"""``GET /v1/models`` and ``GET /v1/models/{id}``: the served model under each name it
answers to, with its context length and stages."""

from __future__ import annotations

from typing import Literal

from fastapi import Request
from pydantic import BaseModel

from zctl.serve.context import ServingContext
from zctl.service.messages import ServiceStats


class ModelStage(BaseModel):
    """A stage of the model and the node that runs it."""

    index: int
    node: str


class ModelCard(BaseModel):
    """The model's object under one of its names (OpenAI's, with vLLM's ``max_model_len``
    and zctl's ``context_length`` and stages)."""

    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "zctl"
    max_model_len: int
    context_length: int
    stages: list[ModelStage]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def model_card(name: str, info: ServiceStats) -> ModelCard:
    """The model's object in /v1/models under ``name``."""
    return ModelCard(id=name, max_model_len=info.max_context, context_length=info.max_context,
                     stages=[ModelStage(index=s.index, node=s.node_id) for s in info.stages])


class Models:
    """The models listed over ``context``."""

    def __init__(self, context: ServingContext) -> None:
        self.context = context

    async def list(self, request: Request) -> ModelList:
        self.context.check_key(request)
        info = await self.context.current_stats()
        return ModelList(data=[model_card(name, info) for name in self.context.names(info)])

    async def retrieve(self, model_id: str, request: Request) -> ModelCard:
        """The served model's object under ``model_id``, one of its names (else a 404)."""
        self.context.check_key(request)
        info = self.context.check_model(await self.context.current_stats(), model_id, 404)
        return model_card(model_id, info)
