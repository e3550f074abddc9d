"""Sessions on real stages: several streams interleaved in one process or batched as the
rows of one inference produce exactly what each produces alone; a session restarted after
its KV was lost (a node went down) continues as if nothing happened. (Pipelined across
stage processes: tests/e2e/test_stage_processes.py.)"""

from __future__ import annotations

from dataclasses import replace

import pytest

from dataplane.head.local_chain import LocalChain
from tests.zctl.engine.test_scheduler import EXACT, PROMPTS, CountingModel, N, fake_greedy
from zctl.engine.scheduler import StreamScheduler, generate_greedy, generate_speculative, run_sessions
from zctl.engine.sessions import DecodeSession


@pytest.fixture(scope="module")
def export2(tiny_exports):
    return tiny_exports.get([(0, 2), (2, 4)])


def alone(pipe, prompt, speculative: bool) -> list[int]:
    if speculative:
        return list(generate_speculative(pipe, prompt, N, k=3, prefill_chunk=4))
    return list(generate_greedy(pipe, prompt, N, prefill_chunk=4))


def interleaved(pipe, speculative: bool) -> list[list[int]]:
    sessions = [DecodeSession(10 + i, p, N, k=3 if speculative else 0, prefill_chunk=4)
                for i, p in enumerate(PROMPTS)]
    for update in run_sessions(pipe, sessions):
        assert update.session.error is None, update.session.error
        for runner in getattr(pipe, "runners", []):  # a LocalChain: one InferRequest (own KV)
            open_ = list(runner.streams.values())  # per open stream
            assert len({id(s.request) for s in open_}) == len(open_)
    return [s.emitted for s in sessions]


@pytest.mark.parametrize("speculative", [False, True])
def test_interleaved_streams_on_one_compiled_model_equal_each_alone(export2, speculative) -> None:
    """Several InferRequests of one compiled model on CPU keep their own KV: safe to share."""
    chain = LocalChain.load(str(export2), EXACT)
    want = [alone(chain, p, speculative) for p in PROMPTS]
    assert interleaved(chain, speculative) == want
    assert all(not runner.streams for runner in chain.runners)  # each freed when it ended


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("speculative", [False, True])
def test_row_groups_in_one_process_equal_each_alone(export2, speculative, paged) -> None:
    """Rows of one group: plain one-token rows, or speculative rows whose drafts differ in
    length (stateful stages: padded, then rewound per row with the next step, compaction
    re-forming the group as a low threshold makes it happen; paged stages: ragged rows,
    each rewound by its own rejected drafts)."""
    want = [alone(LocalChain.load(str(export2), EXACT), p, speculative=False) for p in PROMPTS]
    config = replace(EXACT, paged_attention=paged)
    chain = LocalChain.load(str(export2), config, compact_threshold=3)
    sessions = [DecodeSession(10 + i, p, N, prefill_chunk=4,
                              k=(1 + i) if speculative else 0) for i, p in enumerate(PROMPTS)]
    scheduler = StreamScheduler(chain, row_groups=1)
    for session in sessions:
        scheduler.add(session)
    while scheduler.active:
        scheduler.poll()
    assert [s.emitted for s in sessions] == want
    assert scheduler.rows_stepped > scheduler.row_steps > 0
    assert all(not runner.groups for runner in chain.runners)
    assert scheduler.ragged == paged
    if speculative:  # paged stages rewind by shortening: nothing is ever compacted
        assert sum(s.spec.accepted for s in sessions) > 0
        assert (chain.compactions > 0) != paged
    with pytest.raises(ValueError, match=">= 0"):
        StreamScheduler(chain, row_groups=-1)


def drive_with_kv_losses(chain, session: DecodeSession, lose_at: set[int]) -> list[int]:
    """Step ``session`` on ``chain``; before the steps numbered in ``lose_at`` the stream's
    KV is wiped on every stage (as when a node went down) and the session restarted."""
    sid = session.stream_id
    chain.open(sid)
    chain.reset(sid)
    steps = 0
    while not session.done:
        if steps in lose_at:
            chain.reset(sid)
            session.restart()
        session.advance(chain.compute(session.plan()))
        steps += 1
    return session.emitted


@pytest.mark.parametrize("speculative", [False, True])
def test_a_restarted_session_replays_its_tokens_and_continues_as_if_nothing_happened(
        export2, speculative) -> None:
    chain = LocalChain.load(str(export2), EXACT)
    for prompt in PROMPTS[:2]:
        want = alone(chain, prompt, speculative)
        session = DecodeSession(5, prompt, N, k=3 if speculative else 0, prefill_chunk=4)
        # step 1 is inside the prompt's prefill; the others after 1 and several tokens
        assert drive_with_kv_losses(chain, session, {1, 3, 7}) == want
        assert session.restarts == 3
        if speculative:  # the lost steps are not counted as decode steps
            assert session.spec.steps == len(session.k_used)


def test_restart_replays_prompt_and_emitted_but_the_last_at_their_positions() -> None:
    model = CountingModel()
    session = DecodeSession(0, [1, 2, 3, 4, 5], 8, prefill_chunk=4)
    drive_with_kv_losses(model, session, {4})  # 2 prefill steps, 2 decode steps, then lost
    replay = [s for s in model.steps if s[1]][4:6]
    assert replay[0][1:3] == ([1, 2, 3, 4], [0, 1, 2, 3])
    assert replay[1][1] == [5, *session.emitted[:2]] and replay[1][2] == [4, 5, 6]
    decode = [s for s in model.steps if s[1]][6]
    assert decode[1] == [session.emitted[2]] and decode[2] == [7]
    assert session.emitted == fake_greedy([1, 2, 3, 4, 5], 8)


def test_row_grouped_sessions_restarted_at_any_point_equal_each_alone(export2) -> None:
    """Cut the schedule anywhere (steps answered but not collected, rows in a group), abandon
    everything as a pause does, restart the sessions on a fresh schedule: each ends with its
    own greedy tokens (a stale row group would give a member its old, advanced KV row)."""
    chain = LocalChain.load(str(export2), EXACT)
    expected = [alone(chain, p, False) for p in PROMPTS]
    wrong = []
    for cut in range(1, 40, 3):
        sessions = [DecodeSession(i, p, N) for i, p in enumerate(PROMPTS)]
        scheduler = StreamScheduler(chain, row_groups=1)
        for session in sessions:
            scheduler.add(session)
        for _ in range(cut):
            scheduler.poll()
        chain.abandon_all("a stage went down")
        assert not chain.runners[0].groups  # the groups went with it
        scheduler = StreamScheduler(chain, row_groups=1)
        for session in sessions:
            if not session.done:
                session.restart()
                scheduler.add(session)
        while scheduler.active:
            scheduler.poll()
        wrong += [(cut, s.stream_id) for s, want in zip(sessions, expected, strict=True)
                  if s.emitted != want]
    assert not wrong


def test_a_group_whose_rows_all_left_with_a_step_in_flight_is_re_formed_first(export2) -> None:
    """Every row of a row group is cancelled while its step is in flight and a new prompt
    joins the emptied group: the group is re-formed on the stages before it steps again
    (a step for the new membership on the old group failed: "row group ... has 2 rows: a
    ragged step needs one positive token count per row, got [1]")."""
    chain = LocalChain.load(str(export2), replace(EXACT, paged_attention=True))
    scheduler = StreamScheduler(chain, row_groups=2)
    sessions = [DecodeSession(10 + i, p, 64, prefill_chunk=4) for i, p in enumerate(PROMPTS[:3])]
    for session in sessions:
        scheduler.add(session)
    gid = None
    for _ in range(200):
        scheduler.poll()
        busy = {g for g in scheduler._group_steps.values()
                if len(scheduler.row_groups.formed[g]) == len(scheduler.row_groups.members[g]) >= 2}
        if busy and len(scheduler.row_groups.group_of) == 3:
            gid = busy.pop()
            break
    assert gid is not None, "no two-row group with a step in flight"
    leaving = list(scheduler.row_groups.members[gid])
    for session in leaving:
        scheduler.cancel(session.stream_id)
    newcomer = DecodeSession(20, PROMPTS[3], N, prefill_chunk=4)
    scheduler.add(newcomer)
    while scheduler.active:
        scheduler.poll()
    assert newcomer.error is None and not any(s.error for s in sessions)
    assert newcomer.emitted == alone(LocalChain.load(str(export2), EXACT), PROMPTS[3], False)
