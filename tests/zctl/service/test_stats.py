"""The generation service's stats snapshot: metrics of both executors, the stages' KV
slots (the nodes' over heartbeats), the coordinator's view of the nodes, and the
request/reply on the service's socket. (Of a local cluster of processes:
tests/e2e/test_local_clusters.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from controlplane import messages as m
from dataplane.head.local_chain import LocalChain
from dataplane.head.metrics import StepMetrics
from dataplane.runtime.config import RuntimeSpec
from tests.helpers.control import Cluster, FakeStage, node, wait_for
from tests.zctl.service.test_server import SlowChain, raw_client
from zctl.engine.core import GenerationEngine
from zctl.engine.requests import GenerationDone, GenerationRequest
from zctl.engine.tokenizer import ChatTokenizer
from zctl.manifest import load_manifest
from zctl.service.client import generate_stream, query_service_stats
from zctl.service.errors import ServiceUnavailable
from zctl.service.messages import ServiceStats
from zctl.service.server import GenerationService
from zctl.service.stats import COORDINATOR, NOT_WIRED, StatsCollector

PROMPT = "one two three one two three one two"


# -- the service on an in-process chain ---------------------------------------------------
@pytest.fixture
def export(tiny_exports) -> Path:
    return tiny_exports.get([(0, 2), (2, 4)])


def test_stats_of_a_local_chain_after_generations(export: Path) -> None:
    chain = LocalChain.load(str(export), RuntimeSpec(precision="f32"))
    steps: list[int] = []
    compute = chain.compute
    chain.compute = lambda step: steps.append(1) or compute(step)  # type: ignore[method-assign]
    svc = GenerationService(export, lambda: chain, "tcp://127.0.0.1:*")
    svc.start()
    try:
        # greedy: the prompt's n-grams are sure to be drafted from
        plain = list(generate_stream(svc.endpoint, GenerationRequest(
            "g", "hello", 6, temperature=0.0)))[-1]
        spec = list(generate_stream(svc.endpoint, GenerationRequest(
            "s", PROMPT, 16, ignore_eos=True, speculative="lookup", k=3, temperature=0.0)))[-1]
        stats = query_service_stats(svc.endpoint)
    finally:
        svc.stop()
    assert isinstance(plain, GenerationDone) and isinstance(spec, GenerationDone) and spec.spec
    manifest = load_manifest(export)
    assert (stats.model, stats.max_context, stats.num_stages) == (
        manifest.model.name, manifest.model.max_position_embeddings, 2)
    assert (stats.running, stats.waiting, stats.health) == (0, 0, "")
    counters = stats.counters
    assert counters["requests"] == 2 and counters["failed"] == counters["malformed"] == 0
    assert counters["peak_streams"] == 1
    drafted, accepted = counters["spec_drafted"], counters["spec_accepted"]
    assert drafted > 0 and 0 <= accepted <= drafted
    assert accepted / drafted == pytest.approx(spec.spec["acceptance"], abs=1e-4)
    # one compute sample per stage per step (no frames in process: no hops)
    assert [s.index for s in stats.stages] == [0, 1] and stats.hops == []
    for stage in stats.stages:
        assert (stage.node_id, stage.up, stage.kv_slots) == (COORDINATOR, True, 0)
        assert sum(stage.compute_ms.counts) == len(steps) and stage.compute_ms.total > 0
        assert len(stage.compute_ms.counts) == len(stage.compute_ms.bounds) + 1
    assert stats.nodes == {COORDINATOR: True}


def test_stats_while_generating_show_running_waiting_and_kv_slots(export: Path) -> None:
    chain = SlowChain(LocalChain.load(str(export), RuntimeSpec(precision="f32")))
    svc = GenerationService(export, lambda: chain, "tcp://127.0.0.1:*", max_streams=1)
    svc.start()
    try:
        with raw_client(svc.endpoint) as sock:
            for rid in ("a", "b"):
                sock.send_multipart(m.to_frames(GenerationRequest(rid, "the sky is", 200,
                                                                ignore_eos=True)))
            wait_for(lambda: svc.engine.active == 1 and svc.engine.waiting == 1, what="a queue")
            stats = query_service_stats(svc.endpoint)
            assert (stats.running, stats.waiting) == (1, 1)
            assert all(s.kv_slots > 3 for s in stats.stages)  # the prompt and tokens so far
            assert sum(stats.stages[0].compute_ms.counts) >= 1
    finally:
        svc.stop()


def test_a_malformed_stats_request_gets_an_error_and_serving_goes_on(export: Path) -> None:
    chain = LocalChain.load(str(export), RuntimeSpec(precision="f32"))
    failing: list[bool] = []

    def cluster() -> Any:
        if failing:
            raise RuntimeError("no view")
        return None

    svc = GenerationService(export, lambda: chain, "tcp://127.0.0.1:*", cluster=cluster)
    svc.start()
    try:
        with raw_client(svc.endpoint) as sock:
            sock.send_multipart([json.dumps({"protocol": m.PROTOCOL_VERSION, "type": "service_stats_request",
                                             "body": {"detail": True}}).encode()])
            assert sock.poll(5000)
            reply, _ = m.from_frames(sock.recv_multipart())
            assert isinstance(reply, m.Error) and reply.code == "bad-request"
            assert "unknown field(s) 'detail'" in reply.detail
            failing.append(True)  # gathering fails: an Error, and the service goes on
            with pytest.raises(ServiceUnavailable, match="refused: stats failed: RuntimeError"):
                query_service_stats(svc.endpoint)
            failing.clear()
            done = list(generate_stream(svc.endpoint, GenerationRequest("x", "hello", 3)))[-1]
            assert isinstance(done, GenerationDone) and done.tokens and not done.error
            stats = query_service_stats(svc.endpoint)
            assert stats.counters["malformed"] == 1 and stats.counters["requests"] == 1
    finally:
        svc.stop()
    with pytest.raises(ServiceUnavailable, match="no answer from the generation service"):
        query_service_stats("tcp://127.0.0.1:1", timeout=0.3)


class FakeExecutor:
    def __init__(self, samples: int) -> None:
        self.metrics = StepMetrics(2, hops=False)
        for _ in range(samples):
            self.metrics.add_stage_ms([1.0, 2.0])

    def kv_slots(self) -> dict[int, int]:
        return {0: 5, 1: 6}


def test_metrics_of_a_replaced_executor_are_kept(export: Path) -> None:
    current: list[Any] = [None]
    engine = GenerationEngine(ChatTokenizer(export), [], lambda: current[0])
    collector = StatsCollector(load_manifest(export), engine, lambda: current[0])
    stats = collector.snapshot({})
    assert stats.health == NOT_WIRED and [s.kv_slots for s in stats.stages] == [-1, -1]
    assert [s.up for s in stats.stages] == [False, False]
    first = current[0] = FakeExecutor(3)
    assert sum(collector.snapshot({}).stages[1].compute_ms.counts) == 3
    first.metrics.add_stage_ms([1.0, 2.0])  # after the last snapshot, before it is replaced
    current[0] = FakeExecutor(10)  # the coordinator re-wired: a new head
    stats = collector.snapshot({})
    assert [sum(s.compute_ms.counts) for s in stats.stages] == [14, 14]
    assert stats.stages[1].compute_ms.total == pytest.approx(28.0)
    assert [s.kv_slots for s in stats.stages] == [5, 6] and stats.health == ""


# -- over a cluster head -------------------------------------------------------------------
def test_kv_slots_on_both_sides_of_a_hop(dp_threaded2) -> None:
    pipe, worker = dp_threaded2
    pipe.open(0)
    pipe.reset(0)
    pipe.step(0, np.array([0, 8, 9, 10, 11]), np.arange(5))
    pipe.step(0, np.array([12]), np.array([5]))
    assert pipe.kv_slots() == {0: 6} and worker.kv_slots() == 6
    pipe.close_stream(0)
    wait_for(lambda: worker.kv_slots() == 0, what="stage 1 to free the stream")
    assert pipe.kv_slots() == {0: 0}
    pipe.retire()  # handed on to the pipeline that replaces it: it holds none of them
    assert pipe.kv_slots() == {}


def test_service_stats_over_a_cluster_head(dp_threaded2, dp_export2) -> None:
    pipe, _ = dp_threaded2
    svc = GenerationService(dp_export2, lambda: pipe, "tcp://127.0.0.1:*")
    svc.start()
    try:
        done = list(generate_stream(svc.endpoint, GenerationRequest("c", "the sky is", 10,
                                                                  ignore_eos=True)))[-1]
        stats = query_service_stats(svc.endpoint)
    finally:
        svc.stop()
    assert isinstance(done, GenerationDone) and len(done.tokens) == 10
    replies = pipe.stats.replies
    assert replies == 10  # the prompt, then nine decode steps
    assert [sum(s.compute_ms.counts) for s in stats.stages] == [replies, replies]
    assert [s.node_id for s in stats.stages] == [COORDINATOR, ""]
    assert [s.kv_slots for s in stats.stages] == [0, -1]  # stage 1's node is not known here
    assert [h.name for h in stats.hops] == ["0-1", "1-c"]
    assert [sum(h.network_ms.counts) for h in stats.hops] == [replies, replies]
    assert all(h.bytes > 0 for h in stats.hops) and stats.hops[0].bytes > replies * 64 * 4
    assert stats.hops[0].bytes == pipe.metrics.sent_bytes
    assert stats.hops[1].bytes == pipe.metrics.received_bytes


# -- nodes report their KV slots; the coordinator's view --------------------------------
def test_heartbeat_kv_slots_round_trip_and_old_heartbeats_decode() -> None:
    beat = m.Heartbeat("enrolled", 123)
    assert m.from_frames(m.to_frames(beat))[0] == beat
    old = json.dumps({"protocol": m.PROTOCOL_VERSION, "type": "heartbeat", "body": {"state": "x"}}).encode()
    assert m.decode_message(old) == m.Heartbeat("x", -1)
    with pytest.raises(m.MessageError, match="kv_slots must be >= -1"):
        m.decode_message(m.encode_message(m.Heartbeat("x", -2)))


class CountingStage(FakeStage):
    """A launched stage that says it holds ``slots`` KV slots."""

    slots = 42

    def kv_slots(self) -> int:
        return self.slots


def test_a_nodes_kv_slots_reach_the_services_stats(cp_cluster: Cluster, cp_export) -> None:
    coord = cp_cluster.coordinator()
    agent = cp_cluster.agent(coord.endpoint, launcher=CountingStage)
    coord.wait_serving(20)
    wait_for(lambda: node(coord.status(), agent.node_id).kv_slots == 42, what="a heartbeat")
    svc = GenerationService(cp_export, lambda: None, "tcp://127.0.0.1:*", cluster=coord.status)
    svc.start()
    try:
        stats = query_service_stats(svc.endpoint)
        assert isinstance(stats, ServiceStats) and stats.health == NOT_WIRED
        assert [(s.node_id, s.up, s.kv_slots) for s in stats.stages] == [
            (COORDINATOR, True, -1), (agent.node_id, True, 42)]
        assert stats.nodes == {COORDINATOR: True, agent.node_id: True}
        CountingStage.slots = 7
        wait_for(lambda: query_service_stats(svc.endpoint).stages[1].kv_slots == 7,
                 what="the next heartbeat")
        agent.stop()  # it leaves: down, and its last figure is forgotten
        wait_for(lambda: not query_service_stats(svc.endpoint).nodes[agent.node_id],
                 what="the node to be down")
        stats = query_service_stats(svc.endpoint)
        assert (stats.stages[1].up, stats.stages[1].kv_slots) == (False, -1)
    finally:
        CountingStage.slots = 42
        svc.stop()
