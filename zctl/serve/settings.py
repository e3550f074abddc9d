"""What a server is started with (``ServeSettings``)."""

from __future__ import annotations

from dataclasses import dataclass


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
