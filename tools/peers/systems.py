"""The two systems a case compares, each up for the whole case and served through its
OpenAI API on 127.0.0.1: zctl (a local cluster and ``zctl serve``, tools.harness.cluster)
and llama.cpp (llama-server with ``--rpc``, tools.peers.processes). Both on the same
loopback addresses and CPU sets: node i on 127.0.0.(i+1), with the cores zctl's
``cpu_sets`` gives node i (``zctl serve`` on node 0's, as llama-server's HTTP threads are).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from tools.harness.cluster import served_cluster
from tools.harness.load import served_model
from tools.peers.build import LlamaBinaries
from tools.peers.gguf import GgufLayout
from tools.peers.placement import PlacementError, llama_placement
from tools.peers.processes import LlamaCluster, Node, PeerFailure
from zctl.launcher.cpusets import local_cpu_sets, parse_cpu_list
from zctl.launcher.local import log_tail, loopback_host
from zctl.launcher.processes import runtime_spec
from zctl.launcher.record import ClusterError, ClusterRecord, alive

ONE_STREAM_CONTEXT = 2048  # llama-server's context for one stream: 1,024 + 128 tokens fit


class Served(Protocol):
    """A system under test as a case sees it."""

    name: str
    base_url: str
    model: str

    def prepare(self, slots: int, context: int | None = None) -> None:
        """Be ready to serve ``slots`` streams at once (``context``: tokens in all)."""

    def check(self) -> None:
        """PeerFailure if the system has lost a process."""


def case_nodes(nodes: int, cpu_sets: str) -> list[Node]:
    """Node i's address and cores, as zctl's local cluster gives them."""
    sets = local_cpu_sets(cpu_sets, nodes)
    return [Node(loopback_host(i), tuple(parse_cpu_list(s)) if s else None)
            for i, s in enumerate(sets)]


def confine_process(pid: int, cpus: Sequence[int]) -> None:
    """Every thread of process ``pid`` on ``cpus`` (threads it starts later inherit it)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:
            pass


@dataclass
class ZctlServed:
    """zctl serve on a running local cluster."""

    record: ClusterRecord
    model: str
    name: str = "zctl"

    @property
    def base_url(self) -> str:
        return self.record.api

    def prepare(self, slots: int, context: int | None = None) -> None:
        """One cluster serves any number of streams (up to its max_streams)."""

    def check(self) -> None:
        if dead := [pid for pid in self.record.pids if not alive(pid)]:
            raise PeerFailure(f"zctl lost process {dead[0]}",
                              log_tail(self.record.logs[0], 30) if self.record.logs else "")


@contextmanager
def zctl_served(export_dir: Path, nodes: Sequence[Node], cpu_sets: str, delay_ms: float,
                home: Path) -> Iterator[ZctlServed]:
    """zctl serve on a local cluster of ``export_dir``, one node per stage, as ``zctl
    cluster up --local N --api`` runs it (its default numerics), its hops delayed by
    ``delay_ms`` in its link layer; PeerFailure if it does not start."""
    try:
        with served_cluster(export_dir, len(nodes), runtime_spec("f32", None, "CPU"), home,
                            cpu_sets=cpu_sets, link_delay_ms=delay_ms) as record:
            if nodes[0].cpus:
                confine_process(record.pids[-1], nodes[0].cpus)  # zctl serve: node 0's cores
            model = asyncio.run(served_model(record.api)).id
            yield ZctlServed(record, model)
    except ClusterError as exc:
        raise PeerFailure(f"zctl did not start: {exc}") from None


@dataclass
class LlamaServed:
    """llama-server (with its RPC servers) on a case's nodes, started again whenever the
    slot count or the context changes."""

    cluster: LlamaCluster
    name: str = "llama.cpp"
    model: str = "llama.cpp"
    shape: tuple[int, int | None] = (0, None)

    @property
    def base_url(self) -> str:
        return self.cluster.base_url

    def prepare(self, slots: int, context: int | None = None) -> None:
        if self.shape != (slots, context) or self.cluster.server is None:
            self.cluster.start_server(slots, context)
            self.shape = (slots, context)

    def check(self) -> None:
        self.cluster.check()


@contextmanager
def llama_served(binaries: LlamaBinaries, gguf: Path, layout: GgufLayout,
                 ranges: Sequence[tuple[int, int]], nodes: Sequence[Node], delay_ms: float,
                 logs: Path, extra_args: Sequence[str] = ()) -> Iterator[LlamaServed]:
    """llama.cpp on ``nodes`` with zctl's split ``ranges``: its RPC servers (and relays)
    up; llama-server (with ``extra_args``) starts on the first ``prepare``. PeerFailure
    if they do not start, or if the GGUF's layers cannot take zctl's split."""
    try:
        placement = llama_placement(ranges, layout.num_layers)
    except PlacementError as exc:
        raise PeerFailure(f"llama.cpp cannot take zctl's split of {gguf.name}: {exc}") from None
    cluster = LlamaCluster(binaries, gguf, nodes, placement, delay_ms, logs, extra_args=extra_args,
                           tensor_bytes=layout.tensor_bytes, num_layers=layout.num_layers)
    with cluster:
        cluster.start_rpc()
        yield LlamaServed(cluster)
