"""Sessions on real stages pipelined across stage processes, or batched as the rows of one
inference per stage, produce exactly what each produces alone."""

from __future__ import annotations

import numpy as np
import pytest

from tests.zctl.engine.test_sessions import PROMPTS, N, alone, interleaved
from zctl.engine.executor import Step
from zctl.engine.scheduler import StreamScheduler, generate_greedy
from zctl.engine.sessions import DecodeSession


@pytest.fixture(scope="module")
def export2(tiny_exports):
    return tiny_exports.get([(0, 2), (2, 4)])


@pytest.mark.parametrize("speculative", [False, True])
def test_pipelined_streams_across_processes_equal_each_alone(export2, dp_hosts, dp_spawn,
                                                             speculative) -> None:
    from tests.dataplane.head.test_cluster_head import chain_in_processes

    pipe = chain_in_processes(export2, dp_hosts, dp_spawn, 2)
    try:
        want = [alone(pipe, p, speculative) for p in PROMPTS]
        assert interleaved(pipe, speculative) == want
        assert pipe.stats.errors == 0 and pipe.stats.timeouts == 0
    finally:
        pipe.close()


@pytest.mark.parametrize("row_groups", [1, 2])
def test_row_groups_across_processes_equal_each_alone(export2, dp_hosts, dp_spawn,
                                                      row_groups) -> None:
    """Greedy streams and a speculative one batched as rows of one inference per stage
    (joining after their prefill, leaving as they finish, padded and rewound per row)."""
    from tests.dataplane.head.test_cluster_head import chain_in_processes

    pipe = chain_in_processes(export2, dp_hosts, dp_spawn, 2)
    try:
        lengths = [N, N - 5, N + 3, N - 9]
        want = [list(generate_greedy(pipe, p, n, prefill_chunk=4))
                for p, n in zip(PROMPTS, lengths, strict=True)]
        want_spec = alone(pipe, PROMPTS[1], speculative=True)
        sessions = [DecodeSession(10 + i, p, n, prefill_chunk=4)
                    for i, (p, n) in enumerate(zip(PROMPTS, lengths, strict=True))]
        spec = DecodeSession(20, PROMPTS[1], N, k=3, prefill_chunk=4)
        pipe.compact_threshold = 2  # re-form groups (compacting rows) as padding piles up
        scheduler = StreamScheduler(pipe, row_groups)
        for session in [*sessions, spec]:
            scheduler.add(session)
        while scheduler.active:
            for update in scheduler.poll():
                assert update.session.error is None, update.session.error
        assert [s.emitted for s in sessions] == want and spec.emitted == want_spec
        assert scheduler.rows_stepped > scheduler.row_steps > 0  # some steps carried 2+ rows
        assert pipe.compactions > 0
        assert not pipe.stage0.groups  # finished rows left; empty groups were disbanded
        assert pipe.stats.errors == 0 and pipe.stats.timeouts == 0
        # bad regroups are refused before anything is sent, and the pipeline keeps serving
        from dataplane.head.errors import DataPlaneError
        from dataplane.runtime.base import StageError
        from zctl.engine.row_groups import GROUP_ID_BASE

        with pytest.raises(StageError, match="not open"):
            pipe.regroup(GROUP_ID_BASE, [99])
        pipe.open(30)
        pipe.reset(30)
        rid = pipe.submit(Step(30, np.array(PROMPTS[0]), np.arange(len(PROMPTS[0]))))
        with pytest.raises(DataPlaneError, match="in flight"):
            pipe.regroup(GROUP_ID_BASE, [30])
        pipe.collect(rid)
        assert list(generate_greedy(pipe, PROMPTS[0], N, prefill_chunk=4)) == want[0][:N]
    finally:
        pipe.close()
