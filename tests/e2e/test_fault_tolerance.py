"""A node killed mid-generation: the generation pauses, and resumes where it was with the
same tokens as a run nothing happened to: once the node comes back (a new process with
the same state dir reclaims its id; healing off), or at once on the survivors (healing,
the default). A node process killed is marked dead, and started again it reclaims its id
and serves from its cached shard. Real processes on loopback addresses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from controlplane.client import query_status
from dataplane.head.local_chain import LocalChain
from dataplane.runtime.config import RuntimeSpec
from tests.helpers.control import Cluster
from tests.helpers.generating import generating_client
from tests.helpers.repo import ROOT
from zctl.engine.requests import GenerationDone, GenerationRequest
from zctl.engine.scheduler import generate_greedy
from zctl.engine.tokenizer import ChatTokenizer
from zctl.launcher.local import _spawn, start_local_cluster, stop_processes, wait_serving
from zctl.launcher.processes import NodeProcess, link_shape, process_command, runtime_spec
from zctl.service.client import generate_many

DELAY_MS = 15  # per hop: a token takes >= 45 ms on 3 stages, time to kill a node mid-run
TOKENS = 60


@pytest.mark.parametrize("streams", [1, 2])
def test_a_killed_node_that_comes_back_resumes_the_generation_exactly(
        tiny_exports, tmp_path: Path, streams: int) -> None:
    """With 2 streams the local cluster batches them in a row group (shared cores), which
    the outage dissolves on stage 0 and the resumed schedule forms again on every stage."""
    export_dir = tiny_exports.get([(0, 1), (1, 3), (3, 4)])
    prompts = ["the sky is", "one two three one two three"][:streams]
    requests = [GenerationRequest(uuid.uuid4().hex[:16], p, TOKENS, ignore_eos=True, temperature=0.0)
                for p in prompts]
    expected = _fault_free(export_dir, requests)
    root = tmp_path / "cluster"
    record = start_local_cluster(export_dir, 3, EXACT, root, link_delay_ms=DELAY_MS,
                                 heal_after=None)
    try:
        wait_serving(record, 120)
        messages: list = []
        client = _kill_mid_generation(record, requests, messages, 2,  # the node on 127.0.0.3
                                      "at 127.0.0.3 stopped answering")
        # the node restarts with its state dir: same id, shard cached, re-wired
        record.pids.append(_spawn(NodeProcess(
            record.control, host="127.0.0.3", state_dir=str(root / "node2"),
            reconnect_min=0.2, link=link_shape(DELAY_MS)), root / "logs" / "node2-again.log"))
        client.join(120)
        assert not client.is_alive()
        dones = {m.request_id: m for m in messages if isinstance(m, GenerationDone)}
        assert [dones[r.request_id].error for r in requests] == [""] * streams
        assert [dones[r.request_id].tokens for r in requests] == expected
        notes = [m.note for m in messages if getattr(m, "note", "")]
        assert notes[-1].startswith("resumed after "), notes
    finally:
        stop_processes(record.pids)


@pytest.mark.parametrize("node", [1, 2])
def test_a_killed_node_heals_onto_the_survivors_with_the_same_tokens(
        tiny_exports, tmp_path: Path, node: int) -> None:
    """No spare and no restart: the killed node's stage goes to a neighbour (the middle
    node's to the coordinator or the last node, the last node's to the middle one), which
    fetches its shard; the generation resumes there and ends with the tokens of a run
    nothing happened to."""
    export_dir = tiny_exports.get([(0, 1), (1, 3), (3, 4)])
    requests = [GenerationRequest(uuid.uuid4().hex[:16], "the sky is", TOKENS, ignore_eos=True,
                                  temperature=0.0)]
    expected = _fault_free(export_dir, requests)
    record = start_local_cluster(export_dir, 3, EXACT, tmp_path / "cluster",
                                 link_delay_ms=DELAY_MS)
    try:
        wait_serving(record, 120)
        messages: list = []
        client = _kill_mid_generation(record, requests, messages, node)
        client.join(120)
        assert not client.is_alive()
        (done,) = [m for m in messages if isinstance(m, GenerationDone)]
        assert done.error == "" and done.tokens == expected[0]
        notes = [m.note for m in messages if getattr(m, "note", "")]
        assert notes[-1].startswith("resumed after "), notes  # (the first note said paused)
        status = wait_serving(record, 30)
        hosts = {s.node_id for s in status.stages}
        assert len(hosts) == 2 and status.pipeline == "serving"  # 2 of 3 nodes carry on
    finally:
        stop_processes(record.pids)


def test_a_node_back_after_a_heal_takes_its_stage_back_mid_generation(
        tiny_exports, tmp_path: Path) -> None:
    """The last node is lost and the middle one carries its stage; restarted, the node takes
    its stage back while a generation runs, which pauses for the re-wiring and ends with
    the tokens of a run nothing happened to, on a stage per node again."""
    export_dir = tiny_exports.get([(0, 1), (1, 3), (3, 4)])
    long = GenerationRequest(uuid.uuid4().hex[:16], "the sky is", 420, ignore_eos=True,
                             temperature=0.0)
    expected = _fault_free(export_dir, [long], 420)
    root = tmp_path / "cluster"
    record = start_local_cluster(export_dir, 3, EXACT, root, link_delay_ms=DELAY_MS)
    try:
        spread = {s.node_id for s in wait_serving(record, 120).stages}
        os.killpg(record.pids[2], signal.SIGKILL)
        healed = _wait_status(record, lambda st: len({s.node_id for s in st.stages}) == 2
                              and st.pipeline == "serving")
        messages: list = []
        client = generating_client(record.serve, [long], messages)
        record.pids.append(_spawn(NodeProcess(
            record.control, host="127.0.0.3", state_dir=str(root / "node2"),
            reconnect_min=0.2, link=link_shape(DELAY_MS)), root / "logs" / "node2-again.log"))
        client.join(120)
        (done,) = [m for m in messages if isinstance(m, GenerationDone)]
        assert done.error == "" and done.tokens == expected[0]
        notes = [m.note for m in messages if getattr(m, "note", "")]
        assert notes and notes[-1].startswith("resumed after "), notes  # it was re-wired
        status = _wait_status(record, lambda st: st.pipeline == "serving")
        assert {s.node_id for s in status.stages} == spread and status.epoch > healed.epoch
    finally:
        stop_processes(record.pids)


def test_a_request_sent_right_after_a_node_is_killed_waits_for_the_heal(
        tiny_exports, tmp_path: Path) -> None:
    """The request comes before the cluster noticed its stage-1 node was killed: its
    stream's reset finds no one taking frames, and the request is held (paused), not
    refused, until the stage is healed onto the survivors; it ends with the tokens of a run
    nothing happened to."""
    export_dir = tiny_exports.get([(0, 1), (1, 3), (3, 4)])
    request = GenerationRequest(uuid.uuid4().hex[:16], "the sky is", 20, ignore_eos=True,
                                temperature=0.0)
    expected = _fault_free(export_dir, [request], 20)
    # no emulated link: stage 0 sends itself, and its send to the dead node times out
    record = start_local_cluster(export_dir, 3, EXACT, tmp_path / "cluster")
    try:
        wait_serving(record, 120)
        os.killpg(record.pids[1], signal.SIGKILL)
        messages = list(generate_many(record.serve, [request], 120, 120))
        (done,) = [m for m in messages if isinstance(m, GenerationDone)]
        assert done.error == "" and done.tokens == expected[0], messages[-3:]
        notes = [m.note for m in messages if getattr(m, "note", "")]
        assert notes and notes[-1].startswith("resumed after "), notes
    finally:
        stop_processes(record.pids)


EXACT = runtime_spec("f32", None, "CPU", "f32", dynamic_quantization=False)


def _fault_free(export_dir: Path, requests: list[GenerationRequest],
                tokens: int = TOKENS) -> list[list[int]]:
    chain = LocalChain.load(str(export_dir), RuntimeSpec(precision="f32",
                                                         kv_cache_precision="f32"))
    tokenizer = ChatTokenizer(export_dir)
    return [list(generate_greedy(chain, tokenizer.encode(r.prompt, chat=r.chat), tokens))
            for r in requests]


def _wait_status(record, ready, timeout: float = 60.0):  # noqa: ANN001, ANN202
    """The cluster's status once ``ready(status)`` holds."""
    deadline = time.monotonic() + timeout
    while True:
        status = query_status(record.control, 10)
        if ready(status):
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.2)


def _kill_mid_generation(record, requests: list[GenerationRequest], messages: list,
                         node: int, why: str = "") -> threading.Thread:
    """Start the requests on a client thread (every message into ``messages``), SIGKILL
    node ``node``'s process once tokens flow, and wait until the client is told its
    generation paused (``why`` in the note); the running client thread."""
    client = generating_client(record.serve, requests, messages)
    os.killpg(record.pids[node], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(
            getattr(m, "note", "").startswith("paused") for m in messages):
        time.sleep(0.1)
    paused = [m.note for m in messages if getattr(m, "note", "")]
    assert paused and why in paused[0], paused
    return client


# -- a node process killed under a coordinator of this process ---------------------------

def test_killed_node_process_is_marked_dead_and_reclaims_its_id(cp_cluster: Cluster) -> None:
    from tests.helpers.control import node, wait_for

    coord = cp_cluster.coordinator(liveness=5)
    state = cp_cluster.root / "proc-node"
    cmd = [sys.executable, *process_command(NodeProcess(
        coord.endpoint, state_dir=str(state), host="127.0.0.1", reconnect_min=0.1))]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        status = coord.wait_serving(60)  # the real StageWorker runs in the node process
        node_id = (state / "node_id").read_text().strip()
        assert node(status, node_id).state == "serving"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        wait_for(lambda: node(query_status(coord.endpoint), node_id).state == "dead",
                 what="dead")
        assert query_status(coord.endpoint).pipeline == "degraded"
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        status = coord.wait_serving(60)
        assert [n.node_id for n in status.nodes if not n.local] == [node_id]
        assert node(status, node_id).transfer_total == 0  # served from its cache
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _, stderr = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
    assert proc.returncode == 0, stderr.decode()[-2000:]
