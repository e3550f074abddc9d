"""Structured output: hold a stream's output to a JSON Schema, a regular expression, a
grammar (Lark, or llama.cpp's GBNF), a list of choices, or JSON of a schema or else text
(``json_or_text``: text never begins with ``{``, and once the first token shows the
output is text the constraint lets go, so the rest decodes as free text does).

llguidance, the grammar engine behind vLLM's and llama.cpp's structured outputs, compiles
the grammar against the model's tokenizer. A ``TokenConstraint`` follows one stream's
output: before each token is chosen it masks the logits to the tokens that keep the output
inside the grammar, and it ends the stream once the grammar is complete. Where the grammar
allows only one continuation (a schema's keys and punctuation), those tokens are fed in
one step without choosing them (jump-forward decoding). It is host work on the
coordinator (the sessions apply it, zctl.engine.sessions): the stages are unchanged.

JSON is held to one layout (``", "`` between items, ``": "`` after keys, no other
whitespace) unless the schema's ``x-guidance`` options say otherwise: free whitespace
lets a small model pad its output with newlines until it runs out of tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from zctl.engine.requests import GRAMMAR_KINDS, RequestRefused

# llguidance's JSON options before a schema's own ``x-guidance`` (json.dumps' layout)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CHOICES = 256  # the most choices a "choice" grammar lists


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # a coordinator installed without it
        raise RequestRefused("structured output needs the llguidance package on the "
                             "coordinator (pip install llguidance)") from exc
    return llguidance


def _reason(matcher: Any) -> str:
    """The matcher's error, without the grammar text llguidance appends to some."""
    return str(matcher.get_error()).split("\n<grammar>")[0].strip()


def _schema(text: str) -> dict[str, Any]:
    """A request's JSON schema (``true``: any JSON, ``{}``); RequestRefused if it is not one."""
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise RequestRefused(f"the JSON schema is not JSON: {exc}") from exc
    if schema is False:
        raise RequestRefused("the JSON schema false admits no output")
    if not isinstance(schema, dict | bool):
        raise RequestRefused("a JSON schema is an object (or true)")
    return {} if schema is True else schema


def _objects_only(schema: dict[str, Any]) -> bool:
    """The schema admits only JSON objects (which begin with "{")."""
    if "anyOf" in schema:
        return bool(schema["anyOf"]) and all(isinstance(s, dict) and _objects_only(s)
                                             for s in schema["anyOf"])
    return schema.get("type") == "object"


def grammar_definition(kind: str, text: str) -> str:
    """llguidance's grammar for a request's ``grammar_kind`` and ``grammar`` (validated by
    compiling it: ``GrammarCompiler.constraint``)."""
    llg = _llguidance()
    if kind in ("json_schema", "json_or_text"):
        schema = _schema(text)
        if kind == "json_or_text" and not _objects_only(schema):
            raise RequestRefused("json_or_text holds a JSON object or text: its schema's type "
                                 "is object (or anyOf objects)")
        try:
            if kind == "json_or_text":  # the JSON in JSON_LAYOUT, or text not starting "{"
                options = schema.get("x-guidance", {})
                if not isinstance(options, dict):
                    raise RequestRefused("the JSON schema's x-guidance is an object")
                call = json.dumps({**schema, "x-guidance": {**JSON_LAYOUT, **options}})
                return llg.grammar_from("lark", f"start: json | TEXT\njson: %json {call}\n"
                                                "TEXT: /[^{](.|\\n)*/\n")
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        except ValueError as exc:
            raise RequestRefused(f"the JSON schema cannot be used: {exc}") from exc
    if kind == "regex":  # \d means [0-9], as users mean it (Rust's is any Unicode digit)
        return llg.LLMatcher.grammar_from_regex(llg.regex_to_lark(text, "d"))
    if kind == "grammar":
        try:
            return llg.grammar_from("grammar", text)  # Lark, or GBNF converted to Lark
        except ValueError as exc:
            raise RequestRefused(str(exc)) from exc
    if kind == "choice":
        try:
            choices = json.loads(text)
        except ValueError as exc:
            raise RequestRefused(f"the choices are not a JSON list: {exc}") from exc
        if not (isinstance(choices, list) and 0 < len(choices) <= MAX_CHOICES
                and all(isinstance(c, str) and c for c in choices)):
            raise RequestRefused(f"choices are a list of 1..{MAX_CHOICES} non-empty strings")
        return llg.grammar_from("choice", choices)
    raise RequestRefused(f"grammar_kind is one of {', '.join(GRAMMAR_KINDS)}, got {kind!r}")


def allowed_tokens(bitmask: bytes, vocab: int) -> np.ndarray:
    """llguidance's token bitmask (bit i of the little-endian words: token i allowed) as
    booleans over the model's ``vocab`` logits."""
    bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")
    allowed = np.zeros(vocab, dtype=bool)
    n = min(vocab, bits.size)
    allowed[:n] = bits[:n].astype(bool)
    return allowed


class TokenConstraint:
    """One stream's grammar: which tokens may come next, and whether it is complete.
    ``text_lets_go``: a function of the first token, true when it shows the output is free
    text from there on (``json_or_text``); ``released`` then says the grammar holds no
    more."""

    def __init__(self, matcher: Any, vocab: int,
                 text_lets_go: Callable[[int], bool] | None = None) -> None:
        self._matcher, self.vocab = matcher, vocab
        self._lets_go = text_lets_go
        self.released = False

    def mask(self, row: np.ndarray) -> np.ndarray:
        """``row`` (one position's logits) with every token the grammar forbids at -inf."""
        allowed = allowed_tokens(self._matcher.compute_bitmask(), self.vocab)
        if not allowed.any():
            raise RuntimeError(f"the grammar allows no token here: {_reason(self._matcher)}")
        out = np.array(row, dtype=np.float64)
        out[~allowed] = -np.inf
        return out

    def mask_rows(self, rows: np.ndarray, draft: Sequence[int]) -> np.ndarray:
        """A speculative step's rows masked: row i with the grammar after ``draft[:i]``
        (the drafts are ones ``usable_drafts`` kept); the grammar is left as it was."""
        taken = 0
        try:
            for i in range(rows.shape[0]):
                rows[i] = self.mask(rows[i])
                if i < len(draft):
                    self.accept(draft[i])
                    taken += 1
        finally:
            if taken:
                self._matcher.rollback(taken)
        return rows

    def usable_drafts(self, draft: Sequence[int]) -> list[int]:
        """The drafts a constrained step may feed: the longest prefix the grammar allows
        after which no forced run begins (there plain decoding feeds llguidance's forced
        tokens, which a draft or the token after it could spell otherwise, so the output
        stays what plain decoding gives). The grammar is left as it was."""
        matcher, taken = self._matcher, 0
        for token in list(draft)[:matcher.validate_tokens(list(draft))]:
            matcher.consume_token(int(token))
            taken += 1
            if matcher.compute_ff_tokens() or matcher.is_stopped():
                taken -= 1
                matcher.rollback(1)
                break
        if taken:
            matcher.rollback(taken)
        return [int(t) for t in draft[:taken]]

    def accept(self, token: int) -> None:
        """Follow the output with its next ``token`` (one the mask allowed)."""
        if not self._matcher.consume_token(int(token)):
            raise RuntimeError(f"token {token} breaks the grammar: {_reason(self._matcher)}")
        if self._lets_go is not None:  # the first token decides
            self.released, self._lets_go = self._lets_go(int(token)), None

    def forced(self) -> list[int]:
        """The tokens the grammar allows alone from here (e.g. a schema's next key), in
        llguidance's tokenization: they need no choosing, so a step feeds them at once."""
        return [int(t) for t in self._matcher.compute_ff_tokens()]

    @property
    def complete(self) -> bool:
        """The output is whole: the grammar lets nothing more follow."""
        return bool(self._matcher.is_stopped())


class GrammarCompiler:
    """Compiles requests' grammars against one model's tokenizer (made once, ~0.2 s for a
    49k-token vocabulary). ``eos_ids`` end an output the grammar accepts."""

    def __init__(self, tokenizer_json: str, vocab: int, eos_ids: Sequence[int]) -> None:
        llg = _llguidance()
        if not eos_ids:
            raise ValueError("structured output needs the model's end-of-sequence token")
        self.vocab = vocab
        self._tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=vocab,
                                          eos_token=[int(t) for t in eos_ids])
        self._llg = llg

    def constraint(self, kind: str, text: str) -> TokenConstraint:
        """A fresh constraint for one stream; RequestRefused says what is wrong with the
        grammar."""
        matcher = self._llg.LLMatcher(self._tokenizer, grammar_definition(kind, text), log_level=0)
        if matcher.is_error():
            raise RequestRefused(f"the {kind.replace('_', ' ')} cannot be used: "
                                 f"{_reason(matcher)}")
        lets_go = self._begins_text if kind == "json_or_text" else None
        return TokenConstraint(matcher, self.vocab, lets_go)

    def _begins_text(self, token: int) -> bool:
        """A ``json_or_text`` output whose first token is ``token`` is text (JSON begins
        with "{"; the grammar lets no other first token begin JSON)."""
        return not self._tokenizer.decode_bytes([token]).startswith(b"{")


class GrammarQueue:
    """Compiles requests' grammars on a thread of its own, so that the generation thread
    never waits for one (llguidance releases the GIL while it builds; the compiler itself
    takes ~0.25 s to make, at the first grammar). ``start`` a request's when it arrives,
    ``take`` its constraint once ``ready``, ``forget`` it once the request started or
    ended."""

    def __init__(self, make_compiler: Callable[[], GrammarCompiler]) -> None:
        self._make = make_compiler
        self._compiler: GrammarCompiler | None = None  # made on the worker thread
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: dict[Hashable, Future[TokenConstraint]] = {}

    def _compile(self, kind: str, text: str) -> TokenConstraint:
        if self._compiler is None:
            self._compiler = self._make()
        return self._compiler.constraint(kind, text)

    def start(self, key: Hashable, kind: str, text: str) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="zctl-grammar")
        self._jobs[key] = self._pool.submit(self._compile, kind, text)

    def ready(self, key: Hashable, wait_s: float = 0.0) -> bool:
        """Whether ``key``'s grammar is compiled (or failed; True for a key not started),
        waiting up to ``wait_s``."""
        job = self._jobs.get(key)
        if job is None:
            return True
        if not job.done() and wait_s > 0:
            try:
                job.exception(timeout=wait_s)
            except TimeoutError:
                pass
        return job.done()

    def take(self, key: Hashable) -> TokenConstraint:
        """``key``'s constraint (raises what compiling it raised: RequestRefused); it stays
        until ``forget``, for a request that goes back to wait before it starts."""
        return self._jobs[key].result()

    def forget(self, key: Hashable) -> None:
        """Drop ``key``'s job: its request started, was refused or was cancelled."""
        job = self._jobs.pop(key, None)
        if job is not None:
            job.cancel()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
