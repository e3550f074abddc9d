"""StageChain: several consecutive stages of one export run as one stage.

A node that carries a lost neighbour's layers runs its own stage and the neighbour's in
one process: the stage worker (or the cluster head) drives a StageChain exactly as it
drives one runner (both are ``StageRuntime``s), and the chain steps its runners back to
back, each fed the previous one's output. Stream, row-group, rewind and prefix operations
go to every runner in order; one that fails part-way is undone on the runners it reached,
so the runners never disagree about a stream (``LocalChain`` keeps its stages with the
same operations).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from dataplane.runtime.base import RowGroupKV, StageError, StageRuntime, StreamKV
from zctl.manifest import StageSpec

if TYPE_CHECKING:
    import openvino as ov


def chain_spec(specs: Sequence[StageSpec]) -> StageSpec:
    """The spec of consecutive stages taken as one: the first's index and inputs, the
    layers of all, the last's outputs; StageError unless they follow each other."""
    if not specs:
        raise StageError("a stage chain needs at least one stage")
    for before, after in zip(specs, specs[1:], strict=False):
        if after.index != before.index + 1 or after.layer_start != before.layer_end:
            raise StageError(f"stages {before.index} and {after.index} do not follow each other "
                             "(a chain runs consecutive stages)")
    first, last = specs[0], specs[-1]
    return replace(first, layer_end=last.layer_end, outputs=last.outputs,
                   state_names=tuple(n for s in specs for n in s.state_names), last=last.last)


class StageChain:
    """Consecutive runners (stages ``spec.index`` .. ``last_index``) as one
    ``StageRuntime``: what ``StageWorker`` and ``ClusterHead`` drive."""

    def __init__(self, runners: Sequence[StageRuntime]) -> None:
        self.runners = list(runners)
        self.spec = chain_spec([r.spec for r in self.runners])
        self.last_index = self.runners[-1].spec.index
        head = self.runners[0]
        self.manifest = head.manifest
        self.hidden_size = head.hidden_size
        self.row_groups_supported = all(r.row_groups_supported for r in self.runners)
        self.prefix_cache_supported = all(r.prefix_cache_supported for r in self.runners)
        self.paged_attention = all(r.paged_attention for r in self.runners)
        self.one_query_supported = all(r.one_query_supported for r in self.runners)

    # -- what every runner holds alike: read from the first ---------------------------
    @property
    def streams(self) -> Mapping[int, StreamKV]:
        return self.runners[0].streams

    @property
    def groups(self) -> Mapping[int, RowGroupKV]:
        return self.runners[0].groups

    @property
    def kv_bytes_per_token(self) -> int:
        return sum(r.kv_bytes_per_token for r in self.runners)

    def check_input(self, x: np.ndarray, positions: np.ndarray) -> None:
        self.runners[0].check_input(x, positions)

    def row_of(self, stream_id: int) -> tuple[int, int] | None:
        return self.runners[0].row_of(stream_id)

    def masked_slots(self, stream_id: int) -> int:
        return self.runners[0].masked_slots(stream_id)

    def compaction_due(self, stream_id: int, threshold: int | None) -> bool:
        return self.runners[0].compaction_due(stream_id, threshold)

    def prefix_bytes(self) -> int:
        return sum(r.prefix_bytes() for r in self.runners)

    # -- streams and row groups, on every runner -----------------------------------------
    def warm_up(self, stream_id: int = -1) -> None:
        for runner in self.runners:
            runner.warm_up(stream_id)

    def open_stream(self, stream_id: int) -> None:
        for runner in self.runners:
            runner.open_stream(stream_id)

    def reset_stream(self, stream_id: int, long_rope: bool = False) -> None:
        for runner in self.runners:
            runner.reset_stream(stream_id, long_rope)

    def close_stream(self, stream_id: int) -> None:
        for runner in self.runners:
            runner.close_stream(stream_id)

    def regroup(self, group_id: int, members: list[int]) -> None:
        """Make ``group_id`` the row group of ``members`` on every runner; if one refuses,
        the group is dropped on those before it (they moved the rows already)."""
        for done, runner in enumerate(self.runners):
            try:
                runner.regroup(group_id, members)
            except Exception:
                for earlier in self.runners[:done]:
                    earlier.close_stream(group_id)
                raise

    def mask_step_tail(self, stream_id: int, mask_tail: int | np.ndarray) -> bool:
        masked = False
        for runner in self.runners:
            masked = runner.mask_step_tail(stream_id, mask_tail) or masked
        return masked

    def truncate(self, stream_id: int, length: int) -> bool:
        return any([r.truncate(stream_id, length) for r in self.runners])

    def mask_tail(self, stream_id: int, count: int) -> None:
        for runner in self.runners:
            runner.mask_tail(stream_id, count)

    def trim_tail(self, stream_id: int, count: int) -> None:
        for runner in self.runners:
            runner.trim_tail(stream_id, count)

    def compact(self, stream_id: int) -> int:
        return [r.compact(stream_id) for r in self.runners][0]

    def prefetch(self, stream_id: int) -> bool:
        return any([r.prefetch(stream_id) for r in self.runners])

    # -- stepping: each runner feeds the next -------------------------------------------
    def step(self, stream_id: int, x: np.ndarray, positions: np.ndarray,
             logits_idx: np.ndarray | None = None, one_query: bool = False) -> np.ndarray:
        for runner in self.runners[:-1]:
            x = runner.step(stream_id, x, positions, one_query=one_query)
        return self.runners[-1].step(stream_id, x, positions, logits_idx, one_query=one_query)

    def step_rows(self, group_id: int, x: np.ndarray, positions: np.ndarray,
                  logits_idx: np.ndarray | None = None, one_query: bool = False
                  ) -> np.ndarray:
        for runner in self.runners[:-1]:
            x = runner.step_rows(group_id, x, positions, one_query=one_query)
        return self.runners[-1].step_rows(group_id, x, positions, logits_idx,
                                          one_query=one_query)

    def step_ragged(self, group_id: int, x: np.ndarray, positions: np.ndarray,
                    row_tokens: np.ndarray, logits_idx: np.ndarray | None = None,
                    one_query: bool = False) -> np.ndarray:
        for runner in self.runners[:-1]:
            x = runner.step_ragged(group_id, x, positions, row_tokens, one_query=one_query)
        return self.runners[-1].step_ragged(group_id, x, positions, row_tokens, logits_idx,
                                            one_query=one_query)

    def prepare(self, stream_id: int, positions: np.ndarray,
                logits_idx: np.ndarray | None = None, inputs: Any = None,
                row_tokens: np.ndarray | None = None, one_query: bool = False) -> list[Any]:
        """Bind every runner's inputs of the step but x, each given the step the runner
        before it prepared (so consecutive stateful runners build the RoPE tables and mask
        once: their slot tables agree). ``inputs``: an earlier stage's, for the first runner.
        Returns the runners' prepared steps, for ``run``."""
        prepared = []
        for runner in self.runners:
            inputs = runner.prepare(stream_id, positions, logits_idx if runner.spec.last else None,
                                    inputs, row_tokens=row_tokens, one_query=one_query)
            prepared.append(inputs)
        return prepared

    def run(self, stream_id: int, x: np.ndarray | ov.Tensor, step: list[Any]) -> ov.Tensor:
        """Run the runners' prepared steps back to back, each fed the previous one's output
        tensor; the last one's output tensor."""
        for runner, prepared in zip(self.runners, step, strict=True):
            x = runner.run(stream_id, x, prepared)
        return x

    # -- prefix entries, on every runner ---------------------------------------------------
    def save_prefix(self, stream_id: int, entry_id: int, length: int, take: bool = False) -> None:
        """Keep the stream's first ``length`` slots as entry ``entry_id`` on every runner;
        if one refuses, none keeps an entry of that id (and a stream taken by earlier
        runners is closed on all of them)."""
        for done, runner in enumerate(self.runners):
            try:
                runner.save_prefix(stream_id, entry_id, length, take)
            except Exception:
                for other in self.runners:
                    other.drop_prefix(entry_id)
                    if take and done:
                        other.close_stream(stream_id)
                raise

    def load_prefix(self, stream_id: int, entry_id: int, length: int, take: bool = False) -> None:
        """Give the stream entry ``entry_id``'s first ``length`` slots on every runner; if
        the first refuses nothing changes, if a later one does the stream is reset on
        every runner (and a taken entry dropped)."""
        for done, runner in enumerate(self.runners):
            try:
                runner.load_prefix(stream_id, entry_id, length, take)
            except Exception:
                if done:
                    for other in self.runners:
                        other.reset_stream(stream_id)
                        if take:
                            other.drop_prefix(entry_id)
                raise

    def drop_prefix(self, entry_id: int) -> None:
        for runner in self.runners:
            runner.drop_prefix(entry_id)

    def drop_all_prefixes(self) -> None:
        for runner in self.runners:
            runner.drop_all_prefixes()
