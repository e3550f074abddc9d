"""HTTPS for the API (zctl.serve.tls): the certificate and key are checked before anything
starts, `zctl serve` and `cluster up --api` refuse bad TLS options at once, and `zctl
doctor` tells a certificate this machine trusts from one it does not. (A cluster's API
served over TLS: tests/e2e/test_serve_cluster.py.)"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI
from typer.testing import CliRunner

from tests.helpers.tls import self_signed
from zctl.cli.app import app
from zctl.doctor import probes
from zctl.doctor.verdicts import PASS, WARN, api_check
from zctl.launcher.local import free_port
from zctl.serve.tls import ApiTls, api_tls

runner = CliRunner()
pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    return self_signed(tmp_path_factory.mktemp("tls"))


def test_the_files_are_checked_before_anything_starts(pair, tmp_path: Path) -> None:
    cert, key = pair
    assert api_tls(None, None) is None
    assert api_tls(cert, key) == ApiTls(str(cert.resolve()), str(key.resolve()))
    with pytest.raises(ValueError, match="go together"):
        api_tls(cert, None)
    with pytest.raises(ValueError, match="no such file"):
        api_tls(cert, tmp_path / "missing.key")
    _, other_key = self_signed(tmp_path, "other")
    with pytest.raises(ValueError, match="not a PEM certificate and its key"):
        api_tls(cert, other_key)  # a key that is not the certificate's
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    with pytest.raises(ValueError, match="not a PEM certificate"):
        api_tls(junk, key)
    assert ApiTls("c", "k").serve_args() == ["--ssl-certfile", "c", "--ssl-keyfile", "k"]


def test_the_commands_refuse_bad_tls_options_at_once(pair, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("ZCTL_HOME", str(tmp_path / "home"))
    cert, key = pair
    served = runner.invoke(app, ["serve", "--ssl-certfile", str(cert)])
    assert served.exit_code == 1 and "go together" in served.output
    up = runner.invoke(app, ["cluster", "up", "--local", "2", "--api-ssl-certfile", str(cert),
                             "--api-ssl-keyfile", str(key)])
    assert up.exit_code == 1 and "needs --api" in up.output
    up = runner.invoke(app, ["cluster", "up", "--local", "2", "--api", "127.0.0.1:1",
                             "--api-ssl-certfile", str(cert), "--api-ssl-keyfile", str(cert)])
    assert up.exit_code == 1 and "not a PEM certificate" in up.output
    assert not (tmp_path / "home").exists() or not any((tmp_path / "home").rglob("*.xml"))


def test_doctor_tells_a_trusted_certificate_from_one_that_is_not(pair, monkeypatch) -> None:
    cert, key = pair
    health = FastAPI()
    health.get("/health")(lambda: {"status": "ok"})
    port = free_port("127.0.0.1")
    server = uvicorn.Server(uvicorn.Config(health, host="127.0.0.1", port=port,
                                           log_level="warning", ssl_certfile=str(cert),
                                           ssl_keyfile=str(key)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        url = f"https://127.0.0.1:{port}"
        monkeypatch.delenv("SSL_CERT_FILE", raising=False)
        facts = probes.http_health(url)
        assert facts.status == 200 and facts.untrusted and "self" in facts.error.lower()
        check = api_check(url, facts, explicit=True)
        assert check.status == WARN and "not trusted here" in check.detail
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # as a client that trusts it
        facts = probes.http_health(url)
        assert facts.status == 200 and not facts.untrusted
        assert api_check(url, facts, explicit=True).status == PASS
        plain = probes.http_health(f"http://127.0.0.1:{port}")  # TLS only
        assert plain.status is None and plain.error
    finally:
        server.should_exit = True
        thread.join(10)
