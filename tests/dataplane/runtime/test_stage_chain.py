"""StageChain: consecutive stages run as one, on a node that took a lost neighbour's
stages (a worker) or on the coordinator once it runs them all (the head answers steps
itself); the tokens are those of the whole pipeline."""

from __future__ import annotations

import numpy as np
import pytest

from dataplane.head.cluster_head import ClusterHead
from dataplane.head.local_chain import LocalChain
from dataplane.runtime.base import StageError
from dataplane.runtime.config import RuntimeSpec
from dataplane.runtime.load import load_runner
from dataplane.runtime.stage_chain import StageChain, chain_spec
from tests.helpers.worker import head_and_worker
from zctl.engine.scheduler import generate_greedy, generate_speculative, run_sessions
from zctl.engine.sessions import DecodeSession

EXACT = dict(precision="f32", kv_cache_precision="f32", dynamic_quantization=False)
PROMPTS = [[0, *range(5, 60)], [0, 9, 8, 7, 9, 8, 7], [0, *range(30, 41)]]
N = 12


@pytest.fixture(scope="module", params=[False, True], ids=["stateful", "paged"])
def config(request):
    return RuntimeSpec(**EXACT, paged_attention=request.param)


@pytest.fixture(scope="module")
def want(dp_export3, config):
    chain = LocalChain.load(str(dp_export3), config)
    return [list(generate_greedy(chain, p, N, stream_id=40 + i)) for i, p in enumerate(PROMPTS)]


def _runners(export, stages, config):
    return [load_runner(export, i, config) for i in stages]


def test_a_worker_runs_two_stages_as_one(dp_export3, config, want) -> None:
    chain = StageChain(_runners(dp_export3, (1, 2), config))
    assert (chain.spec.index, chain.last_index, chain.spec.last) == (1, 2, True)
    assert (chain.spec.layer_start, chain.spec.layer_end) == (2, 4)
    with head_and_worker(load_runner(dp_export3, 0, config), chain) as (head, _):
        assert list(generate_greedy(head, PROMPTS[0], N)) == want[0]
        sessions = [DecodeSession(i, p, N, k=3 if i == 1 else 0, prefill_chunk=8)
                    for i, p in enumerate(PROMPTS)]
        list(run_sessions(head, sessions, row_groups=1))
        assert [s.emitted for s in sessions] == want


def test_the_head_answers_itself_once_it_runs_every_stage(dp_export3, config, want) -> None:
    head = ClusterHead(load_runner(dp_export3, 0, config), "tcp://127.0.0.1:1",
                       "tcp://127.0.0.1:*", timeout_s=10)
    try:
        assert not head.answers_here
        head.rewire("tcp://127.0.0.1:1", stage0=StageChain(_runners(dp_export3, (0, 1, 2), config)))
        assert head.answers_here
        assert list(generate_greedy(head, PROMPTS[0], N)) == want[0]
        assert list(generate_speculative(head, PROMPTS[1], N, k=3)) == want[1]
        sessions = [DecodeSession(i, p, N, prefill_chunk=8) for i, p in enumerate(PROMPTS)]
        list(run_sessions(head, sessions, row_groups=1))
        assert [s.emitted for s in sessions] == want
        head.open(7)
        head.reset(7)
        reply = head.step(7, np.array(PROMPTS[2]), np.arange(len(PROMPTS[2])), want_logits=True,
                          top_k=4)
        assert reply.logits.shape[0] == 1 and reply.top.shape == (1, 4)
        assert int(reply.tokens[0]) == int(reply.top["token"][0, 0])
    finally:
        head.close()


def test_only_consecutive_stages_chain(dp_export3, config) -> None:
    runners = _runners(dp_export3, (0, 2), config)
    with pytest.raises(StageError, match="do not follow each other"):
        StageChain(runners)
    with pytest.raises(StageError, match="at least one stage"):
        chain_spec([])
    with pytest.raises(ValueError, match="runs stage 0"):
        head = ClusterHead(runners[0], "tcp://127.0.0.1:1", "tcp://127.0.0.1:*")
        try:
            head.rewire("tcp://127.0.0.1:1", stage0=StageChain(_runners(dp_export3, (1, 2),
                                                                         config)))
        finally:
            head.close()


def test_a_chain_prepared_then_run_answers_as_it_steps_and_rewinds_every_stage(
        dp_export3, config) -> None:
    stepped = StageChain(_runners(dp_export3, (0, 1, 2), config))
    bound = StageChain(_runners(dp_export3, (0, 1, 2), config))
    ids = np.array([PROMPTS[2]])
    positions = np.arange(ids.shape[1])
    for chain in (stepped, bound):
        chain.open_stream(3)
        chain.reset_stream(3)
    want = stepped.step(3, ids, positions).copy()
    prepared = bound.prepare(3, positions[None])
    assert len(prepared) == 3  # one prepared step per stage
    got = bound.run(3, ids, prepared).data.reshape(want.shape)
    assert np.allclose(got, want, atol=1e-5)
    assert [r.kept_tokens(3) for r in bound.runners] == [ids.shape[1]] * 3
    bound.trim_tail(3, 1)
    assert [r.kept_tokens(3) for r in bound.runners] == [ids.shape[1] - 1] * 3
    bound.mask_tail(3, 2)
    assert [r.kept_tokens(3) for r in bound.runners] == [ids.shape[1] - 3] * 3
    with pytest.raises(StageError):
        bound.mask_tail(3, ids.shape[1])  # more than it holds
