"""tools.serving.prefill's prompts: chat conversations of an exact token count.

A prompt is one user message: a header naming the prompt (a digest of its key, so no two
prompts share more than the chat template's system turn and the header's first word), a
document of shipped prose (exporter/quality_prose.txt, its paragraphs shuffled by the key
and repeated to length) cut at a word and padded with " ." pieces, and an instruction.
It is fitted so that the conversation, rendered by the export's own chat template and
tokenizer (zctl.engine.tokenizer.ChatTokenizer, the one zctl's engine uses), is exactly N token
ids, generation prompt included: what ``usage.prompt_tokens`` reports and what both
systems are fed.

A follow-up turn (the conversation, the first answer as the assistant's turn, one more
user message) is fitted to exactly the first turn's ids + the answer's token count + K.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from typing import Protocol

from exporter.quality import PROSE_FILE

INSTRUCTION = "Summarise the record above in detail."
FOLLOW_UP = ("Thank you. Now list the three most important facts in the record, explain "
             "why each one matters to the town, and say which of them surprised you most.")
# Pieces a fitted text ends with, tried in turn: one token each after a word in most
# byte-level BPE vocabularies (SmolLM2's: " ." " -" " *" " a"; a tiny one's: " a" ".")
PADS = (" .", " -", " *", " a", ".")
MAX_PAD = 12
Message = tuple[str, str]  # (role, content)


class Encoder(Protocol):
    """What the prompts need of a tokenizer (zctl.engine.tokenizer.ChatTokenizer has it)."""

    def encode_chat(self, messages: list[Message]) -> list[int]: ...


def fit_text(count: Callable[[str], int], target: int, words: Sequence[str],
             pads: Sequence[str] = PADS) -> str:
    """Text made of the longest prefix of ``words`` (space-joined) that keeps
    ``count(text) <= target``, then up to MAX_PAD pieces of one of ``pads``, such that
    ``count(text) == target`` exactly (a shorter prefix is tried when no pad lands on it).
    ValueError when ``target`` is below ``count("")`` (the fixed part of the prompt), above
    what ``words`` reach, or cannot be hit."""
    floor = count("")
    if target < floor:
        raise ValueError(f"{target} tokens is fewer than the prompt's fixed part ({floor})")
    if count(" ".join(words)) < target:
        raise ValueError(f"not enough text for {target} tokens")
    lo, hi = 0, len(words)  # invariant: count(words[:lo]) <= target
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(" ".join(words[:mid])) <= target:
            lo = mid
        else:
            hi = mid - 1
    for w in range(lo, max(-1, lo - 8), -1):
        base = " ".join(words[:w])
        for pad in pads:
            for k in range(MAX_PAD + 1):
                n = count(base + pad * k)
                if n == target:
                    return base + pad * k
                if n > target:
                    break
    raise ValueError(f"no text of exactly {target} tokens found")


def digest(key: str) -> str:
    """Eight hex digits naming ``key`` (stable across runs and machines)."""
    return hashlib.sha256(key.encode()).hexdigest()[:8]


def document_words(key: str, tokens: int) -> list[str]:
    """Words of the prose, its paragraphs shuffled by ``key`` and repeated (each copy
    shuffled anew) until there are comfortably more than ``tokens`` tokens of them."""
    paragraphs = [p.strip() for p in PROSE_FILE.read_text(encoding="utf-8").split("\n\n")
                  if p.strip()]
    rng = random.Random(digest(key))
    words: list[str] = []
    while len(words) < tokens * 1.2 + 64:  # English prose: ~1.3 tokens a word
        order = paragraphs[:]
        rng.shuffle(order)
        words += "\n\n".join(order).split(" ")
    return words


def first_turn(tokenizer: Encoder, tokens: int, key: str) -> list[Message]:
    """A one-message conversation of exactly ``tokens`` ids through the chat template,
    unique to ``key``."""
    header = f"Record {digest(key)} of the town archive.\n\n"

    def count(body: str) -> int:
        return len(tokenizer.encode_chat([("user", f"{header}{body}\n\n{INSTRUCTION}")]))

    body = fit_text(count, tokens, document_words(key, tokens))
    return [("user", f"{header}{body}\n\n{INSTRUCTION}")]


def follow_up_turn(tokenizer: Encoder, conversation: Sequence[Message], answer: str,
                   answer_tokens: int, extra: int) -> list[Message]:
    """The conversation, ``answer`` as the assistant's turn and one more user message,
    fitted so that it is exactly (the conversation's ids) + ``answer_tokens`` + ``extra``
    ids long: the second turn of a chat, appending ``extra`` tokens (the closing of the
    answer, the new user turn and the generation prompt among them) to the first turn's
    prompt and answer."""
    history = [*conversation, ("assistant", answer)]
    target = len(tokenizer.encode_chat(list(conversation))) + answer_tokens + extra
    words = (FOLLOW_UP.split(" ") * (extra // 8 + 2))

    def count(text: str) -> int:
        return len(tokenizer.encode_chat([*history, ("user", text)]))

    return [*history, ("user", fit_text(count, target, words))]


def fixed_part(tokenizer: Encoder) -> int:
    """The fewest tokens a first turn can have (its template, header and instruction)."""
    header = f"Record {digest('')} of the town archive.\n\n"
    return len(tokenizer.encode_chat([("user", f"{header}\n\n{INSTRUCTION}")]))


def follow_up_floor(tokenizer: Encoder) -> int:
    """About the fewest tokens a follow-up turn appends (the answer's closing, an empty
    user turn, the generation prompt)."""
    first = [("user", "x")]
    empty = [*first, ("assistant", "x"), ("user", "")]
    return len(tokenizer.encode_chat(empty)) - len(tokenizer.encode_chat(first)) - 1


class PromptBook:
    """First turns by key, fitted once each (a 4,096-token fit takes ~0.1 s)."""

    def __init__(self, tokenizer: Encoder) -> None:
        self.tokenizer = tokenizer
        self._made: dict[tuple[int, str], list[Message]] = {}

    def turn(self, tokens: int, key: str) -> list[Message]:
        """The first turn of ``tokens`` ids for ``key`` (e.g. "shared/chat/1024/0")."""
        if (tokens, key) not in self._made:
            self._made[tokens, key] = first_turn(self.tokenizer, tokens, f"{key}/{tokens}")
        return self._made[tokens, key]
