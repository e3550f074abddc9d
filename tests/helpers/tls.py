"""Self-signed certificates for the API's HTTPS (needs the openssl command)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def self_signed(directory: Path, name: str = "api") -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 signed by its own key."""
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key
