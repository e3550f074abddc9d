"""Where a prompt's prefill may be cut into steps, so that a cached prompt and a cold one
compute the same KV and the same tokens (``PieceRule``: pure arithmetic).

With the CPU plugin's default numerics a token's result depends on how the step that
computes it was cut (docs/measurements/repeatability.md):

- PagedAttention computes a sequence's lone query on another path than several queries
  of one step, and int8 activations (dynamic quantization) turn the last bits of that
  difference into other tokens. So no piece is a single token unless the whole prompt
  is: a cached prefix leaves at least two tokens to prefill, and a piece never leaves one
  behind (``CANONICAL``). Pieces of two tokens or more may end anywhere: with by-token
  keys in a u8 cache (``RuntimeSpec.key_cache_by_token``, the default), and with an f16
  or f32 cache, a prompt cut into such pieces computes the KV and logits of one cut
  elsewhere, so a cached prefix may end on any token (leaving two).
- Decode steps compute their tokens as lone queries, so a cached prefix is used only
  where a prefill wrote it: a finished stream's entry keeps its prompt, not the tokens
  decode steps wrote one at a time.
- The plugin's own paged u8 cache quantizes keys per channel over the tokens written
  into a 32-token block at once, so a block written in two steps holds other keys than
  one written in one: under it pieces must end on multiples of 32 tokens but a prompt's
  last, and a cached prefix is used up to such a boundary only (``PieceRule(32)``).

A replay after a restart feeds the prompt in these pieces and then the emitted tokens as
the decode steps that emitted them computed them (in one-query steps where the stages
compute those, else one a step), so a healed generation goes on as without the fault.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PieceRule:
    """Prefill boundaries on multiples of ``block`` tokens, no piece of one token unless
    the prompt is (0: anywhere, a lone token too)."""

    block: int = 1

    def __post_init__(self) -> None:
        if self.block < 0:
            raise ValueError(f"a piece block of >= 0 tokens, not {self.block}")

    def cut(self, lo: int, hi: int, size: int) -> int:
        """Where a piece from ``lo`` that would end at ``hi`` ends, of a prompt of ``size``
        tokens: ``hi`` rounded down to a boundary (up to the next one when that leaves
        nothing), the prompt's end if it would leave one token, at least two tokens."""
        if not 0 <= lo < size or hi <= lo:
            raise ValueError(f"no piece [{lo}, {hi}) of a {size}-token prompt")
        hi = min(hi, size)
        if not self.block or hi == size:
            return hi
        aligned = hi // self.block * self.block
        hi = aligned if aligned > lo else min(size, (lo // self.block + 1) * self.block)
        hi = max(hi, min(size, lo + 2))
        return size if size - hi == 1 else hi

    def usable_prefix(self, length: int, size: int) -> int:
        """How many of a prompt's ``size`` tokens a cached prefix of ``length`` may give:
        up to a boundary, leaving at least two tokens to prefill (0: none)."""
        if not self.block:
            return min(length, size - 1)
        usable = min(length, size - 2)
        return max(0, usable // self.block * self.block)

    @property
    def on(self) -> bool:
        return self.block > 0


CANONICAL = PieceRule()  # anywhere, but never a lone token: the engine's default
ANYWHERE = PieceRule(0)
