"""The data plane across processes: stage 0 in a ClusterHead here, the other stages as
``python -m dataplane.worker`` processes on loopback addresses (127.0.0.2, 127.0.0.3).
Greedy, static, speculative (the rewind carried in the next step's frame), pipelined and
row-grouped generation give exactly what one process gives; a worker's emulated link
delays its replies."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from dataplane.head.cluster_head import ClusterHead
from dataplane.head.local_chain import LocalChain
from dataplane.runtime.load import load_runner
from dataplane.runtime.stateful import StageRunner
from dataplane.runtime.static import StaticStageRunner
from tests.helpers.repo import ROOT
from zctl.engine.executor import Step
from zctl.engine.scheduler import StreamScheduler, generate_greedy, generate_speculative
from zctl.engine.sessions import DecodeSession
from zctl.engine.stats import GenerationStats, SpeculativeStats


@pytest.fixture
def dp_spawn():
    """Start ``python -m dataplane.worker`` processes; returns start(export, stage, bind,
    send_to) -> bound endpoint. Every process is terminated after the test."""
    procs: list[subprocess.Popen] = []

    def start(export: Path, stage: int, bind: str, send_to: str) -> str:
        log = tempfile.TemporaryFile(mode="w+")
        proc = subprocess.Popen(
            [sys.executable, "-m", "dataplane.worker", str(export), "--stage", str(stage),
             "--bind", bind, "--send-to", send_to],
            stdout=subprocess.PIPE, stderr=log, text=True,
            cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        procs.append(proc)
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.startswith("ready "):
            log.seek(0)
            raise RuntimeError(f"worker for stage {stage} did not start: {log.read()[-2000:]}")
        return line.split()[1]

    yield start
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def chain_in_processes(export, hosts, spawn, stages: int, timeout_s: float = 20.0):
    """Coordinator here (stage 0); stages 1.. as worker processes on hosts[i - 1]."""
    addrs = [f"tcp://{hosts[(i - 1) % len(hosts)]}:{free_port(hosts[(i - 1) % len(hosts)])}"
             for i in range(1, stages)]
    pipe = ClusterHead(load_runner(export, 0), addrs[0], "tcp://127.0.0.1:*",
                           timeout_s=timeout_s)
    for i in reversed(range(1, stages)):
        send_to = addrs[i] if i < stages - 1 else pipe.reply_endpoint
        assert spawn(export, i, addrs[i - 1], send_to) == addrs[i - 1]
    return pipe


# -- ClusterHead ---------------------------------------------------------------------------

@pytest.mark.parametrize("stages", [2, 3])
def test_greedy_across_processes_equals_local_chain(stages, dp_export2, dp_export3, dp_hosts,
                                                    dp_spawn):
    from tests.dataplane.head.test_cluster_head import PROMPTS, greedy

    export = dp_export2 if stages == 2 else dp_export3
    pipe = chain_in_processes(export, dp_hosts, dp_spawn, stages)
    local = LocalChain.load(str(export))
    prefetch, bound = pipe.stage0.prefetch, []
    pipe.stage0.prefetch = lambda sid: bound.append(prefetch(sid)) or bound[-1]
    try:
        for prompt in PROMPTS:
            stats = GenerationStats()
            assert greedy(pipe, prompt, stats=stats) == greedy(local, prompt)
            assert len(stats.stage_ms[-1]) == stages
        # while it waited for replies, stage 0 bound streams' likely next steps (whenever a
        # reply was not already there: not every time on a loaded machine)
        assert any(bound)
        pipe.open(0)  # the generations closed their stream on every stage when they ended
        pipe.reset(0)
        reply = pipe.step(0, np.array([5]), np.array([0]), top_k=4, want_logits=True)
        assert reply.logits is not None and reply.top is not None and reply.top.shape == (1, 4)
        timing = reply.timing
        assert timing is not None and len(timing.compute_ms) == stages
        assert [(h.src, h.dst) for h in timing.hops] == [(i, i + 1) for i in range(stages)]
        assert timing.total_ms >= sum(timing.compute_ms) and timing.transit_ms > 0
        summary = pipe.timings.summary()
        assert {"total", "overhead", f"stage{stages - 1}.compute", "hop0-1.network"} <= set(summary)
        assert pipe.stats.stale_replies == 0 and pipe.stats.errors == 0
    finally:
        pipe.close()


# -- static stages ------------------------------------------------------------------------

def test_a_static_chain_across_processes(tiny_exports, dp_hosts, dp_spawn) -> None:
    from tests.dataplane.runtime.test_static import CHUNK, CONTEXT, PROMPTS, N, _chain

    static2 = tiny_exports.get([(0, 2), (2, 4)], static=(CONTEXT, CHUNK))
    pipe = chain_in_processes(static2, dp_hosts, dp_spawn, 2)
    try:
        assert isinstance(pipe.stage0, StaticStageRunner) and not pipe.row_groups_supported
        local = _chain(static2)
        for prompt in PROMPTS:
            want = list(generate_greedy(local, prompt, N, prefill_chunk=4))
            assert list(generate_greedy(pipe, prompt, N, prefill_chunk=4)) == want
            assert list(generate_speculative(pipe, prompt, N, k=4, prefill_chunk=4)) == want
        assert pipe.stats.errors == 0
    finally:
        pipe.close()


# -- speculative decoding, sessions, row groups --------------------------------------------

def test_speculative_across_processes(dp_export2, dp_hosts, dp_spawn) -> None:
    from tests.zctl.engine.test_drafting import PROMPTS, N, ScriptedDrafter, speculate

    pipe = chain_in_processes(dp_export2, dp_hosts, dp_spawn, 2)
    try:
        accepted = 0
        for prompt in PROMPTS:
            want = list(generate_greedy(pipe, prompt, N, prefill_chunk=4))
            got, stats = speculate(pipe, prompt)
            assert got == want
            accepted += stats.accepted
            # every rewind length 0..k, each carried by the next step's frame
            drafter, stats, got, masked = ScriptedDrafter(prompt, want), SpeculativeStats(), [], 0
            for token in generate_speculative(pipe, prompt, N, k=4, stats=stats,
                                              prefill_chunk=4, drafter=drafter):
                got.append(token)
                slots = pipe.stage0.streams.get(0)  # closed once the last token is in
                if slots is not None:
                    masked = max(masked, slots.physical - slots.logical)
            assert got == want and stats.rejections > 0
            assert masked > 0  # rejected drafts were masked, not trimmed: the slots stay
        assert accepted > 0
        assert pipe.stats.errors == 0 and pipe.stats.timeouts == 0
    finally:
        pipe.close()


@pytest.mark.parametrize("speculative", [False, True])
def test_pipelined_streams_across_processes_equal_each_alone(dp_export2, dp_hosts, dp_spawn,
                                                             speculative) -> None:
    from tests.zctl.engine.test_sessions import PROMPTS, alone, interleaved

    pipe = chain_in_processes(dp_export2, dp_hosts, dp_spawn, 2)
    try:
        want = [alone(pipe, p, speculative) for p in PROMPTS]
        assert interleaved(pipe, speculative) == want
        assert pipe.stats.errors == 0 and pipe.stats.timeouts == 0
    finally:
        pipe.close()


@pytest.mark.parametrize("row_groups", [1, 2])
def test_row_groups_across_processes_equal_each_alone(dp_export2, dp_hosts, dp_spawn,
                                                      row_groups) -> None:
    """Greedy streams and a speculative one batched as rows of one inference per stage
    (joining after their prefill, leaving as they finish, padded and rewound per row)."""
    from tests.zctl.engine.test_sessions import PROMPTS, N, alone

    pipe = chain_in_processes(dp_export2, dp_hosts, dp_spawn, 2)
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


# -- emulated links -----------------------------------------------------------------------

def test_worker_process_takes_link_delay_ms(dp_export2, dp_hosts):
    """``python -m dataplane.worker --link-delay-ms`` delays its replies (a process hop)."""
    from tests.dataplane.wire.test_link import PROMPT

    delay = 60.0
    pipe = ClusterHead(StageRunner(dp_export2, 0), "tcp://127.0.0.1:1", "tcp://127.0.0.1:*",
                           timeout_s=20)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dataplane.worker", str(dp_export2), "--stage", "1",
         "--bind", f"tcp://{dp_hosts[0]}:*", "--send-to", pipe.reply_endpoint,
         "--link-delay-ms", str(delay)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.startswith("ready "), line
        pipe.rewire(line.split()[1])
        for _ in generate_greedy(pipe, PROMPT, 4):
            pass
        last_hop = [t.hops[-1].network_ms for t in pipe.timings.samples()]
        first_hop = [t.hops[0].network_ms for t in pipe.timings.samples()]
        assert len(last_hop) >= 4 and min(last_hop) >= delay * 0.9, last_hop
        # only the worker's outbound hop is delayed, and once: against the undelayed hop of
        # the same steps, the median delayed hop is one delay longer, not zero or two
        extra = float(np.median(last_hop) - np.median(first_hop))
        assert 0.5 * delay < extra < 1.5 * delay, (first_hop, last_hop)
    finally:
        pipe.close()
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:  # SIGTERM can miss a worker blocked in recv
            proc.kill()
            proc.wait(5)
