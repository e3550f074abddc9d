"""HTTPS for the API (zctl.serve.tls): the certificate and key are checked before anything
starts, `zctl serve` and `cluster up --api` serve over TLS, and `zctl doctor` tells a
certificate this machine trusts from one it does not."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI
from typer.testing import CliRunner

from dataplane.runtime.config import RuntimeSpec
from zctl.cli.app import app
from zctl.doctor import probes
from zctl.doctor.verdicts import PASS, WARN, api_check
from zctl.launcher.local import (
    free_port,
    start_api,
    start_local_cluster,
    stop_processes,
    wait_serving,
    write_record,
)
from zctl.manifest import load_manifest
from zctl.serve.tls import ApiTls, api_tls

runner = CliRunner()
pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def self_signed(directory: Path, name: str = "api") -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 signed by its own key."""
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key


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


@pytest.mark.slow
def test_cluster_api_over_https(tiny_exports, pair, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("ZCTL_HOME", str(tmp_path / "home"))  # where zctl serve finds it
    cert, key = pair
    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    model = load_manifest(export_dir).model.name
    record = start_local_cluster(export_dir, 2, RuntimeSpec(precision="f32"), tmp_path / "c")
    try:
        wait_serving(record, 120)
        write_record(record)
        port = free_port("127.0.0.1")
        record = start_api(record, f"127.0.0.1:{port}", tls=api_tls(cert, key))
        write_record(record)
        assert record.api == f"https://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{record.api}/v1", api_key="x", max_retries=0,
                               http_client=httpx.Client(verify=str(cert), timeout=60))
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert reply.usage.completion_tokens >= 1
        with pytest.raises(httpx.HTTPError):  # the certificate is checked by default
            httpx.get(f"{record.api}/health", timeout=10)
        with pytest.raises(httpx.HTTPError):  # and there is no plain HTTP
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        checks = json.loads(runner.invoke(app, ["doctor", "--json"]).stdout)["checks"]
        (api,) = [c for c in checks if c["name"] == "api"]
        assert api["status"] == PASS and record.api in api["detail"], api
    finally:
        stop_processes(record.pids)
