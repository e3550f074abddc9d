"""TLS for the HTTP API (``zctl serve --ssl-certfile/--ssl-keyfile``, ``cluster up
--api-ssl-certfile/--api-ssl-keyfile``): the certificate and key checked before anything
starts, the arguments that hand them to ``zctl serve``, and the context our own liveness
wait uses to reach it."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import NamedTuple


class ApiTls(NamedTuple):
    """A PEM certificate (chain) and its private key."""

    certfile: str
    keyfile: str

    def serve_args(self) -> list[str]:
        """``zctl serve``'s options for these files."""
        return ["--ssl-certfile", self.certfile, "--ssl-keyfile", self.keyfile]


def api_tls(certfile: Path | str | None, keyfile: Path | str | None,
            options: str = "--ssl-certfile and --ssl-keyfile") -> ApiTls | None:
    """The API's TLS files (None: plain HTTP), checked: both given, readable, and a key
    that matches its certificate. Raises ValueError with the reason."""
    if certfile is None and keyfile is None:
        return None
    if certfile is None or keyfile is None:
        raise ValueError(f"{options} go together")
    for path in (certfile, keyfile):
        if not Path(path).is_file():
            raise ValueError(f"no such file: {path}")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(str(certfile), str(keyfile))
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"{certfile} and {keyfile} are not a PEM certificate and its key "
                         f"({exc.strerror or exc})") from None
    return ApiTls(str(Path(certfile).resolve()), str(Path(keyfile).resolve()))


def scheme(tls: ApiTls | None) -> str:
    return "https" if tls is not None else "http"


def own_server_context(url: str) -> ssl.SSLContext | None:
    """For waiting on an API server this process started: its certificate may be one
    this machine does not trust (self-signed), and only whether it answers matters."""
    if not url.startswith("https://"):
        return None
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context
