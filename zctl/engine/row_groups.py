"""The scheduler's row groups (pure bookkeeping): which sessions each group steps as its
rows, which rows its stages hold, and what each row's last step left padded.

A row group steps all its members in one inference per stage (``StageRunner.step_rows``)
and is scheduled like one stream. Sessions join the smallest group and leave it when they
end; a group's new membership reaches its stages (``Executor.regroup``) only between its
steps, so what the stages hold (``formed``) may lag what the scheduler wants
(``members``) until the scheduler settles the group. ``zctl.engine.row_plans`` lays the
rows' steps out as one.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from zctl.engine.executor import Step
from zctl.engine.row_plans import RowsPlan, padded_rows, ragged_rows
from zctl.engine.sessions import DecodeSession

GROUP_ID_BASE = 1 << 30  # row group ids, clear of the stream ids callers use


class RowGroups:
    """``count`` row groups, ids from ``GROUP_ID_BASE``: each one's ``members`` (the
    sessions it steps, in row order), the stream ids its stages hold as rows (``formed``),
    and the group of every member (``group_of``, by stream id)."""

    def __init__(self, count: int) -> None:
        self.members: dict[int, list[DecodeSession]] = {
            GROUP_ID_BASE + i: [] for i in range(count)}
        self.formed: dict[int, list[int]] = {gid: [] for gid in self.members}
        self.group_of: dict[int, int] = {}
        self._pads: dict[int, int] = {}  # stream id -> padding slots of its last row step

    def __bool__(self) -> bool:
        """Whether there are groups at all."""
        return bool(self.members)

    def __contains__(self, unit_id: int) -> bool:
        """Whether ``unit_id`` (a stream's or a group's) is a group's."""
        return unit_id in self.members

    def units(self) -> list[tuple[int, list[DecodeSession]]]:
        """The groups with members: (group id, its sessions)."""
        return [(gid, members) for gid, members in self.members.items() if members]

    def join(self, session: DecodeSession) -> None:
        """Make the session a row of the smallest group."""
        gid = min(self.members, key=lambda g: len(self.members[g]))
        self.members[gid].append(session)
        self.group_of[session.stream_id] = gid

    def leave(self, session: DecodeSession) -> bool:
        """Drop the session's row (its group's stages drop it when next settled); whether
        it had one."""
        gid = self.group_of.pop(session.stream_id, None)
        self._pads.pop(session.stream_id, None)
        if gid is not None and session in self.members[gid]:
            self.members[gid].remove(session)
        return gid is not None

    def stages_hold(self, group_id: int, sessions: Sequence[DecodeSession]) -> bool:
        """Whether the group's stages hold exactly these sessions' rows, in this order."""
        return [s.stream_id for s in sessions] == self.formed[group_id]

    def regroups_due(self, stepping: Collection[int]) -> list[tuple[int, list[int]]]:
        """The groups whose stages should take a new membership now: (group id, its
        members' stream ids), but for the groups ``stepping`` (a step in flight)."""
        wanted = ((gid, [s.stream_id for s in members]) for gid, members in self.members.items())
        return [(gid, ids) for gid, ids in wanted
                if gid not in stepping and ids != self.formed[gid]]

    def mark_formed(self, group_id: int, stream_ids: list[int]) -> None:
        """The group's stages took ``stream_ids`` as its rows."""
        self.formed[group_id] = stream_ids

    def disband(self, group_id: int) -> list[DecodeSession]:
        """The group's stages could not take its membership: every member leaves it (they
        are returned), and its stages are taken to hold no rows."""
        members = list(self.members[group_id])
        self.formed[group_id] = []
        for session in members:
            self.group_of.pop(session.stream_id, None)
        self.members[group_id].clear()
        return members

    def step(self, group_id: int, sessions: Sequence[DecodeSession], plans: Sequence[Step],
             ragged: bool) -> RowsPlan:
        """The group's step from its rows' ``plans``: ``ragged`` (paged stages), or padded
        to one length, each row rewinding the padding its last step left."""
        if ragged:
            return ragged_rows(group_id, plans)
        rows = padded_rows(group_id, plans, [self._pads.get(s.stream_id, 0) for s in sessions])
        for session, pad in zip(sessions, rows.pads, strict=True):
            self._pads[session.stream_id] = pad
        return rows
