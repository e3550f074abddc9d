"""The web page's routes: the page itself at ``/`` and its files under ``/web/`` (package
data, zctl/serve/web/static: nothing is fetched from elsewhere), and the cluster view,
one JSON snapshot (``GET /zctl/cluster``) or a stream of them as Server-Sent Events
(``GET /zctl/cluster/stream``, docs/web.md). The cluster view asks for the API key as
every API route does; the page's files do not (they hold nothing of the cluster's)."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from zctl.serve.web.feed import ClusterFeed

STATIC = Path(str(files("zctl.serve.web") / "static"))
# the page's files change with the package: a browser asks for them again on every load
NO_STALE = {"Cache-Control": "no-cache"}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

router = APIRouter()


def feed(request: Request) -> ClusterFeed:
    return request.app.state.cluster_feed


@router.get("/", include_in_schema=False)
async def page() -> FileResponse:
    return FileResponse(STATIC / "index.html", headers=NO_STALE)


@router.get("/web/{name:path}", include_in_schema=False)
async def asset(name: str) -> FileResponse:
    path = (STATIC / name).resolve()
    if not path.is_relative_to(STATIC.resolve()) or not path.is_file():
        raise HTTPException(404, f"no such file: {name}")
    return FileResponse(path, headers=NO_STALE)


@router.get("/zctl/cluster")
async def cluster(request: Request) -> JSONResponse:
    """The cluster view now (its latency and tok/s over the time since the last view)."""
    request.app.state.context.check_key(request)
    return JSONResponse(await feed(request).view())


@router.get("/zctl/cluster/stream")
async def cluster_stream(request: Request) -> StreamingResponse:
    """The cluster view once a second, as Server-Sent Events (``event: cluster``)."""
    request.app.state.context.check_key(request)
    return StreamingResponse(feed(request).events(), media_type="text/event-stream",
                             headers=SSE_HEADERS)
