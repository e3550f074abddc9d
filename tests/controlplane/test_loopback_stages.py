"""The later stages over real loopback sockets, as the coordinator's thread meets them."""

from __future__ import annotations

import time

import numpy as np
import pytest

from controlplane.loopback_stages import LoopbackStages, reply
from dataplane.wire.frames import HiddenStateFrame, Kind


def _step(rows: int, tokens: int, ids: np.ndarray) -> tuple[HiddenStateFrame, np.ndarray]:
    hidden = np.zeros((rows, tokens, 4), np.float32)
    hidden[:, :, 0] = ids
    header = HiddenStateFrame(Kind.STEP, 3, 1, 0, positions=np.arange(rows * tokens),
                              rows=rows)
    return header, hidden


def test_each_row_is_answered_with_its_last_token_plus_one_modulo_the_vocabulary() -> None:
    header, hidden = _step(2, 3, np.array([[1, 2, 9], [4, 5, 6]]))
    back, records = reply(header, hidden, 4, vocab=10)
    assert back.kind == Kind.REPLY and back.stream_id == 3
    assert list(records["token"][:, 0]) == [0, 0, 7, 7]  # 2 positions a row


def test_a_step_goes_over_the_sockets_and_its_wait_is_not_the_callers_cpu() -> None:
    with LoopbackStages(vocab=100) as stages:
        header, hidden = _step(1, 1, np.array([[41]]))
        assert list(stages.step(header, hidden, 1, 0.0)) == [42]
        cpu, wall = time.thread_time(), time.perf_counter()
        header, hidden = _step(3, 1, np.array([[1], [2], [99]]))
        assert list(stages.step(header, hidden, 3, 0.05)) == [2, 3, 0]
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    assert wall >= 0.05  # the later stages' step was waited out
    assert cpu < wall / 2  # asleep in the kernel meanwhile


def test_a_vocabulary_of_one_token_is_refused() -> None:
    with pytest.raises(ValueError, match=">= 2"):
        LoopbackStages(vocab=1)
