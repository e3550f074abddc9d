"""The coordinator killed and started again with the same state dir: the clients of the
dead one (over the service's socket and over the OpenAI API) are told within seconds that
their generations are lost, never left hanging; the nodes, which keep their processes and
cached shards, enrol again by themselves, and the cluster serves again, through the same
API process, with the tokens of a run nothing happened to. Real processes on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_fault_tolerance import EXACT, TOKENS, _fault_free
from zctl.engine.requests import GenerationChunk, GenerationDone, GenerationRequest
from zctl.engine.tokenizer import ChatTokenizer
from zctl.launcher.api import start_api
from zctl.launcher.local import free_port, start_local_cluster, stop_processes, wait_serving
from zctl.launcher.record import alive, write_record
from zctl.service.client import generate_many
from zctl.service.errors import ServiceUnavailable

DELAY_MS = 15  # per hop: the generations are still running when the coordinator dies


def _command_of(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").decode().split("\0")


def _service_client(record, request: GenerationRequest, outcome: list,  # noqa: ANN001
                    generating: threading.Event) -> None:
    try:
        for msg in generate_many(record.serve, [request]):
            if isinstance(msg, GenerationChunk) and msg.tokens:
                generating.set()
            outcome.append(msg)
    except ServiceUnavailable as exc:
        outcome.append(exc)


def _completion(api: str, **more: object) -> dict:
    model = httpx.get(f"{api}/v1/models", timeout=10).json()["data"][0]["id"]
    return {"model": model, "prompt": "the sky is", "max_tokens": TOKENS, "temperature": 0,
            "zctl": {"ignore_eos": True}, **more}


def _api_client(api: str, outcome: list, generating: threading.Event) -> None:
    body = _completion(api, stream=True)
    with httpx.stream("POST", f"{api}/v1/completions", json=body, timeout=120) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: "):
                outcome.append(line.removeprefix("data: "))
                generating.set()


def test_a_restarted_coordinator_gets_its_nodes_back_and_serves_the_same_tokens(
        tiny_exports, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZCTL_HOME", str(tmp_path / "home"))  # where zctl serve finds it
    export_dir = tiny_exports.get([(0, 1), (1, 3), (3, 4)])
    request = GenerationRequest(uuid.uuid4().hex[:16], "the sky is", TOKENS, ignore_eos=True,
                                temperature=0.0)
    expected = _fault_free(export_dir, [request])[0]
    root = tmp_path / "cluster"
    record = start_local_cluster(export_dir, 3, EXACT, root, link_delay_ms=DELAY_MS)
    try:
        wait_serving(record, 120)
        write_record(record)
        record = start_api(record, f"127.0.0.1:{free_port('127.0.0.1')}")
        write_record(record)
        command, survivors = _command_of(record.pids[0]), record.pids[1:]
        served, api_said = [], []
        events = [threading.Event(), threading.Event()]
        clients = [threading.Thread(target=_service_client, daemon=True,
                                    args=(record, request, served, events[0])),
                   threading.Thread(target=_api_client, daemon=True,
                                    args=(record.api, api_said, events[1]))]
        for client in clients:
            client.start()
        assert all(e.wait(60) for e in events)
        killed = time.monotonic()
        os.killpg(record.pids[0], signal.SIGKILL)
        for client in clients:
            client.join(20)
        told_s = time.monotonic() - killed
        assert not any(c.is_alive() for c in clients), "a client of a dead coordinator hung"
        assert told_s < 10, told_s
        assert isinstance(served[-1], ServiceUnavailable) and "lost" in str(served[-1])
        assert api_said[-1] == "[DONE]"
        error = json.loads(api_said[-2])["error"]
        assert error["type"] == "service_unavailable" and "lost" in error["message"], error
        assert httpx.get(f"{record.api}/health", timeout=10).status_code == 503
        assert all(alive(pid) for pid in survivors)  # the nodes outlive their coordinator

        with open(root / "logs" / "coordinator-again.log", "ab") as log:  # same state dir
            record.pids[0] = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}).pid
        status = wait_serving(record, 90)
        assert [s.index for s in status.stages] == [0, 1, 2]
        again = GenerationRequest(uuid.uuid4().hex[:16], "the sky is", TOKENS, ignore_eos=True,
                                  temperature=0.0)
        (done,) = [m for m in generate_many(record.serve, [again])
                   if isinstance(m, GenerationDone)]
        assert done.error == "" and done.tokens == expected
        chat = _completion(record.api, messages=[{"role": "user", "content": "the sky is"}])
        del chat["prompt"]
        reply = httpx.post(f"{record.api}/v1/chat/completions", timeout=60, json=chat)
        assert reply.status_code == 200, reply.text  # the same API process, reconnected
        text = ChatTokenizer(export_dir).decode(expected)
        assert reply.json()["choices"][0]["message"]["content"] == text
        assert all(alive(pid) for pid in survivors)  # served by the same node processes
    finally:
        stop_processes(record.pids)


def test_a_record_whose_coordinator_exited_is_cleared_with_the_processes_it_started(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """cluster up (run, serve) after the coordinator died: its local node is stopped, so
    the next cluster starts afresh; a pid that some other program holds by now is left."""
    import sys

    from zctl.cli.cluster import _running_record
    from zctl.launcher.local import _spawn
    from zctl.launcher.processes import NodeProcess
    from zctl.launcher.record import ClusterRecord, cluster_file

    monkeypatch.setenv("ZCTL_HOME", str(tmp_path / "home"))
    dead = subprocess.Popen(["true"])
    dead.wait()
    node = _spawn(NodeProcess(f"tcp://127.0.0.1:{free_port('127.0.0.1')}",
                              state_dir=str(tmp_path / "node")), tmp_path / "node.log")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             start_new_session=True)
    try:
        write_record(ClusterRecord("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "x",
                                   [dead.pid, node, other.pid]))
        assert alive(node) and alive(other.pid)
        assert _running_record() is None
        assert not cluster_file().exists() and not alive(node)
        assert other.poll() is None  # not zctl's: never signalled
    finally:
        other.kill()
        stop_processes([node])
