"""The coordinator's planner search of a large fleet runs off its loop: heartbeats go on."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from controlplane.planner.export_shape import export_shape
from controlplane.stage_planner import StagePlanner
from tests.helpers.control import seed_profile, wait_for
from zctl.manifest import load_manifest

NODES = ("n1", "n2", "n3", "n4")  # with the coordinator, more than are searched on its loop


def test_a_slow_search_does_not_hold_up_heartbeats(cp_cluster, cp_export: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    shape = export_shape(load_manifest(cp_export), cp_export)
    for name in ("coord", *NODES):
        seed_profile(cp_cluster.root / name, shape)
    started, searched = threading.Event(), threading.Event()
    placed = StagePlanner._placed

    def slow(self: StagePlanner, *args: object) -> object:
        started.set()
        time.sleep(3.0)  # three times the 1 s of silence after which a node is dead (FAST)
        searched.set()
        return placed(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(StagePlanner, "_placed", slow)
    coord = cp_cluster.coordinator(expect_nodes=len(NODES))
    for name in NODES:
        cp_cluster.agent(coord.endpoint, name=name)
    assert started.wait(30.0)
    # the loop goes on while the search runs: its status (taken between two of the loop's
    # ticks) answers at once, the heartbeats with it
    time.sleep(1.0)
    before = time.monotonic()
    during = coord.status()
    assert time.monotonic() - before < 1.0 and not searched.is_set()
    assert during.placement == "" and all(n.last_seen_s < 1.0 for n in during.nodes
                                          if n.node_id != coord.node_id)
    wait_for(lambda: coord.status().placement.startswith("by the planner"), timeout=30.0,
             what="the planner's placement")
    status = coord.status()
    assert searched.is_set() and status.counters.get("marked_dead", 0) == 0
