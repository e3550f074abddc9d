"""The layer ranges a local cluster's export is cut at: the planner's split over processes
that share one machine."""

from __future__ import annotations

import pytest

from controlplane.placement import PlacementError
from controlplane.planner.local_split import local_ranges
from controlplane.planner.presets import PRESETS
from controlplane.planner.references import derive_profile, reference_speed

GiB = 1 << 30


def test_the_stage_with_the_lm_head_gets_fewer_layers() -> None:
    shape = PRESETS["smollm2-135m"]
    profile = derive_profile(reference_speed("xeon-core"), shape, "int8", 16 * GiB)
    ranges = local_ranges(shape, "int8", profile, 2)
    assert ranges[0][0] == 0 and ranges[-1][1] == shape.num_layers
    assert ranges[0][1] == ranges[1][0]
    first, last = (end - start for start, end in ranges)
    assert first > last  # the last stage also runs the LM head
    three = local_ranges(shape, "int8", profile, 3)
    assert len(three) == 3 and all(a[1] == b[0] for a, b in zip(three, three[1:], strict=False))


def test_a_model_that_does_not_fit_the_shared_memory_is_an_error() -> None:
    shape = PRESETS["smollm2-135m"]
    profile = derive_profile(reference_speed("xeon-core"), shape, "int8", 50 << 20)
    with pytest.raises(PlacementError, match="does not fit 2 process"):
        local_ranges(shape, "int8", profile, 2)
    with pytest.raises(PlacementError, match="cannot each take"):
        local_ranges(shape, "int8", profile, shape.num_layers + 1)
