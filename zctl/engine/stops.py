"""Stop strings in streamed text: match them across chunk boundaries, never emit them.

``StopMatcher.push`` takes each piece of newly decoded text and returns what is safe to
send: text that is part of a stop string, or could still become one, is held back until
the next piece settles it. Once a stop string appears, everything from it on is dropped
and ``hit`` names it. Pure: no tokenizer, no engine.
"""

from __future__ import annotations

from collections.abc import Sequence


def held_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    longest = max((len(s) for s in stops), default=0)
    for size in range(min(len(text), longest - 1), 0, -1):
        tail = text[-size:]
        if any(s.startswith(tail) for s in stops):
            return size
    return 0


def first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """Where the earliest stop string in ``text`` starts, and which it is (None: none)."""
    found = [(text.find(s), s) for s in stops if s in text]
    return min(found, key=lambda hit: hit[0]) if found else None


def pending_start(text: str, stops: Sequence[str], before: int) -> int | None:
    """The earliest position before ``before`` from which ``text`` is a proper prefix of a
    stop string: one that starts earlier than a stop already found may still complete."""
    longest = max((len(s) for s in stops), default=0)
    for start in range(max(0, len(text) - longest + 1), before):
        tail = text[start:]
        if any(len(s) > len(tail) and s.startswith(tail) for s in stops):
            return start
    return None


class StopMatcher:
    """Filter a stream of text pieces for the first of ``stops`` (empty strings ignored)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.hit: str | None = None
        self._held = ""

    def push(self, text: str) -> str:
        """The part of ``_held + text`` that can be sent now."""
        if self.hit is not None:
            return ""
        if not self.stops:
            return text
        buffer = self._held + text
        found = first_stop(buffer, self.stops)
        if found is not None:
            earlier = pending_start(buffer, self.stops, found[0])
            if earlier is not None:  # wait: the stop that starts first wins, however split
                self._held = buffer[earlier:]
                return buffer[:earlier]
            self.hit, self._held = found[1], ""
            return buffer[:found[0]]
        keep = held_suffix(buffer, self.stops)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep]

    def flush(self) -> str:
        """The text held back, once no more comes (nothing after a stop string)."""
        held, self._held = self._held, ""
        if self.hit is not None:
            return ""
        found = first_stop(held, self.stops)
        if found is not None:  # held back for a longer stop that never completed
            self.hit = found[1]
            return held[:found[0]]
        return held
