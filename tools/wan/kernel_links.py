"""Kernel links for an experiment's ``shaper = "tbf"`` clusters: the coordinator on a host
bridge, each node in its own network namespace on a veth (tools.robustness.chaos_net.Namespaces), and
the kernel's ``tbf`` qdisc capping every veth's rate in both directions: on the host end
(what the node receives) and on the node's ``eth0`` (what it sends). Real TCP then runs
between separate network stacks, and our link layer adds only the delay and jitter. The
links are capped once the cluster serves (``shape``), after the nodes fetched their shards.

A hop between two nodes passes two tbf qdiscs of the same rate (the sender's eth0, the
receiver's host end); the first paces it, the second finds it paced. Making namespaces
needs root and iproute2; where that is missing, ``KernelLinksUnavailable`` says why.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from types import TracebackType

from tools.robustness.chaos_net import Namespaces

PREFIX = "zce"  # names of the bridge, namespaces and veths (the chaos harness's are zcx)
SUBNET = "10.213.9"
MTU_FRAME = 1514  # bytes: a full Ethernet frame on the veth
QUEUE_BYTES = 8 << 20  # what tbf may queue: more than any step's reply, so nothing drops


class KernelLinksUnavailable(RuntimeError):
    """Network namespaces cannot be made here; the text says why."""


def tbf_args(mbit: float) -> list[str]:
    """tbf's parameters for ``mbit``: a bucket of 1 ms at the rate (at least two full
    frames, as tbf must pass a whole frame) and a queue no step fills, so tbf paces but
    never drops, as our link layer's shaping does."""
    if not mbit > 0:
        raise ValueError(f"tbf needs a rate > 0 Mbit/s, got {mbit}")
    rate_bytes = mbit * 1e6 / 8
    burst = max(2 * MTU_FRAME, int(rate_bytes / 1000))
    return ["tbf", "rate", f"{mbit * 1000:g}kbit", "burst", str(burst), "limit", str(QUEUE_BYTES)]


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        raise KernelLinksUnavailable(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")


class KernelLinks:
    """Namespaces and tbf links for a ``stages``-stage cluster, shaped to ``mbit``; a
    context manager that removes all it made (also what a crashed earlier run left)."""

    def __init__(self, stages: int, mbit: float) -> None:
        self.net = Namespaces(stages, PREFIX, SUBNET)
        self.mbit = mbit

    def host(self, node: int) -> str:
        return self.net.host(node)

    def command(self, node: int, argv: list[str]) -> list[str]:
        return self.net.command(node, argv)

    def __enter__(self) -> KernelLinks:
        if os.geteuid() != 0:
            raise KernelLinksUnavailable("not root: network namespaces need CAP_NET_ADMIN")
        if shutil.which("ip") is None or shutil.which("tc") is None:
            raise KernelLinksUnavailable("the ip and tc commands (iproute2) are not installed")
        try:
            self.net.up()
        except (subprocess.CalledProcessError, OSError) as exc:
            self.net.down()
            detail = getattr(exc, "stderr", "") or str(exc)
            raise KernelLinksUnavailable(f"kernel links could not be made: {detail.strip()}"
                                         ) from None
        return self

    def shape(self) -> None:
        """Cap every veth at the rate, both ways. Called once the cluster serves: the nodes
        fetch their shards over the control plane first, which is not what is measured
        (at 1 Mbit/s a 100 MB shard would take minutes, and the node's heartbeats with it)."""
        try:
            for node in range(1, self.net.nodes):
                _run(["tc", "qdisc", "replace", "dev", self.net.veth(node), "root",
                      *tbf_args(self.mbit)])
                _run(["ip", "netns", "exec", self.net.ns(node), "tc", "qdisc", "replace",
                      "dev", "eth0", "root", *tbf_args(self.mbit)])
        except (OSError, KernelLinksUnavailable) as exc:
            raise KernelLinksUnavailable(f"tbf could not be set: {exc}") from None

    def sent_bytes(self) -> dict[str, int]:
        """Bytes each tbf qdisc has passed, by device (``zcev1``, ``zcen1:eth0``, ...)."""
        out = {}
        for node in range(1, self.net.nodes):
            for name, argv in ((self.net.veth(node), []),
                               (f"{self.net.ns(node)}:eth0", ["ip", "netns", "exec",
                                                              self.net.ns(node)])):
                dev = name.split(":")[-1]
                shown = subprocess.run([*argv, "tc", "-s", "qdisc", "show", "dev", dev],
                                       capture_output=True, text=True).stdout
                match = re.search(r"qdisc tbf .*?Sent (\d+) bytes", shown, re.S)
                out[name] = int(match.group(1)) if match else 0
        return out

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.net.down()
