"""The records the control plane carries: a node's name as people see it."""

from __future__ import annotations

from dataclasses import replace

from controlplane.records import COORDINATOR
from tests.zctl.cli.test_view import node


def test_a_node_is_named_by_its_id_and_the_coordinators_own_as_the_coordinator() -> None:
    worker = node("n1", 1, "127.0.0.2")
    assert worker.name == "n1"
    assert replace(worker, local=True).name == COORDINATOR == "coordinator"
