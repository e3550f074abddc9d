"""The web page's routes: the page itself at ``/`` and its files under ``/web/`` (package
data, zctl/serve/web/static: nothing is fetched from elsewhere), and the cluster view,
one JSON snapshot (``GET /zctl/cluster``) or a stream of them as Server-Sent Events
(``GET /zctl/cluster/stream``, docs/web.md). The cluster view asks for the API key as
every API route does; the page's files do not (they hold nothing of the cluster's)."""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.responses import Response
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

from zctl.serve.encoding import event_stream
from zctl.serve.web.feed import ClusterFeed

STATIC = Path(str(files("zctl.serve.web") / "static"))


class PageFiles(StaticFiles):
    """The page's files, answering conditional requests (304 when the browser's copy is
    current: ETag or Last-Modified), each marked ``no-cache``: they change with the
    package, so a browser asks again on every load, and mostly hears "not modified"."""

    def file_response(self, full_path: str | os.PathLike[str], stat_result: os.stat_result,
                      scope: Scope, status_code: int = 200) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        response.headers["Cache-Control"] = "no-cache"
        return response


PAGE_FILES = PageFiles(directory=STATIC)

router = APIRouter()


def feed(request: Request) -> ClusterFeed:
    return request.app.state.cluster_feed


@router.get("/", include_in_schema=False)
async def page(request: Request) -> Response:
    return await PAGE_FILES.get_response("index.html", request.scope)


@router.get("/web/{name:path}", include_in_schema=False)
async def asset(name: str, request: Request) -> Response:
    """A file of the page (404: none by that name under static/, ``..`` included)."""
    return await PAGE_FILES.get_response(os.path.normpath(name), request.scope)


@router.get("/zctl/cluster")
async def cluster(request: Request) -> JSONResponse:
    """The cluster view now (its latency and tok/s over the time since the last view)."""
    request.app.state.context.check_key(request)
    return JSONResponse(await feed(request).view())


@router.get("/zctl/cluster/stream")
async def cluster_stream(request: Request) -> StreamingResponse:
    """The cluster view once a second, as Server-Sent Events (``event: cluster``)."""
    request.app.state.context.check_key(request)
    return event_stream(feed(request).events())
