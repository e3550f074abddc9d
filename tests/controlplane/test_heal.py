"""Healing onto the survivors (controlplane.heal): a lost node's stages go to its live
neighbours in the chain, each node keeping a contiguous run, memory permitting; a spare
that appears takes part of the busiest run back."""

from __future__ import annotations

import pytest

from controlplane.heal import heal_plan, hosts, rebalance_plan
from controlplane.placement import NodeCapacity, PlacementError, StageNeed

MB = 1 << 20


def _needs(*sizes_mb: int) -> list[StageNeed]:
    return [StageNeed(i, mb * MB, f"{i:064x}") for i, mb in enumerate(sizes_mb)]


def _room(**memory_mb: int) -> dict[str, NodeCapacity]:
    return {node: NodeCapacity(node, mb * MB) for node, mb in memory_mb.items()}


def test_hosts_are_the_chain_of_contiguous_runs() -> None:
    assert hosts({0: "c", 1: "a", 2: "a", 3: "b"}) == [("c", [0]), ("a", [1, 2]), ("b", [3])]
    with pytest.raises(ValueError, match="not contiguous"):
        hosts({0: "c", 1: "a", 2: "c"})


def test_the_last_stage_goes_to_the_node_before_it() -> None:
    plan = {0: "c", 1: "a", 2: "b"}
    assert heal_plan(plan, "b", _needs(10, 10, 10), _room(c=100, a=100)) == \
        {0: "c", 1: "a", 2: "a"}
    assert heal_plan({0: "c", 1: "a"}, "a", _needs(10, 10), _room(c=100)) == {0: "c", 1: "c"}


def test_a_middle_stage_goes_where_the_busiest_node_holds_least() -> None:
    plan = {0: "c", 1: "a", 2: "b"}
    needs = _needs(30, 10, 10)  # the coordinator's stage is the big one
    assert heal_plan(plan, "a", needs, _room(c=100, b=100)) == {0: "c", 1: "b", 2: "b"}
    needs = _needs(10, 10, 30)
    assert heal_plan(plan, "a", needs, _room(c=100, b=100)) == {0: "c", 1: "c", 2: "b"}


def test_a_run_of_stages_is_cut_between_both_neighbours() -> None:
    plan = {0: "c", 1: "a", 2: "a", 3: "b"}
    assert heal_plan(plan, "a", _needs(10, 10, 10, 10), _room(c=100, b=100)) == \
        {0: "c", 1: "c", 2: "b", 3: "b"}


def test_memory_decides_and_no_room_is_a_clear_error() -> None:
    plan = {0: "c", 1: "a", 2: "b"}
    needs = _needs(10, 40, 10)
    assert heal_plan(plan, "a", needs, _room(c=30, b=60)) == {0: "c", 1: "b", 2: "b"}
    with pytest.raises(PlacementError, match=r"cannot hold stage\(s\) 1 of lost node a "
                                             r"\(40.0 MiB\): node c has 20.0 MiB to spare; "
                                             r"node b has 10.0 MiB to spare"):
        heal_plan(plan, "a", needs, _room(c=30, b=20))
    with pytest.raises(PlacementError, match="node b is down too"):
        heal_plan(plan, "a", needs, _room(c=30))


def test_a_node_not_in_the_plan_changes_nothing() -> None:
    plan = {0: "c", 1: "a"}
    assert heal_plan(plan, "spare", _needs(10, 10), _room(c=100)) == plan


def test_a_spare_takes_part_of_the_busiest_run_back() -> None:
    needs = _needs(10, 10, 10)
    spare, other = NodeCapacity("s", 100 * MB), NodeCapacity("t", 100 * MB)
    # the coordinator runs every stage after two losses: it keeps stage 0, the spare
    # takes the rest, then a second spare splits that run
    once = rebalance_plan({0: "c", 1: "c", 2: "c"}, "c", spare, needs)
    assert once == {0: "c", 1: "s", 2: "s"}
    assert rebalance_plan(once, "c", other, needs) == {0: "c", 1: "s", 2: "t"}
    # a node's run gives its head or its tail: the part whose shard the spare has cached
    plan = {0: "c", 1: "a", 2: "a"}
    cached = NodeCapacity("s", 100 * MB, cached=frozenset({needs[1].shard_hash}))
    assert rebalance_plan(plan, "c", cached, needs) == {0: "c", 1: "s", 2: "a"}
    assert rebalance_plan(plan, "c", spare, needs) == {0: "c", 1: "a", 2: "s"}
    # the busier run is split first, and so that its busier side holds least
    busy = {0: "c", 1: "c", 2: "a", 3: "a", 4: "a"}
    assert rebalance_plan(busy, "c", spare, _needs(10, 10, 10, 10, 10)) in (
        {0: "c", 1: "c", 2: "a", 3: "s", 4: "s"}, {0: "c", 1: "c", 2: "s", 3: "s", 4: "a"})


def test_no_run_to_split_or_no_room_moves_nothing() -> None:
    needs = _needs(10, 10, 10)
    assert rebalance_plan({0: "c", 1: "a", 2: "b"}, "c", NodeCapacity("s", 100 * MB),
                          needs) is None
    assert rebalance_plan({0: "c", 1: "c", 2: "a"}, "c", NodeCapacity("s", 5 * MB),
                          needs) is None
