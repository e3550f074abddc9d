"""What a server is started with (``ServeSettings``), and the model as /v1/models shows it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zctl.service.messages import ServiceStats


@dataclass(frozen=True)
class ServeSettings:
    """``api_key``: required as a bearer token when set; ``max_queue``: requests in flight
    (running or waiting) beyond which new ones get 429; ``speculation``: the default
    (mode, K) of requests that do not choose; ``cors_origins``: the web origins whose pages
    may call the API from a browser ("*": any; none by default, so a page the user visits
    cannot drive a local server); ``model_names``: the names requests may give the model,
    the first the one replies carry (none: the export's own)."""

    api_key: str | None = None
    max_queue: int = 64
    speculation: tuple[str, int] = ("", 0)
    cors_origins: tuple[str, ...] = ()
    model_names: tuple[str, ...] = ()


def model_card(name: str, info: ServiceStats) -> dict[str, Any]:
    """The model's object in /v1/models under ``name``."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "zctl",
            "max_model_len": info.max_context, "context_length": info.max_context,
            "stages": [{"index": s.index, "node": s.node_id} for s in info.stages]}
