"""tools.decode.curve: a frame's round trip over both data-plane pipes, plain and CURVE."""

from __future__ import annotations

import pytest
import zmq

from tools.decode.curve import round_trip_us


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_bench_curve_measures_both_pipes() -> None:
    assert round_trip_us(True, 40) > 0 and round_trip_us(False, 40) > 0
