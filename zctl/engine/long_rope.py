"""Which of LongRoPE's two sets of frequencies a sequence's prompt turns with (pure).

Phi-3 128k, Phi-3.5 and Phi-4-mini have a short and a long set, and a threshold
(``original_max_position_embeddings``, the manifest's ``rope_short_context``). Hugging
Face's forward picks the set for a whole pass from its highest position (the long one when
that position reaches the threshold), and a greedy generation runs the prompt in one pass,
then one token a pass: so a prompt longer than the threshold turns every one of its tokens
long, and every later token is past the threshold too; a shorter prompt turns short, and
each later token by its own position. The engine feeds a prompt in pieces (chunked
prefill, the rest of a prefix-cache hit), whose positions alone cannot say which: it
resets the stream of a prompt longer than the threshold with ``long_rope`` (the stages
then turn all its tokens long), and a prefix-cache entry keeps the set its keys were made
with, so that only a prompt of the same set reuses them.
"""

from __future__ import annotations


def long_rope_prompt(prompt_tokens: int, short_context: int) -> bool:
    """Whether a sequence whose prompt holds ``prompt_tokens`` tokens turns with the long
    set throughout, on a model whose threshold is ``short_context`` (0: one set)."""
    return 0 < short_context < prompt_tokens
