"""llama.cpp's processes for one case: an RPC server on each node past the first (with a
delaying relay in front of it when the hop has a delay), and llama-server on the first
node, started again for each slot count (``-np N``). Each runs on its node's loopback
address and CPU set (os.sched_setaffinity before exec, the cores zctl's ``cpu_sets``
gives that node) with one thread per core, its output in a log of its own. A process
that exits is that peer's failure (``PeerFailure``, with the tail of its log).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tools.peers.build import LlamaBinaries
from tools.peers.placement import (
    LlamaPlacement,
    PlacementError,
    expected_device_bytes,
    layer_devices,
    parse_load_log,
    verify_loaded,
)
from tools.peers.relay import READY
from zctl.launcher.lifetime import die_with_parent
from zctl.launcher.local import free_port, log_tail, stop_processes

START_TIMEOUT_S = 600.0
# llama-server's log level: 4 ("trace") prints the load log's placement lines (buffers,
# layers offloaded), some 20 lines a request and none a token.
LOAD_LOG_VERBOSITY = 4
SERVER_SLOT_CONTEXT = 1024  # tokens of KV per slot when serving (the request set's ~700)


class PeerFailure(RuntimeError):
    """A peer that failed: what failed, and the tail of its log."""

    def __init__(self, message: str, log: str = "") -> None:
        super().__init__(message)
        self.log_tail = log

    def record(self) -> dict[str, str]:
        return {"error": str(self), "log_tail": self.log_tail}


@dataclass(frozen=True)
class Node:
    """A node of a case: its loopback address and cores (None: every core)."""

    host: str
    cpus: tuple[int, ...] | None

    @property
    def threads(self) -> int:
        return len(self.cpus) if self.cpus else (len(os.sched_getaffinity(0)) or 1)


@dataclass
class Process:
    """A started process, its name and its log."""

    name: str
    popen: subprocess.Popen
    log: Path

    def check(self) -> None:
        """PeerFailure (with its log's tail) if it has exited."""
        code = self.popen.poll()
        if code is not None:
            raise PeerFailure(f"{self.name} exited with {code}", log_tail(str(self.log), 30))


def spawn(name: str, argv: Sequence[str], log: Path, cpus: tuple[int, ...] | None = None,
          env: dict[str, str] | None = None, stdout: Path | None = None) -> Process:
    """Start ``argv`` in a session of its own, on ``cpus``, ending with this process; its
    output in ``log`` (a fresh file; its standard output apart in ``stdout`` if given).
    PeerFailure if it cannot be started (a binary missing, not executable, or built for
    another machine)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    tie = die_with_parent()

    def before_exec() -> None:
        tie()
        if cpus:
            os.sched_setaffinity(0, cpus)

    try:
        with open(log, "wb") as out, open(stdout or os.devnull, "wb") as apart:
            popen = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL,
                                     stdout=apart if stdout else out, stderr=out,
                                     start_new_session=True, env={**os.environ, **(env or {})},
                                     preexec_fn=before_exec)
    except OSError as exc:
        raise PeerFailure(f"{name} cannot be started: {type(exc).__name__}: {exc}") from None
    return Process(name, popen, log)


def wait_until(ready: Callable[[], bool], processes: Sequence[Process], what: str,
               timeout_s: float = START_TIMEOUT_S) -> None:
    """Poll ``ready`` until true; PeerFailure if a process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        for process in processes:
            process.check()
        if time.monotonic() > deadline:
            raise PeerFailure(f"{what} not ready after {timeout_s:.0f} s",
                              log_tail(str(processes[-1].log), 30) if processes else "")
        time.sleep(0.1)


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def log_says(log: Path, text: str) -> bool:
    try:
        return text in log.read_text(errors="replace")
    except OSError:
        return False


def http_ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class LlamaCluster:
    """llama.cpp on a case's nodes: RPC servers (and relays) start with it, llama-server
    with ``start_server``; everything stops with ``close``."""

    binaries: LlamaBinaries
    gguf: Path
    nodes: Sequence[Node]
    placement: LlamaPlacement
    delay_ms: float
    logs: Path
    extra_args: Sequence[str] = ()  # more llama-server arguments (the greedy check's numerics)
    tensor_bytes: dict[str, int] = field(default_factory=dict)
    num_layers: int = 0
    rpc: list[Process] = field(default_factory=list)
    relays: list[Process] = field(default_factory=list)
    endpoints: list[str] = field(default_factory=list)
    server: Process | None = None
    base_url: str = ""
    placement_lines: list[str] = field(default_factory=list)

    def start_rpc(self) -> None:
        """An RPC server on each node past the first, and its relay when the hop has a
        delay: ``endpoints``, in node order, are where llama-server connects."""
        for index, node in enumerate(self.nodes[1:], start=1):
            port = free_port(node.host)
            process = spawn(f"ggml-rpc-server on {node.host}", [
                str(self.binaries.path("rpc")), "-H", node.host, "-p", str(port),
                "-t", str(node.threads)], self.logs / f"rpc{index}.log", node.cpus)
            self.rpc.append(process)
            wait_until(lambda h=node.host, p=port: port_open(h, p), [process],
                       f"the RPC server on {node.host}:{port}")
            endpoint = f"{node.host}:{port}"
            if self.delay_ms > 0:
                relay_port = free_port(node.host)
                log = self.logs / f"relay{index}.log"
                relay = spawn(f"the relay to {endpoint}", [
                    sys.executable, "-m", "tools.peers.relay", f"{node.host}:{relay_port}",
                    endpoint, f"{self.delay_ms:g}"], log, env={"PYTHONUNBUFFERED": "1"})
                self.relays.append(relay)
                wait_until(lambda log=log: log_says(log, READY), [relay], f"the relay to {endpoint}")
                endpoint = f"{node.host}:{relay_port}"
            self.endpoints.append(endpoint)

    def server_args(self, slots: int, context: int) -> list[str]:
        host = self.nodes[0]
        args = [str(self.binaries.path("server")), "-m", str(self.gguf), "--host", host.host,
                "--port", "{port}", "-t", str(host.threads), "-np", str(slots),
                "-c", str(context), "--no-webui", "--fit", "off",
                "-lv", str(LOAD_LOG_VERBOSITY), *self.placement.args(), *self.extra_args]
        if self.endpoints:
            args += ["--rpc", ",".join(self.endpoints)]
        return args

    def start_server(self, slots: int, context: int | None = None) -> str:
        """llama-server with ``slots`` slots (each ``SERVER_SLOT_CONTEXT`` tokens unless
        ``context`` says the total), once it answers /health: its base URL. The first
        start checks the placement in its load log (``placement_lines``)."""
        self.stop_server()
        host = self.nodes[0]
        port = free_port(host.host)
        args = [a.replace("{port}", str(port))
                for a in self.server_args(slots, context or slots * SERVER_SLOT_CONTEXT)]
        log = self.logs / f"server-np{slots}-c{context or slots * SERVER_SLOT_CONTEXT}.log"
        self.server = spawn(f"llama-server -np {slots}", args, log, host.cpus)
        self.base_url = f"http://{host.host}:{port}"
        wait_until(lambda: http_ready(f"{self.base_url}/health"), [*self.rpc, *self.relays,
                                                                     self.server],
                   f"llama-server on {host.host}:{port}")
        if not self.placement_lines and self.tensor_bytes:
            try:
                self.placement_lines = self.verify_placement(log.read_text(errors="replace"))
            except PlacementError as exc:
                raise PeerFailure(f"llama.cpp's layers are not where zctl's are: {exc}",
                                  log_tail(str(log), 30)) from None
        return self.base_url

    def verify_placement(self, load_log: str) -> list[str]:
        devices = layer_devices(self.placement, self.num_layers)
        expected = expected_device_bytes(self.tensor_bytes, devices, self.num_layers)
        return verify_loaded(parse_load_log(load_log), self.placement, self.endpoints, expected)

    def check(self) -> None:
        """PeerFailure if any of its processes has exited."""
        for process in [*self.rpc, *self.relays, *([self.server] if self.server else [])]:
            process.check()

    def server_log_tail(self) -> str:
        """The tail of the running llama-server's log ("" before it starts)."""
        return log_tail(str(self.server.log), 30) if self.server is not None else ""

    def stop_server(self) -> None:
        if self.server is not None:
            stop_processes([self.server.popen.pid])
            self.server.popen.wait()
            self.server = None

    def close(self) -> None:
        self.stop_server()
        processes = [*self.relays, *self.rpc]
        stop_processes([p.popen.pid for p in processes])
        for process in processes:
            process.popen.wait()
        self.rpc, self.relays, self.endpoints = [], [], []

    def __enter__(self) -> LlamaCluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def llama_bench(binaries: LlamaBinaries, gguf: Path, node: Node, tokens: int, log: Path,
                timeout_s: float = START_TIMEOUT_S) -> dict[str, float]:
    """llama-bench's own decode figure on one node (``-p 0 -n tokens``, 3 repetitions, on
    the node's cores and threads): a reference beside the HTTP figures, in no ratio.
    PeerFailure (with its log's tail) if it exits with an error, is still running after
    ``timeout_s`` (then it is stopped), or prints no run's figures."""
    bench = spawn("llama-bench", [str(binaries.path("bench")), "-m", str(gguf), "-p", "0",
                                  "-n", str(tokens), "-t", str(node.threads), "-r", "3",
                                  "-o", "json"], log, node.cpus, stdout=log.with_suffix(".json"))
    try:
        code = bench.popen.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_processes([bench.popen.pid])
        bench.popen.wait()
        raise PeerFailure(f"llama-bench still running after {timeout_s:g} s (stopped)",
                          log_tail(str(log), 30)) from None
    if code != 0:
        raise PeerFailure(f"llama-bench exited with {code}", log_tail(str(log), 30))
    try:
        runs = json.loads(log.with_suffix(".json").read_text())
    except (OSError, ValueError):
        raise PeerFailure("llama-bench printed no JSON", log_tail(str(log), 30)) from None
    first = runs[0] if isinstance(runs, list) and runs else None
    if not isinstance(first, dict) or not all(isinstance(first.get(key), int | float)
                                              for key in ("avg_ts", "stddev_ts")):
        raise PeerFailure(f"llama-bench's JSON holds no run's avg_ts and stddev_ts: "
                          f"{json.dumps(runs)[:200]}", log_tail(str(log), 30))
    return {f"tg{tokens}_tok_s": round(float(first["avg_ts"]), 2),
            f"tg{tokens}_tok_s_stddev": round(float(first["stddev_ts"]), 2)}
