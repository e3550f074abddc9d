"""Cumulative metrics for a metrics scrape (dataplane.head.metrics): histogram buckets, the
batch derivation of compute and network time, folding samples in, and a cluster head's
per-stage, per-hop counts and bytes against what really crossed each hop."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

import dataplane.head.cluster_head as cluster_module
import dataplane.worker.stage_worker as worker_module
from dataplane.head.cluster_head import ClusterHead
from dataplane.head.metrics import (
    DEFAULT_BOUNDS_MS,
    CumulativeHistogram,
    StepMetrics,
    hop_names,
)
from dataplane.runtime.stateful import StageRunner
from dataplane.wire.frames import TIMING, frame_bytes
from dataplane.wire.timing import TimingStamps, derive_compute_network, derive_step_timing
from dataplane.worker.stage_worker import StageWorker
from tests.helpers.control import wait_for
from zctl.engine.scheduler import generate_greedy


def test_histogram_buckets_are_upper_bounds_inclusive() -> None:
    values = [0.5, 1.0, 1.0001, 2.0, 5.0, 7.0, -1.0]
    one, many = CumulativeHistogram((1, 2, 5)), CumulativeHistogram((1, 2, 5))
    for v in values:
        one.observe(v)
    many.observe_many(np.array(values))
    for h in (one, many):
        # a value equal to a bound is in that bound's bucket (Prometheus' le); above the
        # last bound: +Inf
        assert h.counts == [3, 2, 1, 1] and h.count == 7
        assert h.total == pytest.approx(sum(values))
    one.merge(many)
    assert one.counts == [6, 4, 2, 2] and one.total == pytest.approx(2 * sum(values))
    assert many.copy().counts == many.counts
    many.observe_many(np.array([]))
    assert many.count == 7
    for bad in ((), (1, 1), (2, 1), (1, float("inf"))):
        with pytest.raises(ValueError):
            CumulativeHistogram(bad)
    with pytest.raises(ValueError, match="different bounds"):
        one.merge(CumulativeHistogram((1, 2)))
    assert DEFAULT_BOUNDS_MS[0] == 0.05 and DEFAULT_BOUNDS_MS[-1] == 10_000
    assert list(DEFAULT_BOUNDS_MS) == sorted(set(DEFAULT_BOUNDS_MS))


def random_stamps(rng: random.Random, stages: int) -> TimingStamps:
    """A reply's stamps with random gaps, some of them negative (clocks of two machines)."""
    t = rng.randrange(10**18)
    records = b""
    for s in range(stages):
        recv = t + rng.randrange(-50_000, 2_000_000)
        ready = recv + rng.randrange(-500_000, 500_000)
        send = recv + rng.randrange(0, 5_000_000)
        records += TIMING.pack(s, recv, ready, send, rng.randrange(10**5), rng.randrange(10**7),
                               rng.randrange(10**5))
        t = send
    recv = t + rng.randrange(-50_000, 2_000_000)
    return TimingStamps(records, recv, recv - rng.randrange(-10**6, 10**6), 1000, t - 10**7,
                        recv + 10**5)


@pytest.mark.parametrize("stages", [1, 2, 4])
def test_batch_derivation_equals_derive_step_timing(stages: int) -> None:
    rng = random.Random(stages)
    stamps = [random_stamps(rng, stages) for _ in range(200)]
    compute, network = derive_compute_network(stamps)
    assert compute.shape == network.shape == (200, stages)
    for row, s in enumerate(stamps):
        timing = derive_step_timing(*s)
        assert compute[row].tolist() == list(timing.compute_ms)
        assert network[row].tolist() == [h.network_ms for h in timing.hops]
    with pytest.raises(ValueError, match="without timing records"):
        derive_compute_network([TimingStamps(b"", 0, 0, 0, 0, 0)])


def test_step_figures_fold_samples_in_without_losing_any(monkeypatch) -> None:
    monkeypatch.setattr(StepMetrics, "DRAIN_AT", 64)
    rng = random.Random(7)
    metrics = StepMetrics(3, hops=True)
    stamps = [random_stamps(rng, 3) for _ in range(150)]
    for s in stamps:
        metrics.add_stamps(s)
    assert metrics.backlog == 150 - 128  # folded in at 64 and 128
    metrics.drain_when_idle()
    assert metrics.backlog == 22  # fewer than IDLE_DRAIN_AT wait for more
    metrics.drain()
    compute, network = derive_compute_network(stamps)
    for i in range(3):
        expected = CumulativeHistogram()
        expected.observe_many(compute[:, i])
        assert metrics.compute[i].counts == expected.counts and metrics.compute[i].count == 150
        assert metrics.compute[i].total == pytest.approx(expected.total)
        assert metrics.network[i].count == 150
    metrics.sent_bytes, metrics.received_bytes, metrics.step_frames = 1000, 300, 10
    assert metrics.hop_bytes() == [1000, 1000 + 10 * TIMING.size, 300]
    assert hop_names(3) == ["0-1", "1-2", "2-c"] and hop_names(2) == ["0-1", "1-c"]
    local = StepMetrics(2, hops=False)
    local.add_stage_ms([1.0, 2.0])
    local.add_stage_ms([3.0, 4.0])
    local.absorb(metrics)  # takes the stage and the hops it did not have
    assert [h.count for h in local.compute] == [152, 152, 150]
    assert local.hop_bytes() == metrics.hop_bytes() and metrics.backlog == 0


@pytest.fixture
def counted_sends(monkeypatch) -> dict[int, int]:
    """Bytes every data socket sent, by id(socket), counted where the frames leave."""
    sent: dict[int, int] = {}
    for module in (cluster_module, worker_module):
        real = module.send_parts

        def counting(sock: Any, parts: Any, real: Any = real) -> Any:
            tracker = real(sock, parts)
            sent[id(sock)] = sent.get(id(sock), 0) + frame_bytes(parts)
            return tracker

        monkeypatch.setattr(module, "send_parts", counting)
    return sent


def test_head_figures_count_every_step_and_every_byte_of_three_hops(dp_export3,
                                                                     counted_sends) -> None:
    pipe = ClusterHead(StageRunner(dp_export3, 0), "tcp://127.0.0.1:1", "tcp://127.0.0.1:*",
                       timeout_s=10)
    last = StageWorker(StageRunner(dp_export3, 2), "tcp://127.0.0.1:*", pipe.reply_endpoint)
    middle = StageWorker(StageRunner(dp_export3, 1), "tcp://127.0.0.1:*", last.endpoint)
    pipe.rewire(middle.endpoint)
    workers = [middle.start(), last.start()]
    try:
        tokens = list(generate_greedy(pipe, [0, 17, 42, 99, 5], 8, prefill_chunk=2))
        # the scheduler closed the stream: its CLOSE frame has passed every stage
        wait_for(lambda: last.stats().closes == 1, what="the close to pass every stage")
        metrics = pipe.metrics
        metrics.drain()
        replies = pipe.stats.replies
        assert len(tokens) == 8 and replies == 3 + 7  # three prefill chunks, seven decodes
        assert [h.count for h in metrics.compute] == [replies] * 3
        assert [h.count for h in metrics.network] == [replies] * 3
        # hop 0-1 and the last hop are counted as they pass; the middle one is estimated
        # from hop 0-1, exactly when nothing is dropped
        assert metrics.hop_bytes() == [counted_sends[id(pipe._push)],
                                       counted_sends[id(middle._push)],
                                       counted_sends[id(last._push)]]
        assert metrics.hop_bytes()[0] > replies * 64 * 4  # hidden states of 64 floats
    finally:
        for worker in workers:
            worker.stop()
        pipe.close()
