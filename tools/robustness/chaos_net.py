"""The chaos harness's network: each node in its own network namespace (tools.robustness.chaos).

A bridge on the host holds the coordinator's address; node i lives in namespace
``<prefix>n<i>`` whose ``eth0`` is one end of a veth pair, the other end on the bridge, so
real TCP runs between separate network stacks. Faults act on the host end of a node's
veth: ``link(i, False)`` takes it down, ``slow(i, mbit)`` shapes what the node receives
with ``tbf`` (the kernel here has no ``netem``). Where namespaces cannot be made (not
root, no ``ip``), ``Loopback`` gives each node a 127.0.0.x address and no link faults.
Everything made here is removed by ``down()``, also after a crash of an earlier run.
"""

from __future__ import annotations

import os
import shutil
import subprocess

SUBNET = "10.213.7"  # the harness's own /24, used only on the bridge and its veths


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class Namespaces:
    """A bridge plus one namespace per node (node 0, the coordinator, stays on the host)."""

    kind = "namespaces"
    link_faults = True
    why = ""  # nothing is missing (the fallback says why it is one)

    def __init__(self, nodes: int, prefix: str = "zcx", subnet: str = SUBNET) -> None:
        self.nodes, self.prefix, self.subnet = nodes, prefix, subnet
        self.bridge = f"{prefix}br0"

    def host(self, node: int) -> str:
        return f"{self.subnet}.{node + 1}"

    def ns(self, node: int) -> str:
        return f"{self.prefix}n{node}"

    def veth(self, node: int) -> str:
        return f"{self.prefix}v{node}"

    def command(self, node: int, argv: list[str]) -> list[str]:
        """``argv`` run inside node ``node``'s namespace (the coordinator's on the host)."""
        return argv if node == 0 else ["ip", "netns", "exec", self.ns(node), *argv]

    def up(self) -> None:
        self.down()
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.host(0)}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for node in range(1, self.nodes):
            ns, veth = self.ns(node), self.veth(node)
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
            _ip("link", "set", f"{veth}p", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            inside = ("ip", "netns", "exec", ns, "ip")
            for args in (("link", "set", "lo", "up"),
                         ("link", "set", f"{veth}p", "name", "eth0"),
                         ("addr", "add", f"{self.host(node)}/24", "dev", "eth0"),
                         ("link", "set", "eth0", "up")):
                subprocess.run([*inside, *args], capture_output=True, text=True, check=True)

    def down(self) -> None:
        for node in range(1, self.nodes):
            _ip("netns", "del", self.ns(node), check=False)
            _ip("link", "del", self.veth(node), check=False)
        _ip("link", "del", self.bridge, check=False)

    def link(self, node: int, up: bool) -> None:
        _ip("link", "set", self.veth(node), "up" if up else "down")

    def slow(self, node: int, mbit: float | None) -> None:
        """Shape what node ``node`` receives to ``mbit`` (None: no shaping)."""
        dev = self.veth(node)
        subprocess.run(["tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
        if mbit is not None:
            subprocess.run(["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                            f"{mbit}mbit", "burst", "32kbit", "latency", "400ms"],
                           capture_output=True, text=True, check=True)


class Loopback:
    """The fallback: node i at 127.0.0.(i+1) on the host's own stack; no link faults."""

    kind = "loopback"
    link_faults = False

    def __init__(self, nodes: int, why: str) -> None:
        self.nodes, self.why = nodes, why

    def host(self, node: int) -> str:
        return f"127.0.0.{node + 1}"

    def command(self, node: int, argv: list[str]) -> list[str]:
        return argv

    def up(self) -> None:
        pass

    def down(self) -> None:
        pass


def network(nodes: int, want_namespaces: bool = True) -> Namespaces | Loopback:
    """Namespaces when they can be made here, else the loopback fallback saying why."""
    if not want_namespaces:
        return Loopback(nodes, "namespaces not asked for (--loopback)")
    if os.geteuid() != 0:
        return Loopback(nodes, "not root: network namespaces need CAP_NET_ADMIN")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return Loopback(nodes, "the ip and tc commands (iproute2) are not installed")
    net = Namespaces(nodes)
    try:
        net.up()
    except (subprocess.CalledProcessError, OSError) as exc:
        net.down()
        detail = getattr(exc, "stderr", "") or str(exc)
        return Loopback(nodes, f"namespaces could not be made: {detail.strip()}")
    return net
