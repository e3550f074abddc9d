"""The HTTP API of a local cluster (``zctl cluster up --api``): its address and CORS
origins checked, and ``zctl serve`` started in the background."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from zctl.launcher.record import ClusterError, ClusterRecord
from zctl.serve.tls import ApiTls, own_server_context, scheme


def valid_port(port: int) -> bool:
    """Whether a TCP port can be listened on (1..65535)."""
    return 0 < port < 65536


def parse_api(value: str) -> tuple[str, int]:
    """HOST:PORT of ``cluster up --api`` (a bare PORT listens on 127.0.0.1)."""
    host, _, port = value.rpartition(":")
    if not port.isdigit() or not valid_port(int(port)):
        raise ClusterError(f"--api takes HOST:PORT (e.g. 127.0.0.1:8000), not {value!r}")
    return host or "127.0.0.1", int(port)


def cors_origin(value: str, option: str = "--cors-origin") -> str:
    """An origin as browsers send it (``scheme://host[:port]``, no path), or "*"; raises
    ValueError with the reason."""
    origin = value.strip().rstrip("/")
    if origin == "*":
        return origin
    scheme, sep, rest = origin.partition("://")
    if scheme not in ("http", "https") or not sep or not rest or "/" in rest:
        raise ValueError(f"{option} takes '*' or scheme://host[:port], not {value!r}")
    return origin


def start_api(record: ClusterRecord, value: str, timeout_s: float = 60.0,
              max_queue: int | None = None, cors_origins: tuple[str, ...] = (),
              tls: ApiTls | None = None, api_key: str | None = None) -> ClusterRecord:
    """Start ``zctl serve`` for the cluster in the background (it serves the cluster.json of
    this process's zctl home: write the record there first) and wait for it to answer; the
    record gains its pid and address. ``max_queue``: its --max-queue, None its default;
    ``cors_origins``: its --cors-origin values; ``tls``: HTTPS with these files;
    ``api_key``: the key it requires ("": none), None: ZCTL_API_KEY's, if that is set."""
    import urllib.error
    import urllib.request

    host, port = parse_api(value)
    log_path = Path(record.logs[0]).parent / "api.log" if record.logs else Path(os.devnull)
    command = [sys.executable, "-m", "zctl", "serve", "--host", host, "--port", str(port)]
    if max_queue is not None:
        command += ["--max-queue", str(max_queue)]
    for origin in cors_origins:
        command += ["--cors-origin", origin]
    if tls is not None:
        command += tls.serve_args()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if api_key is not None:  # in its environment, as ZCTL_API_KEY: not on its command line
        env.pop("ZCTL_API_KEY", None)
        env.update({"ZCTL_API_KEY": api_key} if api_key else {})
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, env=env)
    url = f"{scheme(tls)}://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise ClusterError(f"zctl serve exited with {proc.returncode} (see {log_path})")
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2,  # noqa: S310
                                   context=own_server_context(url))
            break
        except urllib.error.HTTPError:
            break  # it answers (503 while a stage is down)
        except OSError:
            time.sleep(0.2)
    else:
        proc.kill()
        raise ClusterError(f"zctl serve did not answer at {url} within {timeout_s:g} s")
    return replace(record, pids=[*record.pids, proc.pid], api=url)
