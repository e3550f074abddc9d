"""LAN discovery between network namespaces: a bridge and a veth per namespace, made here
as root (names ``zdsc*``, subnet 10.219.55.0/24, removed afterwards, also after a crash).
A coordinator announces the cluster ``lab``; two nodes started with no address find it
and the cluster serves; a second cluster beside it makes a node without ``--cluster``
refuse to guess, forged and other-protocol announcements are refused and the joiner goes
on; the coordinator restarted on another address gets its nodes back; where multicast is
dropped (nftables) ``zctl doctor`` says so and names ``node join ADDR``."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest

from tests.e2e.test_fault_tolerance import EXACT
from zctl.launcher.processes import CoordinatorProcess

SUBNET = "10.219.55"
PREFIX = "zdsc"
BRIDGE = f"{PREFIX}br"
SPACES = {"c": 10, "1": 11, "2": 12, "x": 13, "m": 14}  # namespace suffix -> host number
MOVED = 20  # the coordinator's second address, where it restarts
TOKENS = 8

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="network namespaces need root and iproute2")


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def ns(name: str) -> str:
    return f"{PREFIX}{name}"


def addr(name: str) -> str:
    return f"{SUBNET}.{SPACES[name]}"


def lan_down() -> None:
    for name in SPACES:
        _ip("netns", "del", ns(name), check=False)
        _ip("link", "del", f"{PREFIX}v{name}", check=False)
    _ip("link", "del", BRIDGE, check=False)


def lan_up() -> None:
    lan_down()
    _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    for name in SPACES:
        space, veth = ns(name), f"{PREFIX}v{name}"
        _ip("netns", "add", space)
        _ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
        _ip("link", "set", f"{veth}p", "netns", space)
        _ip("link", "set", veth, "master", BRIDGE)
        _ip("link", "set", veth, "up")
        for args in (("link", "set", "lo", "up"), ("link", "set", f"{veth}p", "name", "eth0"),
                     ("addr", "add", f"{addr(name)}/24", "dev", "eth0"),
                     ("link", "set", "eth0", "up")):
            _ip("netns", "exec", space, "ip", *args)
    _ip("netns", "exec", ns("c"), "ip", "addr", "add", f"{SUBNET}.{MOVED}/24", "dev", "eth0")


class Lan:
    """Processes in the namespaces; every one is stopped at the end."""

    def __init__(self, root: Path, export_dir: Path) -> None:
        self.root, self.export_dir = root, export_dir
        self.procs: list[subprocess.Popen] = []
        self.logs: dict[int, Path] = {}

    def env(self, home: Path) -> dict[str, str]:
        return {**os.environ, "ZCTL_HOME": str(home), "PYTHONUNBUFFERED": "1",
                "COLUMNS": "200"}

    def start(self, space: str, args: list[str], home: str) -> subprocess.Popen:
        log = self.root / f"{home}-{len(self.procs)}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", ns(space), sys.executable, *args],
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env=self.env(self.root / home), start_new_session=True)
        self.procs.append(proc)
        self.logs[proc.pid] = log
        return proc

    def run(self, space: str, args: list[str], home: str, timeout: float = 60
            ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", ns(space), sys.executable, "-m", "zctl",
                               *args], capture_output=True, text=True, timeout=timeout,
                              env=self.env(self.root / home), stdin=subprocess.DEVNULL)

    def coordinator(self, space: str, host: str, name: str, home: str, **more: object
                    ) -> subprocess.Popen:
        config = CoordinatorProcess(
            str(self.export_dir), bind=f"tcp://{host}:5550", serve=f"tcp://{host}:5551",
            state_dir=str(self.root / home / "coordinator"), runtime=EXACT, profile=False,
            announce=True, cluster_name=name, **more)  # type: ignore[arg-type]
        return self.start(space, ["-m", "zctl.launcher", "coordinator",
                                  json.dumps(asdict(config))], home)

    def node(self, space: str, home: str, *args: str) -> subprocess.Popen:
        return self.start(space, ["-m", "zctl", "node", "join", "--no-profile",
                                  "--reconnect-max", "4", *args], home)

    def log(self, proc: subprocess.Popen) -> str:
        return self.logs[proc.pid].read_text(errors="replace")

    def stop(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)

    def close(self) -> None:
        for proc in reversed(self.procs):
            self.stop(proc)


@pytest.fixture(scope="module")
def lan(tiny_exports, tmp_path_factory) -> Iterator[Lan]:
    export_dir = tiny_exports.get([(0, 1), (1, 3), (3, 4)])
    lan_up()
    net = Lan(tmp_path_factory.mktemp("discovery"), export_dir)
    try:
        yield net
    finally:
        net.close()
        lan_down()


def serving(control: str, timeout: float, nodes: int):  # noqa: ANN201 - a ClusterStatus
    from controlplane.client import ClusterUnreachable, query_status

    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            last = query_status(control, timeout=1.0)
        except ClusterUnreachable:
            time.sleep(0.3)
            continue
        joined = [n for n in last.nodes if n.state == "serving" and n.node_id != last.coordinator_id]
        if last.pipeline == "serving" and len(joined) >= nodes:
            return last
        time.sleep(0.3)
    raise AssertionError(f"{control} not serving with {nodes} nodes: {last}")


def tokens_from(serve: str) -> list[int]:
    from zctl.engine.requests import GenerationDone, GenerationRequest
    from zctl.service.client import generate_many

    request = GenerationRequest(uuid.uuid4().hex[:16], "the sky is", TOKENS, ignore_eos=True,
                                temperature=0.0)
    (done,) = [m for m in generate_many(serve, [request]) if isinstance(m, GenerationDone)]
    assert done.error == ""
    return done.tokens


@pytest.fixture(scope="module")
def lab(lan: Lan):
    """The cluster ``lab``: a coordinator in one namespace, a node in each of two more,
    started with no address."""
    coordinator = lan.coordinator("c", addr("c"), "lab", "coord")
    nodes = [lan.node("1", "node1"), lan.node("2", "node2")]
    status = serving(f"tcp://{addr('c')}:5550", 120, 2)
    return coordinator, nodes, status


def test_nodes_with_no_address_find_the_cluster_and_it_serves(lan: Lan, lab) -> None:
    coordinator, nodes, status = lab
    assert [s.index for s in status.stages] == [0, 1, 2]
    assert {n.host for n in status.nodes} == {addr("c"), addr("1"), addr("2")}
    assert "announced cluster lab at tcp://10.219.55.10:5550 on eth0 10.219.55.10" in lan.log(
        coordinator)
    for node in nodes:
        assert "found lab at tcp://10.219.55.10:5550 (protocol" in lan.log(node)
    assert len(tokens_from(f"tcp://{addr('c')}:5551")) == TOKENS
