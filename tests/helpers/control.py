"""Helpers for the control-plane tests: a cluster builder, raw sockets, fault injection."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path

import zmq

from controlplane import messages as m
from controlplane import records as r
from controlplane.agent import AgentConfig, NodeAgent
from controlplane.coordinator import Coordinator, CoordinatorConfig
from controlplane.host_speed import SpeedCheck
from controlplane.launch import StageAssignment
from controlplane.nodeinfo import openvino_version, zctl_version
from controlplane.shards import ShardSource

FAST = {"heartbeat_interval": 0.1, "liveness": 10}
# a test that wants a profile measured says so (profile=True): it spawns a process
QUIET = {"profile": False}


class FakeStage:
    """A launched stage that records its assignment."""

    launched: list[StageAssignment] = []

    def __init__(self, assignment: StageAssignment) -> None:
        self.assignment = assignment
        self.stopped = False
        FakeStage.launched.append(assignment)

    def stop(self) -> None:
        self.stopped = True

    def kv_slots(self) -> int:
        return -1  # runs no stage: no KV it could count


def wait_for(pred: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


class Cluster:
    """Starts coordinators and agents for one test and stops them all afterwards."""

    def __init__(self, root: Path, export: Path) -> None:
        self.root, self.export = root, export
        self.coordinators: list[Coordinator] = []
        self.agents: list[NodeAgent] = []

    def coordinator(self, source: ShardSource | None = None,
                    speed_check: SpeedCheck | None = None, **config: object) -> Coordinator:
        """A coordinator; a lost node's stage waits for it to come back (what these tests
        mostly check) unless ``heal_after`` is given; ``speed_check`` times its host's speed
        in place of the real one."""
        cfg = CoordinatorConfig(endpoint=str(config.pop("endpoint", "tcp://127.0.0.1:*")),
                                state_dir=self.root / "coord", host="127.0.0.1",
                                **{"chunk_size": 64 << 10, "heal_after": None, **FAST,
                                   **QUIET, **config})  # type: ignore
        coord = Coordinator(self.export, cfg, launcher=FakeStage, source=source)
        if speed_check is not None:
            coord.speed.check = speed_check
        self.coordinators.append(coord)
        coord.start()
        return coord

    def agent(self, endpoint: str, name: str = "n1", host: str = "127.0.0.1",
              launcher: Callable | None = None, on_progress: Callable | None = None,
              speed_check: SpeedCheck | None = None, **config: object) -> NodeAgent:
        """An agent; ``speed_check`` times its host's speed in place of the real one."""
        cfg = AgentConfig(endpoint, state_dir=self.root / name, data_host=host,
                          reconnect_min=0.05, reconnect_max=0.4, chunk_timeout=2.0,
                          **{**FAST, **QUIET, **config})  # type: ignore[arg-type]
        agent = NodeAgent(cfg, launcher=launcher or FakeStage, on_progress=on_progress)
        if speed_check is not None:
            agent.speed.check = speed_check
        self.agents.append(agent)
        agent.start()
        return agent

    def close(self) -> None:
        for agent in self.agents:
            agent.stop()
        for coord in self.coordinators:
            coord.stop()


def seed_profile(state_dir: Path, shape: object, weights: str = "fp32",
                 openvino: str | None = None) -> None:
    """A profile of ``shape`` kept in a node's state directory, as zctl node profile leaves
    one (figures made up: a layer of 0.1 ms at one row)."""
    from controlplane.planner.measured import Measurement
    from controlplane.planner.profile import GRAPH_VERSION, ProfileKey
    from controlplane.profile_store import ProfileStore

    version = openvino or openvino_version()
    rows = (1e-4, 1.5e-4, 2e-4, 3e-4)
    key = ProfileKey(shape.fingerprint(), weights, "CPU", version,  # type: ignore[attr-defined]
                     GRAPH_VERSION)
    measurement = Measurement(key, 3, rows, tuple(4 * v for v in rows),
                              tuple(5 * v for v in rows), 128, 1e-3, 4e-3, 1 << 20, 4 << 20,
                              8 << 30, engine_s=rows, frame_s=rows, rounds=2, seconds=1.0)
    ProfileStore(state_dir, version).save(shape, measurement)  # type: ignore[arg-type]


def node(status: r.ClusterStatus, node_id: str) -> r.NodeStatus:
    return next(n for n in status.nodes if n.node_id == node_id)


class RawNode:
    """A hand-driven DEALER: sends exactly what a test says."""

    def __init__(self, endpoint: str, identity: bytes, curve: object = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, identity)
        if curve is not None:  # a controlplane.security.CurveClient
            curve.apply(self.sock)  # type: ignore[attr-defined]
        self.sock.connect(endpoint)

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def recv(self, timeout: float = 3.0) -> m.Message:
        assert self.sock.poll(int(timeout * 1000)), "no reply"
        return m.from_frames(self.sock.recv_multipart())[0]

    def recv_until(self, kind: type[m.Message], timeout: float = 3.0) -> m.Message:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = self.recv(max(0.01, deadline - time.monotonic()))
            if isinstance(msg, kind):
                return msg
        raise AssertionError(f"no {kind.__name__}")

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def enrol_msg(node_id: str, **change: object) -> m.Enrol:
    fields = {"node_id": node_id, "host": "127.0.0.1", "data_addr": "tcp://127.0.0.1:1",
              "devices": [r.DeviceInfo("CPU", "cpu", 8 << 30)], "ram_total": 8 << 30,
              "ram_free": 4 << 30, "openvino": openvino_version(), "zctl": zctl_version()}
    return m.Enrol(**{**fields, **change})  # type: ignore[arg-type]


class CorruptingSource(ShardSource):
    """Flips a byte of chosen chunks after their sha256 was taken (damage in transit)."""

    def __init__(self, *args: object, bad: dict[tuple[str, int], int], recompute: bool = False,
                 **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.bad = bad  # (file, chunk) -> how many times to corrupt it
        self.recompute = recompute

    def read_chunk(self, request: m.ShardRequest) -> tuple[m.ShardChunk, bytes]:
        chunk, data = super().read_chunk(request)
        key = (request.file, request.chunk)
        if self.bad.get(key, 0) > 0:
            self.bad[key] -= 1
            data = bytes([data[0] ^ 0xFF]) + data[1:]
            if self.recompute:  # the chunk looks fine; only the file hash can tell
                chunk = m.ShardChunk(chunk.shard_hash, chunk.file, chunk.chunk, chunk.offset,
                                     chunk.size, hashlib.sha256(data).hexdigest())
        return chunk, data


def corrupting(export: Path, **kwargs: object) -> CorruptingSource:
    from zctl.manifest import load_manifest

    return CorruptingSource(export, load_manifest(export), 64 << 10, **kwargs)  # type: ignore
