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
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import pytest

from tests.e2e.test_fault_tolerance import EXACT
from tests.helpers.tools import missing_tool
from tools.robustness.chaos_net import Namespaces
from zctl.launcher.processes import CoordinatorProcess

SUBNET = "10.219.55"  # this module's own /24 (the chaos harness uses 10.213.7)
PREFIX = "zdsc"
NODES = {"c": 1, "1": 2, "2": 3, "x": 4, "m": 5}  # namespace -> the harness's node number
MOVED = 20  # the coordinator's second address, where it restarts
TOKENS = 8
NET = Namespaces(len(NODES) + 1, prefix=PREFIX, subnet=SUBNET)  # node 0: the host's bridge

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="network namespaces need root and iproute2")


def inside(name: str, argv: list[str]) -> list[str]:
    """``argv`` run in the namespace ``name``."""
    return NET.command(NODES[name], argv)


def addr(name: str) -> str:
    return NET.host(NODES[name])


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
            proc = subprocess.Popen(inside(space, [sys.executable, *args]),
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env=self.env(self.root / home), start_new_session=True)
        self.procs.append(proc)
        self.logs[proc.pid] = log
        return proc

    def run(self, space: str, args: list[str], home: str, timeout: float = 60
            ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(inside(space, [sys.executable, "-m", "zctl", *args]),
                              capture_output=True, text=True, timeout=timeout,
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
    """A bridge on the host and a namespace per machine (the chaos harness's), the
    coordinator's with a second address; everything removed afterwards."""
    export_dir = tiny_exports.get([(0, 1), (1, 3), (3, 4)])
    NET.up()
    net = Lan(tmp_path_factory.mktemp("discovery"), export_dir)
    try:
        subprocess.run(inside("c", ["ip", "addr", "add", f"{SUBNET}.{MOVED}/24", "dev", "eth0"]),
                       check=True, capture_output=True)
        yield net
    finally:
        net.close()
        NET.down()


def serving(control: str, timeout: float, nodes: int, curve=None):  # noqa: ANN001, ANN201
    """The status of the cluster at ``control`` once it serves with ``nodes`` nodes."""
    from controlplane.client import ClusterUnreachable, query_status

    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            last = query_status(control, timeout=1.0, curve=curve)
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
    control = f"tcp://{addr('c')}:5550"
    assert f"announced cluster lab at {control} on eth0 {addr('c')}" in lan.log(coordinator)
    for node in nodes:
        assert f"found lab at {control} (protocol" in lan.log(node)
    assert len(tokens_from(f"tcp://{addr('c')}:5551")) == TOKENS


@pytest.fixture(scope="module")
def forger():
    """Forged, other-protocol and malformed announcements, sent from the bridge's address."""
    from zeroconf import IPVersion, ServiceInfo, Zeroconf

    from controlplane.messages import PROTOCOL_VERSION
    from zctl.discovery.records import SERVICE_TYPE, Announcement, announcement_txt

    def info(name: str, txt: dict[str, str]) -> ServiceInfo:
        return ServiceInfo(SERVICE_TYPE, f"{name}.{SERVICE_TYPE}", port=5550, properties=txt,
                           addresses=[socket.inet_aton(f"{SUBNET}.1")], server=f"{name}.local.")

    zeroconf = Zeroconf(interfaces=[f"{SUBNET}.1"], ip_version=IPVersion.V4Only)
    infos = [info("forged-lab", announcement_txt(Announcement(  # lab's name and address
                 "lab", f"tcp://{addr('c')}:5550", PROTOCOL_VERSION, "2026.4.1", "evil"))),
             info("old", announcement_txt(Announcement(
                 "old", f"tcp://{SUBNET}.1:5550", PROTOCOL_VERSION - 1, "2026.4.1", "pc-old"))),
             info("junk", {"fmt": "1", "cluster": "\x00" * 3, "control": "tcp://x:y"})]
    try:
        with ThreadPoolExecutor(len(infos)) as pool:
            list(pool.map(zeroconf.register_service, infos))
        yield
    finally:
        zeroconf.close()


@pytest.fixture(scope="module")
def vault(lan: Lan, lab, forger):
    """A second cluster, ``vault``, with CURVE on, in its own namespace; it waits for one
    node (which only pairing can admit). cluster.json in its home, as cluster up writes."""
    from zctl.launcher.record import ClusterRecord

    home = lan.root / "vault"
    proc = lan.coordinator("x", addr("x"), "vault", "vault", curve=True, expect_nodes=1)
    record = ClusterRecord(control=f"tcp://{addr('x')}:5550", serve=f"tcp://{addr('x')}:5551",
                           export_dir=str(lan.export_dir), pids=[proc.pid],
                           curve_dir=str(home / "coordinator"))
    home.mkdir(parents=True, exist_ok=True)
    (home / "cluster.json").write_text(json.dumps(asdict(record)))
    deadline = time.monotonic() + 60
    while "announced cluster vault" not in lan.log(proc):
        assert time.monotonic() < deadline and proc.poll() is None, lan.log(proc)
        time.sleep(0.3)
    return record


def test_two_clusters_a_node_joins_the_one_named_and_refuses_to_guess(lan: Lan, vault) -> None:
    listed = lan.run("1", ["cluster", "ls"], "ls")
    assert listed.returncode == 0, listed.stderr
    assert "lab" in listed.stdout and "vault" in listed.stdout
    assert f"tcp://{addr('x')}:5550" in listed.stdout
    assert "refused old" in listed.stdout and "speaks control protocol" in listed.stdout
    assert "refused forged-lab" in listed.stdout and "forged" in listed.stdout
    guess = lan.run("2", ["node", "join", "--no-profile"], "guess")
    assert guess.returncode == 1
    assert "2 clusters are announced; name one with --cluster NAME" in guess.stderr
    assert f"lab at tcp://{addr('c')}:5550" in guess.stderr and "vault at " in guess.stderr
    assert "Traceback" not in guess.stderr
    # the CURVE cluster, named, without pairing or a key: refused before anything is sent
    keyless = lan.run("2", ["node", "join", "--no-profile", "--cluster", "vault"], "keyless")
    assert keyless.returncode == 1 and "CURVE-secured" in keyless.stderr
    assert "zctl node join --pair CODE" in keyless.stderr


def pair_code(proc: subprocess.Popen, timeout: float = 30) -> str:
    """The code ``zctl cluster pair`` prints first."""
    import select

    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if line.startswith("pairing code: "):
                return line.split()[2]
        assert proc.poll() is None, proc.stdout.read()
    raise AssertionError("no pairing code printed")


def desk(lan: Lan, vault) -> subprocess.Popen:  # noqa: ANN001
    proc = subprocess.Popen(inside("x", [sys.executable, "-m", "zctl", "cluster", "pair",
                                         "--minutes", "2"]), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=lan.env(lan.root / "vault"),
                            start_new_session=True, stdin=subprocess.DEVNULL)
    lan.procs.append(proc)
    return proc


def test_pairing_admits_a_node_once_and_refuses_wrong_codes(lan: Lan, vault) -> None:
    from controlplane.client import query_status
    from controlplane.pairing import PairingError, pair
    from zctl.launcher.record import control_curve

    outsider = b"rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"  # a valid Z85 key of no one
    first = desk(lan, vault)
    code = pair_code(first)
    wrong = f"{(int(code[:4]) + 1) % 10000:04d}-{code[5:]}"
    refused = lan.run("2", ["node", "join", "--no-profile", "--cluster", "vault", "--pair", wrong],
                      "wrong")
    assert refused.returncode == 1, refused.stderr
    assert "pairing failed: the pairing code is wrong" in refused.stderr
    assert not (lan.root / "wrong" / "node" / "curve" / "coordinator.key").exists()
    pairing = f"tcp://{addr('x')}:5549"
    with pytest.raises(PairingError, match="rate-limited after wrong codes"):
        pair(pairing, code, outsider)  # even the right code, within the cooldown
    with pytest.raises(PairingError, match="rate-limited after wrong codes"):
        pair(pairing, wrong, outsider)
    time.sleep(1.2)  # the first cooldown is 1 s
    node = lan.node("2", "paired", "--cluster", "vault", "--pair", code)
    assert first.wait(30) == 0
    said = first.stdout.read()  # type: ignore[union-attr]
    assert "paired node " in said and "is admitted" in said
    status = serving(vault.control, 90, 1, curve=control_curve(vault))
    assert status.curve  # the control and the data pipes: CURVE
    paired = [n for n in status.nodes if n.host == addr("2")]
    assert paired and paired[0].state == "serving"
    fingerprint = said.split("its key ")[1].split()[0]
    deadline = time.monotonic() + 10
    while "paired: the coordinator's key is" not in lan.log(node) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert f"this node's is {fingerprint}" in lan.log(node)
    assert len(tokens_from(vault.serve)) == TOKENS  # through the node's encrypted pipes
    # the code is spent: a new desk's code is another, and the old one is refused there
    second = desk(lan, vault)
    assert pair_code(second) != code
    with pytest.raises(PairingError, match=r"the pairing code is wrong \(or spent\)"):
        pair(pairing, code, outsider)
    lan.stop(second)
    # a node with the coordinator's key but never admitted gets nothing
    server_key = Path(vault.curve_dir) / "curve" / "coordinator.key"
    stranger = lan.node("1", "stranger", "--cluster", "vault", "--curve-server-key",
                        str(server_key))
    deadline = time.monotonic() + 20
    while "joining tcp://" not in lan.log(stranger):
        assert time.monotonic() < deadline and stranger.poll() is None, lan.log(stranger)
        time.sleep(0.2)
    time.sleep(3)  # a few heartbeats' worth of tries
    status = query_status(vault.control, timeout=2.0, curve=control_curve(vault))
    assert addr("1") not in {n.host for n in status.nodes}
    assert "enrolled" not in lan.log(stranger) and stranger.poll() is None
    lan.stop(stranger)
    assert node.poll() is None


def test_the_coordinator_moves_and_its_nodes_follow(lan: Lan, lab) -> None:
    coordinator, nodes, _ = lab
    before = tokens_from(f"tcp://{addr('c')}:5551")
    lan.stop(coordinator)
    moved = f"{SUBNET}.{MOVED}"
    lan.coordinator("c", moved, "lab", "coord")  # the same state dir, another address
    status = serving(f"tcp://{moved}:5550", 120, 2)
    assert {n.host for n in status.nodes} == {moved, addr("1"), addr("2")}
    assert all(n.poll() is None for n in nodes)  # the same node processes
    assert tokens_from(f"tcp://{moved}:5551") == before
    for node in nodes:
        assert f"the coordinator moved from tcp://{addr('c')}:5550 to tcp://{moved}:5550" in \
            lan.log(node)


def test_where_multicast_is_dropped_doctor_says_so_and_names_the_fallback(lan: Lan, vault
                                                                         ) -> None:
    if shutil.which("nft") is None:
        missing_tool("nftables (nft)")
    doctor = lan.run("m", ["doctor", "--json"], "open", timeout=120)  # before the rule
    checks = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
    assert checks["LAN multicast"]["status"] == "pass", checks["LAN multicast"]
    assert "lab (tcp://" in checks["LAN clusters"]["detail"]
    assert "vault (tcp://" in checks["LAN clusters"]["detail"]
    assert checks["announced lab"]["status"] == checks["announced vault"]["status"] == "pass"
    assert checks["cluster names"]["status"] == checks["node id"]["status"] == "pass"
    rules = ("add table ip zdsc\n"
             "add chain ip zdsc out { type filter hook output priority 0 ; }\n"
             "add chain ip zdsc in { type filter hook input priority 0 ; }\n"
             "add rule ip zdsc out ip daddr 224.0.0.0/4 drop\n"
             "add rule ip zdsc in ip daddr 224.0.0.0/4 drop\n")
    subprocess.run(inside("m", ["nft", "-f", "-"]), input=rules, text=True, check=True,
                   capture_output=True)
    doctor = lan.run("m", ["doctor", "--json"], "blocked", timeout=120)
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    checks = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
    multicast = checks["LAN multicast"]
    assert multicast["status"] == "fail", multicast
    assert f"eth0 {addr('m')}" in multicast["detail"]
    assert "zctl node join tcp://HOST:PORT" in multicast["detail"]
    assert checks["LAN clusters"]["status"] == "warn"
    join = lan.run("m", ["node", "join", "--no-profile"], "blocked")
    assert join.returncode == 1 and "no cluster is announced on this LAN" in join.stderr
    assert "zctl node join tcp://HOST:PORT" in join.stderr
