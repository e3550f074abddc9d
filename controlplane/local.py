"""A whole cluster in one process: the coordinator plus N-1 node agents on loopback.

For trying a split on one machine (``zctl cluster up --local N``) and for tests: the
nodes are threads with their own state directories, talking over real TCP sockets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from controlplane.agent import AgentConfig, NodeAgent, ProgressCallback
from controlplane.coordinator import Coordinator, CoordinatorConfig
from controlplane.launch import StageLauncher
from controlplane.records import HEARTBEAT_S, LIVENESS, ClusterStatus, RuntimeSpec
from zctl.manifest import load_manifest
from zctl.paths import zctl_home


class LocalCluster:
    """Start with ``start()`` (waits until the pipeline serves), end with ``stop()``."""

    def __init__(self, export_dir: Path | str, nodes: int | None = None,
                 root: Path | None = None, host: str = "127.0.0.1",
                 runtime: RuntimeSpec | None = None, heartbeat_interval: float = HEARTBEAT_S,
                 liveness: int = LIVENESS, head_launcher: StageLauncher | None = None,
                 node_launcher: StageLauncher | None = None,
                 on_progress: ProgressCallback | None = None) -> None:
        self.root = root or zctl_home() / "local"
        stages = len(load_manifest(export_dir, verify_files=False).stages)
        count = stages if nodes is None else nodes
        if count < 1:
            raise ValueError(f"a cluster needs at least one node (the coordinator), got {count}")
        config = CoordinatorConfig(endpoint=f"tcp://{host}:*", state_dir=self.root / "coordinator",
                                   host=host, heartbeat_interval=heartbeat_interval,
                                   liveness=liveness, runtime=runtime or RuntimeSpec(),
                                   expect_nodes=count - 1)
        self.coordinator = Coordinator(export_dir, config, launcher=head_launcher)
        self.host = host
        self.heartbeat_interval = heartbeat_interval
        self.node_launcher = node_launcher
        self.on_progress = on_progress
        self.agents: list[NodeAgent] = []
        self._count = count

    def start(self, timeout: float = 300.0) -> ClusterStatus:
        endpoint = self.coordinator.start()
        try:
            for i in range(1, self._count):
                config = AgentConfig(endpoint, state_dir=self.root / f"node{i}",
                                     data_host=self.host,
                                     heartbeat_interval=self.heartbeat_interval)
                agent = NodeAgent(config, launcher=self.node_launcher,
                                  on_progress=self.on_progress)
                self.agents.append(agent)
                agent.start()
            return self.coordinator.wait_serving(timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for agent in self.agents:
            agent.stop()
        self.coordinator.stop()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
