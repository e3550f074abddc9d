"""Row groups' bookkeeping: sessions join the smallest group, a group's new membership is
due for its stages only between its steps, a refused one disbands, and a padded row
rewinds its last step's padding with the next."""

from __future__ import annotations

import numpy as np

from zctl.engine.executor import Step
from zctl.engine.row_groups import GROUP_ID_BASE, RowGroups
from zctl.engine.sessions import DecodeSession


def _sessions(n: int) -> list[DecodeSession]:
    return [DecodeSession(i, [1, 2, 3], 8) for i in range(n)]


def test_sessions_join_the_smallest_group_and_leave_it() -> None:
    groups = RowGroups(2)
    a, b, c = _sessions(3)
    for session in (a, b, c):
        groups.join(session)
    first, second = GROUP_ID_BASE, GROUP_ID_BASE + 1
    assert groups.members == {first: [a, c], second: [b]}
    assert groups.group_of == {0: first, 1: second, 2: first}
    assert first in groups and 0 not in groups and groups.units() == [(first, [a, c]),
                                                                      (second, [b])]
    assert groups.leave(a) and not groups.leave(a)  # only once
    assert groups.members[first] == [c] and 0 not in groups.group_of
    assert not RowGroups(0) and RowGroups(1)


def test_a_new_membership_is_due_between_the_groups_steps_only() -> None:
    groups = RowGroups(2)
    a, b = _sessions(2)
    groups.join(a)
    groups.join(b)
    first, second = GROUP_ID_BASE, GROUP_ID_BASE + 1
    assert groups.regroups_due(stepping={second}) == [(first, [0])]
    groups.mark_formed(first, [0])
    assert groups.stages_hold(first, [a]) and not groups.stages_hold(first, [a, b])
    assert groups.regroups_due(stepping=()) == [(second, [1])]
    assert groups.disband(second) == [b]
    assert groups.members[second] == [] and groups.formed[second] == []
    assert 1 not in groups.group_of and groups.regroups_due(stepping=()) == []


def test_a_padded_row_rewinds_its_last_steps_padding_with_the_next() -> None:
    groups = RowGroups(1)
    a, b = _sessions(2)
    gid = GROUP_ID_BASE

    def step(sid: int, tokens: list[int], start: int, rewind: int = 0) -> Step:
        return Step(sid, np.array(tokens), np.arange(start, start + len(tokens)), None,
                    False, rewind)

    rows = groups.step(gid, [a, b], [step(0, [5], 10), step(1, [6, 7, 8], 20)], ragged=False)
    assert rows.step.stream_id == gid and rows.pads == [2, 0]
    rows = groups.step(gid, [a, b], [step(0, [9], 11), step(1, [4], 22, rewind=1)],
                       ragged=False)
    assert rows.step.mask_tail.tolist() == [2, 1]  # a's padding, b's own rejected draft
    ragged = groups.step(gid, [a, b], [step(0, [9], 11), step(1, [4, 5], 22)], ragged=True)
    assert ragged.step.row_tokens.tolist() == [1, 2] and ragged.pads == [0, 0]
