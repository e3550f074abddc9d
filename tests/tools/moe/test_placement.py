"""Where the MoE benchmark's processes run: the cores cut per node, the benchmark's own
process on the coordinator's set (no model, no process confined)."""

from __future__ import annotations

import pytest

from tools.moe.placement import bench_placement


def test_split_gives_each_node_its_cores_and_the_bench_the_coordinators() -> None:
    place = bench_placement("split", [0, 1])
    assert place.node_cpus == ("0", "1")
    assert place.bench_cpus == "0"


def test_split_cuts_more_cores_in_contiguous_sets() -> None:
    place = bench_placement("split", [5, 4, 7, 6, 2])
    assert place.node_cpus == ("2,4-5", "6-7")
    assert place.bench_cpus == "2,4-5"


def test_shared_confines_nothing() -> None:
    place = bench_placement("shared", [0, 1])
    assert place.node_cpus == (None, None)
    assert place.bench_cpus is None


@pytest.mark.parametrize("mode, cores, says", [
    ("split", [3], "2 nodes need at least 2 CPUs"),
    ("spread", [0, 1], "placement must be one of shared, split, not 'spread'"),
])
def test_a_placement_that_cannot_be_made_is_refused(mode, cores, says) -> None:
    with pytest.raises(ValueError, match=says):
        bench_placement(mode, cores)
