"""What a stateful stage's sliding-window layers keep of a stream (pure: no inference).

A stateful stage keeps a stream's KV as OpenVINO state, one tensor per layer's keys and
values, over the stream's slot table (``keep``: the physical slots, False where a rewind
masked one). A sliding layer's query sees only its ``window`` latest keys, so its state
needs only the table's last slots: its tensors hold the slots from ``start`` on (the
stream's *sliding start*), and the stage graph gives a sliding layer the last columns of
the stage's mask, as many as its KV holds (exporter.stage_module), so the one mask the host
builds serves both kinds of layer.

The host trims a sliding layer's state from the front between steps (a copy of what it
keeps; in the graph, a Slice before the state's Assign would break the CPU plugin's fused
SDPA with a KV cache). It keeps the slots of the last ``window - 1 + margin`` kept tokens,
so a rewind of up to ``margin`` tokens (the deepest the engine asks for) still finds the
window of the query after it; a deeper rewind would need keys that are gone and is refused.
It trims only once the slots to drop are ``slack`` or more, so the copy is paid once every
``slack`` tokens: a sliding layer holds at most ``window - 1 + margin + slack`` kept slots
and a step's tokens (and any masked slots among them until a compaction drops them).

Rows of a row group share one sliding start (their tensors are one batch): a row's slots
before its own trim point may then hold zeros where its dropped keys were, which is
harmless, as they are older than its window: the mask's window (``window_mask``) counts a
query's seen slots from the right and never reaches them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from dataplane.runtime.kv.rows import SLOT_AXIS, RowSource


def window_kept_tokens(window: int, margin: int) -> int:
    """The tokens a sliding layer of ``window`` keys keeps, paged or stateful: the window
    before a query, and the ``margin`` a rewind may take back."""
    return window - 1 + margin


@dataclass(frozen=True)
class SlidingStates:
    """The sliding layers of a stateful stage (``layers``: their indices in the model), their
    ``window`` (a query's latest keys, itself included), the ``margin`` of tokens kept
    beyond it for rewinds, and the ``slack`` of slots a trim waits for."""

    layers: frozenset[int]
    window: int
    margin: int
    slack: int

    def __post_init__(self) -> None:
        if not self.layers or self.window < 1 or self.margin < 0 or self.slack < 1:
            raise ValueError(f"sliding states need layers, a window of at least 1 key, "
                             f"a margin >= 0 and a slack of at least 1 slot, not "
                             f"{sorted(self.layers)}, {self.window}, {self.margin}, {self.slack}")

    @classmethod
    def of_stage(cls, state_names: Iterable[str], sliding_layers: Iterable[int], window: int,
                 margin: int, slack: int) -> SlidingStates | None:
        """The sliding states of a stage whose states are named ``past_key_values.N.key``
        and ``.value`` (N a layer of the model); None when none of its layers slides."""
        layers = frozenset(_layer_of(n) for n in state_names) & frozenset(sliding_layers)
        if not layers or window < 1:
            return None
        return cls(layers, window, margin, slack)

    def is_sliding(self, name: str) -> bool:
        """Whether state variable ``name`` (``past_key_values.N.key...``) is a sliding
        layer's."""
        return _layer_of(name) in self.layers

    @property
    def kept(self) -> int:
        """Tokens a trim keeps: the window before a query, and the margin."""
        return window_kept_tokens(self.window, self.margin)

    def bound(self, tokens: int = 1) -> int:
        """The most kept slots a sliding layer holds while a step writes ``tokens`` more."""
        return self.kept + self.slack + tokens

    def start_after(self, keep: np.ndarray, start: int) -> int:
        """The sliding start of slot table ``keep`` ([slots], or a row group's [rows,
        slots]) whose sliding states begin at ``start``: further on once at least
        ``slack`` slots before every row's last ``kept`` kept tokens can go, else ``start``."""
        if keep.shape[-1] - start < self.kept + self.slack:
            return start  # the usual case: nothing to consider
        new = keep.shape[-1]
        for row in keep.reshape(-1, keep.shape[-1]):
            kept = np.flatnonzero(row)
            if kept.size:
                new = min(new, int(kept[max(0, kept.size - self.kept)]))
        return new if new - start >= self.slack else start

    def gone_after(self, keep: np.ndarray, start: int, gone: int | np.ndarray) -> int | np.ndarray:
        """Each row's first tokens whose keys the sliding states lack once they begin at
        ``start``: its kept slots before it, or as many as were gone already."""
        before = keep[..., :start].sum(axis=-1)
        return np.maximum(before, gone) if keep.ndim == 2 else max(int(before), int(gone))

    def refuses(self, logical: int, gone: int) -> bool:
        """Whether a stream (or a row) of ``logical`` tokens, whose sliding states lack its
        first ``gone``, lacks keys its next query sees (from ``logical - window + 1`` on)."""
        return gone > max(0, logical - self.window + 1)

    def refusal(self, stage: int, count: int, length: int) -> str:
        """Why a rewind of ``count`` of ``length`` tokens is refused on stage ``stage``."""
        return (f"cannot rewind {count} tokens of a {length}-token stream on stage {stage}: "
                f"its sliding layers keep the last {self.window} keys and a margin of "
                f"{self.margin} tokens, not the keys before")


def _layer_of(name: str) -> int | None:
    """N of a state named ``past_key_values.N.key`` or ``.value`` (a variable's name goes on
    with its present output's), else None."""
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "past_key_values" and parts[1].isdigit():
        return int(parts[1])
    return None


def trimmed(data: np.ndarray, drop: int) -> np.ndarray:
    """A sliding state tensor without its first ``drop`` slots (a contiguous copy)."""
    return np.ascontiguousarray(data[:, :, drop:, :])


@dataclass(frozen=True)
class MergedRows:
    """A row group's state tensors by name, its slot tables [rows, slots], the slot its
    sliding states begin at and each row's first tokens whose keys they lack."""

    states: dict[str, np.ndarray]
    keep: np.ndarray
    sliding_start: int
    sliding_gone: np.ndarray


def merge_rows_right(sources: Sequence[RowSource], sliding: SlidingStates) -> MergedRows:
    """The state tensors of a batch whose row i is ``sources[i]``'s kept slots, every row
    ending at the last slot (shorter rows padded at the front with masked slots), so the
    rows' latest tokens share the last slots and one sliding start keeps every row's: the
    sliding states begin at the first slot any row has keys for (a row's slots after it
    whose keys are gone hold zeros, older than its window)."""
    if not sources:
        raise ValueError("a row group needs at least one member")
    names = set(sources[0].states)
    if any(set(src.states) != names for src in sources):
        raise ValueError("members come from requests with different state variables")
    if any(src.keep.ndim != 1 for src in sources):
        raise ValueError("a member's slot table must be 1-D")
    kept = [np.flatnonzero(src.keep) for src in sources]
    length = max(k.size for k in kept)
    keep = np.zeros((len(sources), length), dtype=bool)
    # a row's first token its sliding states hold, and the slot it lands on
    held = [int((k < src.sliding_start).sum()) for k, src in zip(kept, sources, strict=True)]
    offsets = [length - k.size for k in kept]
    start = min(o + h for o, h in zip(offsets, held, strict=True))
    gone = np.array([max(src.sliding_gone, h) for src, h in zip(sources, held, strict=True)],
                    dtype=np.int64)
    merged: dict[str, np.ndarray] = {}
    for name in sorted(names):
        slides = sliding.is_sliding(name)
        first = sources[0].states[name]
        out = np.zeros((len(sources), first.shape[1], length - (start if slides else 0),
                        first.shape[3]), dtype=first.dtype)
        for i, (src, k) in enumerate(zip(sources, kept, strict=True)):
            data = src.states[name][src.row]
            lacks = src.sliding_start if slides else 0
            if data.shape[SLOT_AXIS - 1] != src.keep.size - lacks:
                raise ValueError(f"state {name} has {data.shape[SLOT_AXIS - 1]} slots but the "
                                 f"member's slot table has {src.keep.size - lacks} for it")
            if slides:
                out[i, :, offsets[i] + held[i] - start:] = data[:, k[held[i]:] - lacks]
            else:
                out[i, :, offsets[i]:] = data[:, k]
            keep[i, offsets[i]:] = True
        merged[name] = out
    return MergedRows(merged, keep, start, gone)


def prefix_states(states: dict[str, np.ndarray], row: int, keep: np.ndarray, length: int,
                  sliding: SlidingStates, start: int, gone: int
                  ) -> tuple[dict[str, np.ndarray], int]:
    """Copies of the first ``length`` kept tokens of row ``row`` of ``states`` (slot table
    ``keep``, sliding states from slot ``start`` on, lacking the keys of the first
    ``gone`` tokens): whole states [1, heads, length, dim], sliding ones from the first
    token they hold; and how many tokens they lack (at most ``length``)."""
    slots = np.flatnonzero(keep)[:length]
    lacks = min(gone, length)
    out = {}
    for name, data in states.items():
        taken = slots[lacks:] - start if sliding.is_sliding(name) else slots
        out[name] = np.ascontiguousarray(data[row:row + 1][:, :, taken])
    return out, lacks
