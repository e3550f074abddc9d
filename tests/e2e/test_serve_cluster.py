"""zctl serve on a real local cluster (node processes on loopback): ``cluster up --api``,
greedy output through the API equal to ``zctl run``'s, ``/health`` following a node
that is killed and comes back, and the API over HTTPS."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
from typer.testing import CliRunner

from zctl.cli.app import app
from zctl.launcher.local import free_port, stop_processes
from zctl.launcher.record import read_record
from zctl.manifest import load_manifest

runner = CliRunner()
PROMPT = "what is the capital of france?"
PAGE = "http://ui.example:3000"  # a web page allowed to call the API


def wait_health(url: str, status: int, timeout_s: float = 60.0) -> dict:
    end = time.monotonic() + timeout_s
    while True:
        try:
            resp = httpx.get(f"{url}/health", timeout=5)
            if resp.status_code == status:
                return resp.json()
        except httpx.HTTPError:
            pass
        assert time.monotonic() < end, f"/health never answered {status}"
        time.sleep(0.2)


def test_api_on_a_local_cluster_equals_zctl_run_and_health_follows_a_node(
        tiny_exports, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZCTL_HOME", str(tmp_path / "home"))
    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    model = load_manifest(export_dir).model.name
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    # --no-heal: the pipeline stays down until the node is back (with healing the
    # coordinator would take stage 1 within seconds, and /health would follow that instead)
    up = runner.invoke(app, ["cluster", "up", "--local", "2", "--model", str(export_dir),
                             "--heartbeat", "0.3", "--no-heal", "--api", f"127.0.0.1:{port}",
                             "--api-cors-origin", PAGE])
    restarted: subprocess.Popen | None = None
    try:
        assert up.exit_code == 0, up.output
        assert f"{url}/v1" in up.output
        record = read_record()
        assert record is not None and record.api == url and len(record.pids) == 3
        run = runner.invoke(app, ["run", PROMPT, "--max-tokens", "12", "--ignore-eos",
                                  "--temperature", "0", "--json"])
        assert run.exit_code == 0, run.output
        report = json.loads(run.stdout.strip().splitlines()[-1])
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=12,
            temperature=0, extra_body={"zctl": {"ignore_eos": True}})
        assert reply.choices[0].message.content == report["text"]
        assert reply.usage.completion_tokens == report["tokens"] == 12
        # the next turn of a chat starts with its first prompt's KV: a prefix-cache hit on
        # every stage (the first turn's prompt, up to two tokens before its end)
        turn = [{"role": "user", "content": PROMPT * 8}]
        first = client.chat.completions.create(model=model, max_tokens=4, messages=turn)
        client.chat.completions.create(
            model=model, max_tokens=4, messages=[
                *turn, {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "and then?"}])
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        hits = [line for line in metrics.splitlines()
                if line.startswith("vllm:prefix_cache_hits_total{")]
        assert hits and float(hits[0].split()[-1]) >= 1, metrics
        assert wait_health(url, 200)["status"] == "ok"
        for origin, allowed in ((PAGE, PAGE), ("http://elsewhere.example", None)):
            answer = httpx.get(f"{url}/v1/models", headers={"Origin": origin}, timeout=10)
            assert answer.headers.get("access-control-allow-origin") == allowed
        doctor = runner.invoke(app, ["doctor", "--no-lan", "--json"])
        api = [c for c in json.loads(doctor.stdout)["checks"] if c["name"] == "api"]
        assert api and api[0]["status"] == "pass" and url in api[0]["detail"], doctor.stdout
        # the node of stage 1 dies: /health says so, requests get 503, it comes back
        node_pid = record.pids[1]
        command = Path(f"/proc/{node_pid}/cmdline").read_bytes().split(b"\0")[:-1]
        os.kill(node_pid, signal.SIGKILL)
        down = wait_health(url, 503)
        assert down["status"] == "down" and down["reason"], down
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model=model, messages=[{"role": "user",
                                                                   "content": "hi"}])
        restarted = subprocess.Popen([c.decode() for c in command], start_new_session=True,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert wait_health(url, 200, 120)["status"] == "ok"
        again = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=12,
            temperature=0, extra_body={"zctl": {"ignore_eos": True}})
        assert again.choices[0].message.content == report["text"]
    finally:
        runner.invoke(app, ["cluster", "down"])
        if restarted is not None:
            stop_processes([restarted.pid])
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=2)  # cluster down stopped the API server too


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP],
                         ids=["Ctrl-C", "SIGTERM", "SIGHUP"])
def test_an_interrupted_zctl_run_cancels_its_generation_on_the_cluster(
        signum: int, tiny_exports, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Interrupted 1 s into a long generation (Ctrl-C, or SIGTERM and SIGHUP alike),
    ``zctl run`` cancels it and exits with 128 + the signal: the cluster stops generating
    at once and no stage keeps its KV."""
    import sys

    from zctl.service.client import query_service_stats

    monkeypatch.setenv("ZCTL_HOME", str(tmp_path / "home"))
    export_dir = tiny_exports.get([(0, 2), (2, 4)])
    # 20 ms each way on every hop: 480 tokens would take over 20 s
    up = runner.invoke(app, ["cluster", "up", "--local", "2", "--model", str(export_dir),
                             "--link-delay-ms", "20"])
    try:
        assert up.exit_code == 0, up.output
        record = read_record()
        # the signal as a terminal gives it, even where this test runs with it ignored (a
        # background job of a shell without job control, nohup): zctl then keeps ignoring it
        run = subprocess.Popen([sys.executable, "-m", "zctl", "run", PROMPT, "--max-tokens",
                                "480", "--ignore-eos", "--json"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL,
                               preexec_fn=lambda: signal.signal(signum, signal.SIG_DFL))
        end = time.monotonic() + 60
        while query_service_stats(record.serve).running == 0:
            assert time.monotonic() < end and run.poll() is None
            time.sleep(0.1)
        time.sleep(1.0)
        run.send_signal(signum)
        assert run.wait(30) == 128 + signum
        end = time.monotonic() + 10
        while (stats := query_service_stats(record.serve)).running:
            assert time.monotonic() < end, "the generation kept running after the signal"
            time.sleep(0.05)
        assert stats.counters["cancelled"] == 1
        assert stats.counters["unreachable"] == 0  # zctl run said so: not found gone later
        end = time.monotonic() + 10  # the node's slots arrive with its next heartbeat
        while any(s.kv_slots != 0 for s in query_service_stats(record.serve).stages):
            assert time.monotonic() < end, query_service_stats(record.serve).stages
            time.sleep(0.2)
    finally:
        runner.invoke(app, ["cluster", "down"])


# -- over HTTPS ------------------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
def test_cluster_api_over_https(tiny_exports, tmp_path: Path, monkeypatch) -> None:
    from dataplane.runtime.config import RuntimeSpec
    from tests.helpers.tls import self_signed
    from zctl.doctor.verdicts import PASS
    from zctl.launcher.api import start_api
    from zctl.launcher.local import start_local_cluster, wait_serving
    from zctl.launcher.record import write_record
    from zctl.serve.tls import api_tls

    monkeypatch.setenv("ZCTL_HOME", str(tmp_path / "home"))  # where zctl serve finds it
    cert, key = self_signed(tmp_path)
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
        checks = json.loads(runner.invoke(app, ["doctor", "--no-lan", "--json"]).stdout)["checks"]
        (api,) = [c for c in checks if c["name"] == "api"]
        assert api["status"] == PASS and record.api in api["detail"], api
    finally:
        stop_processes(record.pids)
