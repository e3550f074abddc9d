"""CANCEL frames (dataplane.wire.cancels): the payload and its checks."""

from __future__ import annotations

import numpy as np
import pytest

from dataplane.wire.cancels import CancelRange, cancel_payload, is_cancel, read_cancel
from dataplane.wire.frames import FrameError, HiddenStateFrame, Kind, decode_frame, encode_frame
from tests.helpers.worker import cancel


def test_payload_round_trip_and_bad_ranges() -> None:
    header, payload = decode_frame(cancel(3, 5, 40))
    assert header.kind == Kind.CANCEL and read_cancel(payload) == CancelRange(3, 5, 40)
    assert read_cancel(cancel_payload(4, 3, 7)) == CancelRange(4, 3, 7)  # no step: a rewind
    for bad in ((-1, 2, 3), (5, 3, 1), (1, 2, -1)):
        with pytest.raises(ValueError, match="inconsistent"):
            cancel_payload(*bad)
    with pytest.raises(ValueError, match="int64"):
        read_cancel(np.zeros(2, np.int64))
    assert is_cancel(cancel(0, 0, 1))
    assert not is_cancel(encode_frame(HiddenStateFrame(Kind.RESET, 0, 0, 1)))
    assert not is_cancel([b"short"]) and not is_cancel([])


@pytest.mark.parametrize("payload", [None, np.zeros(3, np.float32), np.zeros(4, np.int64)])
def test_a_cancel_frame_carries_exactly_its_three_int64s(payload) -> None:
    with pytest.raises(FrameError, match="CANCEL"):
        decode_frame(encode_frame(HiddenStateFrame(Kind.CANCEL, 0, 0, 1), payload))
