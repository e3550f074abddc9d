"""The scheduler's prefill decisions (a mixin of ``zctl.engine.scheduler.StreamScheduler``):
which steps are a prompt's, how many of a lone prompt's chunks are in flight at once, how
big its next chunk is (alone, or riding in a decoding group's step), and the least cached
prefix worth loading beside streams that are decoding. The chunk sizes themselves come
from ``zctl.engine.prefill_planner``'s measured step costs.
"""

from __future__ import annotations

from collections import Counter

from zctl.engine.drafting import StageLoad
from zctl.engine.executor import Executor
from zctl.engine.pipelined import PipelinedSession
from zctl.engine.prefill import SHORT_PREFILL
from zctl.engine.prefill_planner import PrefillPlanner
from zctl.engine.sessions import DecodeSession


class PrefillScheduling:
    """``StreamScheduler``'s prefill steps (a mixin)."""

    pipeline: Executor
    sessions: dict[int, DecodeSession]
    _groups: dict[int, list[DecodeSession]]
    prefill: PrefillPlanner
    load: StageLoad
    ragged: bool
    overlaps: bool

    def _prefilling(self, unit_id: int, sessions: list[DecodeSession]) -> bool:
        """Whether the unit's next step is a prefill step (a stream alone, in its prompt)."""
        return unit_id not in self._groups and sessions[0].prefilling

    def _min_prefix_hit(self, session: DecodeSession) -> int | None:
        """The least cached prefix worth loading for ``session`` (None: the cache's own).
        On ragged stages a prompt arriving while others decode rides in their steps from
        its first chunk, but one that loads a cached prefix takes its first step alone (a
        stage without the entry then fails that step, not the group's), which costs the
        decoding streams a step: a prefix of under ``SHORT_PREFILL`` tokens saves less."""
        return SHORT_PREFILL if self.ragged and self._others_decoding(session) else None

    def _others_decoding(self, session: DecodeSession) -> bool:
        return any(s is not session and not s.prefilling and not s.done
                   for s in self.sessions.values())

    def _prefill_depth(self, session: DecodeSession) -> int:
        """Prefill steps of one session in flight at once: enough to keep every stage
        busy (on an executor whose steps overlap), one beside streams decoding."""
        if not self.overlaps or self._others_decoding(session):
            return 1
        return self.pipeline.num_stages

    def _may_plan_ahead(self, unit_id: int, sessions: list[DecodeSession],
                        busy: Counter[int]) -> bool:
        session = sessions[0]
        if isinstance(session, PipelinedSession) and unit_id not in self._groups:
            # Pipelined speculation where steps overlap on stages of their own cores, unless
            # several streams already keep the stages busy (then each runs one step at a
            # time, or in a row group). Where the stages share cores, a guessed run takes
            # them from the run it guesses after: one step at a time there too.
            alone = len(self.sessions) == 1 or not self.load.saturated()
            own_cores = self.overlaps and not self.load.shared_cores
            session.depth_cap = None if own_cores and alone else 1
            if not session.prefilling:
                return session.stream_id in self.sessions and session.can_run_ahead
        if not self._prefilling(unit_id, sessions):
            return False
        return (session.stream_id in self.sessions and session.can_plan_ahead
                and busy[id(session)] < self._prefill_depth(session))

    def _size_prefill(self, session: DecodeSession) -> None:
        """Set the session's next prefill chunk from the measured step costs."""
        stages = 1 if self.load.shared_cores or not self.overlaps else self.pipeline.num_stages
        session.prefill_chunk = self.prefill.chunk(session, self._others_decoding(session),
                                                   stages)

    def _size_fused(self, group_id: int, prompts: list[DecodeSession]) -> None:
        """Set the chunks of the prompts riding in a group's step: beside streams that are
        decoding, the group's measured allowance of prompt tokens (split-fuse held to a
        budget); else each as a prompt alone."""
        if prompts and self._others_decoding(prompts[0]):
            chunks = self.prefill.fused_chunks(group_id, prompts)
            for session, chunk in zip(prompts, chunks, strict=True):
                session.prefill_chunk = chunk
            return
        for session in prompts:
            self._size_prefill(session)
