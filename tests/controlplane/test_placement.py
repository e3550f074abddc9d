"""Placement: layer ranges from capacity and speed, explicit ranges, stage-to-node assignment,
runs of stages on fewer nodes than stages."""

from __future__ import annotations

from pathlib import Path

import pytest

from controlplane.placement import (
    LayerCost,
    NodeCapacity,
    PlacementError,
    StageNeed,
    assign_runs,
    assign_stages,
    check_ranges,
    fmt_bytes,
    node_memory,
    plan_layers,
    stage_needs,
)
from controlplane.records import DeviceInfo

MiB = 1 << 20
GiB = 1 << 30
COST = LayerCost(layer_bytes=100 * MiB, first_extra=500 * MiB, last_extra=500 * MiB,
                 kv_bytes_per_layer=0, overhead=1.0)


def nodes(*specs: tuple[float, float | None]) -> list[NodeCapacity]:
    return [NodeCapacity(f"n{i}", int(mem * GiB), speed) for i, (mem, speed) in enumerate(specs)]


def covers(ranges: list[tuple[int, int]], num_layers: int) -> bool:
    return ranges[0][0] == 0 and ranges[-1][1] == num_layers and all(
        a[1] == b[0] and a[0] < a[1] for a, b in zip(ranges, ranges[1:], strict=False))


def test_equal_nodes_share_evenly() -> None:
    assert plan_layers(30, nodes((8, None), (8, None)), COST) == [(0, 15), (15, 30)]
    ranges = plan_layers(32, nodes((8, None), (8, None), (8, None)), COST)
    assert covers(ranges, 32) and sorted(b - a for a, b in ranges) == [10, 11, 11]


def test_measured_speed_shares_layers_in_proportion() -> None:
    assert plan_layers(30, nodes((8, 10.0), (8, 20.0)), COST) == [(0, 10), (10, 30)]
    # a node without a measurement counts as the mean of the measured ones
    ranges = plan_layers(30, nodes((8, 10.0), (8, None), (8, 20.0)), COST)
    assert [b - a for a, b in ranges] == [7, 11, 12] or covers(ranges, 30)


def test_memory_comes_first() -> None:
    # node 0 holds the embedding (500 MiB) plus 7 layers of 100 MiB in 1.25 GiB
    ranges = plan_layers(30, nodes((1.25, 10.0), (8, 20.0)), COST)
    assert ranges == [(0, 7), (7, 30)]
    ranges = plan_layers(30, nodes((8, 100.0), (2, 1.0)), COST)
    assert ranges[1][1] - ranges[1][0] <= 15 and covers(ranges, 30)


def test_every_node_gets_a_layer_even_if_slow() -> None:
    ranges = plan_layers(10, nodes((8, 1000.0), (8, 1.0), (8, 1.0)), COST)
    assert covers(ranges, 10) and all(b - a >= 1 for a, b in ranges)


def test_node_that_cannot_hold_one_layer_is_named() -> None:
    with pytest.raises(PlacementError, match=r"node n1 has 200\.0 MiB usable but one layer plus "
                                             r"the LM head needs about 600\.0 MiB"):
        plan_layers(30, [NodeCapacity("n0", 8 * GiB), NodeCapacity("n1", 200 * MiB)], COST)


def test_too_little_memory_overall() -> None:
    with pytest.raises(PlacementError, match=r"can hold 20 of 30 layers.*add nodes"):
        plan_layers(30, nodes((1.5, None), (1.5, None)), COST)


def test_bad_plans() -> None:
    with pytest.raises(PlacementError, match="no nodes"):
        plan_layers(4, [], COST)
    with pytest.raises(PlacementError, match="5 nodes but only 4 layers"):
        plan_layers(4, nodes(*[(8, None)] * 5), COST)


def test_explicit_ranges_are_checked() -> None:
    two = nodes((8, None), (1, None))
    check_ranges([(0, 20), (20, 30)], 30, nodes((8, None), (8, None)), COST)
    with pytest.raises(PlacementError, match=r"node n1 has 1\.0 GiB usable but layers 10-29 "
                                             r"need about 2\.4 GiB"):
        check_ranges([(0, 10), (10, 30)], 30, two, COST)
    with pytest.raises(PlacementError, match="expected a stage starting at layer 10"):
        check_ranges([(0, 10), (11, 30)], 30, two, COST)
    with pytest.raises(PlacementError, match="cover layers 0-19 but the model has 30"):
        check_ranges([(0, 10), (10, 20)], 30, two, COST)
    with pytest.raises(PlacementError, match="3 layer ranges given for 2 nodes"):
        check_ranges([(0, 10), (10, 20), (20, 30)], 30, two, COST)


def stage(i: int, size_mib: int) -> StageNeed:
    return StageNeed(i, size_mib * MiB, f"{i:064x}")


def test_assign_puts_stage_zero_on_the_head_and_prefers_cached() -> None:
    stages = [stage(0, 500), stage(1, 500), stage(2, 500)]
    pool = [NodeCapacity("head", 4 * GiB), NodeCapacity("a", 8 * GiB, 50.0),
            NodeCapacity("b", 4 * GiB, 10.0, frozenset({f"{2:064x}"})),
            NodeCapacity("c", 2 * GiB)]
    plan = assign_stages(stages, pool, head="head")
    assert plan[0] == "head" and plan[2] == "b" and plan[1] == "a"


def test_assign_keeps_the_rest_placeable() -> None:
    # the cached node is the only one big enough for the big stage: cache must not win
    stages = [stage(0, 100), stage(1, 3000), stage(2, 1000)]
    pool = [NodeCapacity("head", 1 * GiB), NodeCapacity("big", 4 * GiB, None,
                                                        frozenset({f"{2:064x}"})),
            NodeCapacity("small", int(1.5 * GiB))]
    assert assign_stages(stages, pool, head="head") == {0: "head", 1: "big", 2: "small"}


def test_assign_errors_are_clear() -> None:
    stages = [stage(0, 100), stage(1, 3000)]
    with pytest.raises(PlacementError, match="2 stages but only 1 node"):
        assign_stages(stages, [NodeCapacity("head", GiB)], head="head")
    with pytest.raises(PlacementError, match=r"stage 1 needs about 2\.9 GiB but the roomiest "
                                             r"free node \(a\) has 1\.0 GiB"):
        assign_stages(stages, [NodeCapacity("head", GiB), NodeCapacity("a", GiB)], head="head")
    with pytest.raises(PlacementError, match="node head has 50.0 MiB usable but stage 0"):
        assign_stages(stages, [NodeCapacity("head", 50 * MiB), NodeCapacity("a", 8 * GiB)],
                      head="head")


def test_assign_explicit_pins() -> None:
    stages = [stage(0, 100), stage(1, 100), stage(2, 100)]
    pool = [NodeCapacity("head", GiB), NodeCapacity("a", GiB), NodeCapacity("b", GiB)]
    assert assign_stages(stages, pool, head="head", explicit={1: "b"}) == {
        0: "head", 1: "b", 2: "a"}
    with pytest.raises(PlacementError, match="pinned to zz, which is not enrolled"):
        assign_stages(stages, pool, head="head", explicit={1: "zz"})
    with pytest.raises(PlacementError, match="node a is given more than one stage"):
        assign_stages(stages, pool, head="head", explicit={1: "a", 2: "a"})
    with pytest.raises(PlacementError, match="stage 0 runs on the coordinator"):
        assign_stages(stages, pool, head="head", explicit={0: "a"})
    with pytest.raises(PlacementError, match="stage 7 does not exist"):
        assign_stages(stages, pool, head="head", explicit={7: "a"})


def test_node_memory_uses_gpu_memory_when_reported() -> None:
    devices = [DeviceInfo("CPU", "", 32 * GiB), DeviceInfo("GPU.0", "", 6 * GiB)]
    assert node_memory(devices, 10 * GiB, "CPU", headroom=1.0) == 10 * GiB
    assert node_memory(devices, 10 * GiB, "GPU", headroom=1.0) == 6 * GiB
    assert node_memory([DeviceInfo("GPU")], 10 * GiB, "GPU", headroom=0.5) == 5 * GiB
    assert fmt_bytes(1536) == "1.5 KiB" and fmt_bytes(10) == "10 B"


@pytest.mark.slow
def test_costs_from_a_real_export(tiny_exports) -> None:
    from zctl.manifest import load_manifest

    export: Path = tiny_exports.get([(0, 1), (1, 3), (3, 4)])
    manifest = load_manifest(export)
    cost = LayerCost.from_export(manifest, export, context=128)
    bins = [(export / s.bin).stat().st_size for s in manifest.stages]
    assert cost.layer_bytes == bins[1] // 2  # the middle stage holds two plain layers
    assert cost.first_extra > 0 and cost.last_extra > 0
    # the estimate reproduces the first stage's real size closely
    assert abs(cost.layer_bytes + cost.first_extra - bins[0]) <= 2
    needs = stage_needs(manifest, export, cost)
    assert [n.shard_hash for n in needs] == [manifest.stage_hash(i) for i in range(3)]
    assert all(n.bytes > bins[n.index] for n in needs)
    two = tiny_exports.get([(0, 2), (2, 4)])
    cost2 = LayerCost.from_export(load_manifest(two), two)
    assert abs(cost2.layer_bytes - cost.layer_bytes) / cost.layer_bytes < 0.05


def test_one_node_runs_every_stage_that_fits_it() -> None:
    stages = [stage(0, 500), stage(1, 500), stage(2, 500)]
    assert assign_runs(stages, [NodeCapacity("head", 2 * GiB)], head="head") == dict.fromkeys(
        range(3), "head")
    one = [stage(0, 500)]
    assert assign_runs(one, [NodeCapacity("head", GiB), NodeCapacity("a", GiB)],
                       head="head") == {0: "head"}  # the other node stays a spare


def test_fewer_nodes_than_stages_get_contiguous_runs_lightest_busiest_node() -> None:
    stages = [stage(0, 300), stage(1, 100), stage(2, 100), stage(3, 300)]
    pool = [NodeCapacity("head", 4 * GiB), NodeCapacity("a", 4 * GiB)]
    plan = assign_runs(stages, pool, head="head")
    assert plan == {0: "head", 1: "head", 2: "a", 3: "a"}  # 400 MiB each
    # the roomier node follows the head; a node too small for any run stays a spare
    pool = [NodeCapacity("head", 350 * MiB), NodeCapacity("tiny", 50 * MiB),
            NodeCapacity("big", 4 * GiB)]
    assert assign_runs(stages, pool, head="head") == {0: "head", 1: "big", 2: "big", 3: "big"}


def test_runs_that_fit_no_node_say_what_is_needed_and_what_there_is() -> None:
    stages = [stage(0, 300), stage(1, 300)]
    with pytest.raises(PlacementError, match=r"the export's 2 stages need about 600\.0 MiB in "
                                             r"all but the 1 node\(s\) have head: 500\.0 MiB"):
        assign_runs(stages, [NodeCapacity("head", 500 * MiB)], head="head")
    with pytest.raises(PlacementError, match=r"stage 1 needs about 300\.0 MiB but the roomiest "
                                             r"node \(a\) has 200\.0 MiB"):
        assign_runs([stage(0, 100), stage(1, 300), stage(2, 100)],
                    [NodeCapacity("head", 100 * MiB), NodeCapacity("a", 200 * MiB)], head="head")
    with pytest.raises(PlacementError, match="2 stages but only 1 node"):  # pins: a node each
        assign_runs(stages, [NodeCapacity("head", GiB)], head="head", explicit={0: "head"})


def test_a_paged_stages_sliding_layers_reserve_kv_for_their_window_only(tmp_path: Path) -> None:
    """Placement's KV reserve counts a sliding layer at most the tokens it keeps (paged
    stages), averaged over the layers; without that bound every layer counts the context."""
    from dataclasses import replace

    from dataplane.runtime.synthetic import LayerShape, synthetic_manifest

    base = synthetic_manifest(LayerShape(hidden=64, heads=2, kv_heads=1, head_dim=32,
                                         intermediate=128, vocab=100), 6, True, "fp32")
    stages = (replace(base.stages[0], layer_end=3, bin="s0.bin", first=True, last=False),
              replace(base.stages[0], index=1, layer_start=3, bin="s1.bin"))
    manifest = replace(base, stages=stages, model=replace(
        base.model, sliding_window=512, sliding_layers=(0, 1, 2, 4, 5)))
    for s in stages:
        (tmp_path / s.bin).write_bytes(b"\0" * 1000)
    whole = LayerCost.from_export(manifest, tmp_path, context=4096)
    assert whole.kv_bytes_per_layer == 2 * 32 * 2 * 4096  # keys and values, f16
    window = LayerCost.from_export(manifest, tmp_path, context=4096, sliding_tokens=1088)
    assert window.kv_bytes_per_layer == 2 * 32 * 2 * (4096 + 5 * 1088) // 6
    short = LayerCost.from_export(manifest, tmp_path, context=512, sliding_tokens=1088)
    assert short.kv_bytes_per_layer == 2 * 32 * 2 * 512  # within the window: no saving
