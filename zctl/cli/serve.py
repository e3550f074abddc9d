"""``zctl serve``: the OpenAI-compatible HTTP API in front of the running cluster (or an
embedded local one, for this command's lifetime)."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from zctl.cli.cluster import (
    DynamicQuantization,
    Exact,
    KvMemory,
    KvPrecision,
    MaxStreams,
    Precision,
    PrefixCacheMb,
    _fail,
    _running_record,
    err,
    kv_problem,
    max_streams_problem,
    numerics,
)
from zctl.cli.exports import AUTO, WEIGHTS_HELP, ensure_export
from zctl.cli.run import EmbeddedNodes, check_nodes, embedded_note, parse_k, parse_speculative
from zctl.cli.signals import ends_as_on_ctrl_c
from zctl.engine.requests import DEFAULT_MAX_STREAMS
from zctl.launcher.api import cors_origin, valid_port
from zctl.launcher.embedded import EmbeddedCluster
from zctl.launcher.processes import runtime_spec
from zctl.launcher.record import ClusterError, ClusterRecord
from zctl.serve.tls import ApiTls, api_tls, scheme


def serve_problem(port: int, max_queue: int) -> str:
    """Why these options cannot serve ("" when they can)."""
    if not valid_port(port):
        return f"--port must be in 1..65535, not {port}"
    if max_queue < 1:
        return f"--max-queue must be >= 1, not {max_queue}"
    return ""


def model_names(given: list[str]) -> tuple[str, ...]:
    """--served-model-name's names, in order, each once (ValueError for an empty one)."""
    names = [n.strip() for n in given]
    if not all(names):
        raise ValueError("--served-model-name takes a non-empty name")
    return tuple(dict.fromkeys(names))


def run_api(record: ClusterRecord, host: str, port: int, api_key: str | None, max_queue: int,
            speculation: tuple[str, int], cors_origins: tuple[str, ...] = (),
            tls: ApiTls | None = None, model_names: tuple[str, ...] = ()) -> None:
    """Serve the cluster's generation service over HTTP (HTTPS with ``tls``) until
    interrupted."""
    try:
        import uvicorn

        from zctl.serve.app import ServeSettings, create_app
        from zctl.service.async_client import AsyncServiceClient
    except ImportError as exc:
        raise ClusterError(f"zctl serve needs the [serve] extra ({exc}): pip install "
                           "'zctl[serve]'") from None
    app = create_app(AsyncServiceClient(record.serve),
                     ServeSettings(api_key=api_key, max_queue=max_queue, speculation=speculation,
                                   cors_origins=cors_origins, model_names=model_names))
    base = f"{scheme(tls)}://{host}:{port}"
    err.print(f"serving the OpenAI API at {base}/v1 and the web page at {base}/ (Ctrl-C stops "
              "it)", highlight=False)
    files = {"ssl_certfile": tls.certfile, "ssl_keyfile": tls.keyfile} if tls else {}
    server_type = stopping_server_type(uvicorn.Server)
    server_type(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                               timeout_graceful_shutdown=SHUTDOWN_GRACE_S, **files)).run()


SHUTDOWN_GRACE_S = 1  # requests still running this long after a stop are cancelled


def not_a_cancelled_request(record: logging.LogRecord) -> bool:
    """Whether uvicorn's log record is not about a request that a stop cancelled after
    SHUTDOWN_GRACE_S (that is the stop's doing, not an error of the application)."""
    exc = record.exc_info[1] if record.exc_info else None
    return (not isinstance(exc, asyncio.CancelledError)
            and "timeout graceful shutdown" not in record.getMessage())


def stopping_server_type(base: type) -> type:
    """uvicorn's Server (``base``, imported only with the [serve] extra) shutting down on
    SIGHUP (unless it is ignored) as it does on Ctrl-C and SIGTERM: it stops listening,
    cancels the requests still running after SHUTDOWN_GRACE_S (their generations with
    them; quietly: ``not_a_cancelled_request``), then raises the signal again, so this
    command's own handling follows (zctl.cli.signals: an embedded cluster stopped, exit
    code 128 + n)."""

    class StoppingServer(base):  # type: ignore[misc, valid-type]
        async def shutdown(self, sockets: Any = None) -> None:
            logging.getLogger("uvicorn.error").addFilter(not_a_cancelled_request)
            await super().shutdown(sockets)

        @contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:  # nohup zctl serve
                    yield
                    return
                previous = signal.signal(signal.SIGHUP, self.handle_exit)
                try:
                    yield
                finally:
                    signal.signal(signal.SIGHUP, previous)

    return StoppingServer


@ends_as_on_ctrl_c
def serve(
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on")] = 8000,
    api_key: Annotated[str | None, typer.Option(
        envvar="ZCTL_API_KEY", help="require this key (Authorization: Bearer KEY)")] = None,
    max_queue: Annotated[int, typer.Option(
        help="requests in flight (running or waiting) beyond which new ones get 429")] = 64,
    speculative: Annotated[str, typer.Option(
        help="default speculative decoding of requests that do not choose: '' (none), "
             "'lookup', 'pipelined' or 'draft:PATH'")] = "",
    k: Annotated[str, typer.Option("--k", help="default draft tokens per step, or 'auto'")] = "auto",
    cors_origin_list: Annotated[list[str] | None, typer.Option(
        "--cors-origin", help="a web origin whose pages may call the API from a browser "
                              "(repeatable; '*': any); none by default")] = None,
    served_model_names: Annotated[list[str] | None, typer.Option(
        "--served-model-name", envvar="ZCTL_SERVED_MODEL_NAME",
        help="a name requests may give the model (repeatable; the first is the one replies "
             "carry); default: the export's own")] = None,
    ssl_certfile: Annotated[Path | None, typer.Option(
        help="serve HTTPS with this PEM certificate (chain); with --ssl-keyfile")] = None,
    ssl_keyfile: Annotated[Path | None, typer.Option(
        help="the certificate's PEM private key")] = None,
    model: Annotated[str, typer.Option(help="model for the embedded cluster")] = "smollm2-135m",
    stages: Annotated[int | None, typer.Option(
        help="stages of the export made for a model name (default: --nodes; an export "
             "directory has its own)", show_default=False)] = None,
    nodes: EmbeddedNodes = 1,
    weights: Annotated[str, typer.Option(help=WEIGHTS_HELP)] = AUTO,
    cpu_sets: Annotated[str, typer.Option(
        help="embedded cluster: shared | split (each node its own cores)")] = "shared",
    max_streams: MaxStreams = DEFAULT_MAX_STREAMS,
    kv_memory_mb: KvMemory = 2048,
    prefix_cache_mb: PrefixCacheMb = 512,
    precision: Precision = "f32",
    exact: Exact = None,
    kv_cache_precision: KvPrecision = None,
    dynamic_quantization: DynamicQuantization = None,
) -> None:
    """Serve an OpenAI-compatible API (chat and text completions, models, /health,
    /metrics) and the web page at / (chat, the live cluster view) on the running cluster,
    or on an embedded local one."""
    problem = (serve_problem(port, max_queue) or max_streams_problem(max_streams)
               or kv_problem(kv_memory_mb, prefix_cache_mb))
    if problem:
        _fail(problem)
    embedded = ExitStack()  # the embedded cluster's lifetime, when this command starts one
    try:
        check_nodes(nodes, stages)
        speculation = (parse_speculative(speculative), parse_k(k))
        origins = tuple(cors_origin(o) for o in cors_origin_list or ())
        tls = api_tls(ssl_certfile, ssl_keyfile)  # (checked before a cluster starts)
        names = model_names(served_model_names or [])
        record = _running_record()
        if record is None:
            kv, dq = numerics(exact, kv_cache_precision, dynamic_quantization)
            rt = runtime_spec(None if precision == "default" else precision, None, "CPU", kv, dq)
            export_dir = ensure_export(model, stages or nodes, weights)
            err.print(embedded_note(nodes), soft_wrap=True)
            record = embedded.enter_context(EmbeddedCluster(
                export_dir, nodes, rt, cpu_sets=cpu_sets, max_streams=max_streams,
                kv_memory_mb=kv_memory_mb, prefix_cache_mb=prefix_cache_mb))
        run_api(record, host, port, api_key, max_queue, speculation, origins, tls, names)
    except (ClusterError, ValueError, OSError) as exc:
        _fail(str(exc))
    finally:
        embedded.close()
