"""zctl doctor, the command (zctl.doctor.checks): without a cluster, against an unreachable
coordinator or API, and against a live in-process coordinator and node."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from controlplane.client import query_status
from tests.helpers.doctor import cache_shard, closed_url, fake_export, free_port
from zctl.cli.app import app
from zctl.doctor import checks as doctor
from zctl.doctor.verdicts import FAIL, PASS, WARN
from zctl.endpoints import split_address

runner = CliRunner()


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty ZCTL_HOME, and nothing listening where the API is looked for by default."""
    monkeypatch.setenv("ZCTL_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(doctor, "DEFAULT_API", closed_url())
    return tmp_path / "home"


def test_without_a_cluster_the_local_checks_run_and_the_rest_warn(home: Path) -> None:
    manifest = fake_export(home / "exports" / "tiny-2stages")
    cache_shard(home / "node", home / "exports" / "tiny-2stages", manifest, 1)
    result = runner.invoke(app, ["doctor", "--no-lan", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["ok"] is True
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["cluster"]["status"] == "warn" and "not checked" in checks["cluster"]["detail"]
    assert checks["api"]["status"] == "warn" and "no API server" in checks["api"]["detail"]
    assert checks["versions here"]["status"] == "pass"
    assert checks["export tiny-2stages"]["status"] == "pass"
    assert checks["shard cache node"]["status"] == "pass"
    assert checks["memory"]["status"] == "pass" and "tiny-2stages" in checks["memory"]["detail"]
    assert {"device CPU", "cpu features"} <= set(checks)
    grammar = checks["structured output"]  # the fake export carries no tokenizer
    assert grammar["status"] == "warn" and "tokenizer.json" in grammar["detail"]
    assert all(c["status"] in ("pass", "warn") for c in report["checks"])
    human = runner.invoke(app, ["doctor", "--no-lan"])  # one line per check and the tally
    assert human.exit_code == 0
    lines = human.output.strip().splitlines()
    assert len(lines) == len(report["checks"]) + 1 and lines[-1].endswith("0 fail")
    assert lines[0].startswith("PASS  versions here")


def test_an_unreachable_coordinator_or_api_is_a_fail_line_and_exit_1(home: Path) -> None:
    start = time.monotonic()
    result = runner.invoke(app, ["doctor", "--no-lan", "--json", "--endpoint",
                                 f"tcp://127.0.0.1:{free_port()}", "--timeout", "0.5", "--api",
                                 closed_url()])
    assert time.monotonic() - start < 10
    assert result.exit_code == 1, result.output
    checks = {c["name"]: c for c in json.loads(result.output)["checks"]}
    assert checks["control port"]["status"] == "fail"
    assert "nothing accepts a TCP connection" in checks["control port"]["detail"]
    assert checks["api"]["status"] == "fail"  # named explicitly: nothing there is a failure
    bad = runner.invoke(app, ["doctor", "--no-lan", "--endpoint", "nonsense"])
    assert bad.exit_code == 1 and "FAIL  control port" in bad.output
    assert "Traceback" not in bad.output


@pytest.fixture
def held_ports() -> Iterator[list[socket.socket]]:
    """Two ports the test holds from its start, bound and not listening (a connection is
    refused), so no other process takes one before the test listens there."""
    held = [socket.socket() for _ in range(2)]
    try:
        for sock in held:
            sock.bind(("127.0.0.1", 0))
        yield held
    finally:
        for sock in held:
            sock.close()


def test_doctor_against_a_live_coordinator_and_node(cp_cluster, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    held_ports: list[socket.socket]) -> None:
    from controlplane import messages as m
    from tests.helpers.control import RawNode, enrol_msg, wait_for

    monkeypatch.setenv("ZCTL_HOME", str(tmp_path))  # where cp_cluster keeps both state dirs
    coord_port, agent_port = (sock.getsockname()[1] for sock in held_ports)
    coord = cp_cluster.coordinator(heartbeat_interval=0.5, data_port=coord_port)
    agent = cp_cluster.agent(coord.endpoint, data_port=agent_port)
    coord.wait_serving(20)
    stranger = RawNode(coord.endpoint, b"old-1")
    try:
        stranger.send(*m.to_frames(enrol_msg("old-1", openvino="2025.0.0")))
        assert isinstance(stranger.recv_until(m.Refuse), m.Refuse)
    finally:
        stranger.close()
    status = query_status(coord.endpoint)  # what the status reply now carries
    assert abs(status.time_s - time.time()) < 5 and status.heartbeat_interval == 0.5
    assert status.liveness == 10 and status.refused[-1].code == "openvino-version"
    assert next(n for n in status.nodes if not n.local).last_sent_s is not None

    opts = doctor.DoctorOptions(endpoint=coord.endpoint, api=closed_url(), lan=False)
    checks = {c.name: c for c in doctor.run_checks(opts)}
    for name in ("control port", "clock offset", "pipeline", "versions coordinator",
                 "versions nodes", f"heartbeats {agent.node_id}", "data pipe stage 0",
                 "shard cache n1", "memory"):
        assert name in checks, sorted(checks)
    assert all(checks[n].status == PASS for n in ("control port", "pipeline", "versions nodes",
                                                   f"heartbeats {agent.node_id}", "shard cache n1"))
    assert "one clock" in checks["clock offset"].detail
    assert checks["refused old-1"].status == FAIL
    assert "stage 0 (layers 0-1)" in checks["memory"].detail
    assert "stage 1 (layers 2-3)" in checks["memory"].detail
    # the fake stages bind no data pipes: the coordinator records them serving, yet
    # nothing accepts a connection there
    assert checks["data pipe stage 1"].status == FAIL
    assert "coordinator records serving" in checks["data pipe stage 1"].detail
    assert [split_address(a)[1] for a in (coord.data_addr, agent.data_addr)] == [
        coord_port, agent_port]
    for sock in held_ports:
        sock.listen()
    checks = {c.name: c for c in doctor.run_checks(opts)}
    for sock in held_ports:
        sock.close()
    assert checks["data pipe stage 0"].status == checks["data pipe stage 1"].status == PASS
    # a damaged cached shard fails, naming its file
    cached = tmp_path / "n1" / "shards" / coord.hashes[1] / "stage1.bin"
    data = cached.read_bytes()
    cached.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])
    agent.stop()
    wait_for(lambda: any(n.state == "left" for n in coord.status().nodes), what="left")
    checks = {c.name: c for c in doctor.run_checks(opts)}
    assert checks["shard cache n1"].status == FAIL and "stage1.bin" in checks["shard cache n1"].detail
    assert checks["pipeline"].status == FAIL and "is left" in checks["pipeline"].detail
    assert checks[f"heartbeats {agent.node_id}"].status == WARN


def test_lan_checks_read_the_interfaces_once_and_say_how_to_join_without_multicast(
        monkeypatch) -> None:
    from zctl.discovery import browser, interfaces

    reads = []
    lo = interfaces.Interface("lo", "127.0.0.1", 8)
    monkeypatch.setattr(interfaces, "local_interfaces", lambda: reads.append(1) or [lo])

    def no_socket(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise OSError("no multicast socket")

    monkeypatch.setattr(browser, "browse", no_socket)
    multicast, clusters = doctor._lan_checks(doctor.DoctorOptions(), {}, None)
    assert reads == [1]
    assert multicast.status == WARN and "no LAN interface" in multicast.detail  # lo: not LAN
    assert clusters.status == FAIL and "cannot listen for announcements: no multicast" in \
        clusters.detail and "zctl node join tcp://HOST:PORT" in clusters.detail
