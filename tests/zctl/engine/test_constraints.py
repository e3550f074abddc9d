"""Structured output in the engine (zctl.engine.constraints): grammars compiled against the tiny
tokenizer hold a random model's output to a JSON Schema, a regex, a GBNF grammar or a list
of choices, greedy and sampled; bad grammars are refused with the reason; a stream whose
grammar fails mid-way fails alone."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.zctl.engine.test_sampling import TableModel
from zctl.engine.constraints import GrammarCompiler, GrammarQueue, TokenConstraint, allowed_tokens
from zctl.engine.executor import InlineExecutor, StepReply
from zctl.engine.requests import GenerationRequest, RequestRefused
from zctl.engine.sampling import SamplingParams
from zctl.engine.scheduler import run_session, run_sessions
from zctl.engine.sessions import DecodeSession, last_row
from zctl.engine.tokenizer import ChatTokenizer

# a schema whose every value is bounded, so a random model's output ends within max_tokens
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", None]}}}


class RandomModel(TableModel):
    """TableModel's fake pipeline, its logits for (token, position) a fixed random row over
    the tiny tokenizer's vocabulary (made when asked); it counts its steps."""

    def __init__(self, vocab: int) -> None:
        InlineExecutor.__init__(self)
        self.vocab, self.steps = vocab, 0

    def row(self, token: int, position: int) -> np.ndarray:
        return np.random.default_rng([int(token), int(position)]).normal(size=self.vocab) * 3

    def compute(self, step):
        self.steps += 1
        rows = np.stack([self.row(t, p) for t, p in zip(step.token_ids, step.positions,
                                                        strict=True)])
        rows = rows if step.logits_idx is not None else rows[-1:]
        return StepReply(tokens=rows.argmax(-1), logits=rows if step.want_logits else None)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> ChatTokenizer:
    return ChatTokenizer(tiny_llama_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer: ChatTokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.backend.to_str(), tokenizer.vocab_size,
                           [tokenizer.eos_token_id])


def exact_chain(export_dir: Path, paged: bool) -> tuple[Any, ChatTokenizer, GrammarCompiler]:
    """The tiny export's 2-stage chain in one process with exact numerics (stateful or
    paged KV), its tokenizer and a grammar compiler for it."""
    from dataplane.head.local_chain import LocalChain
    from dataplane.runtime.config import RuntimeSpec

    chain = LocalChain.load(str(export_dir), RuntimeSpec(
        precision="f32", kv_cache_precision="f32", dynamic_quantization=False,
        paged_attention=paged))
    tokenizer = ChatTokenizer(export_dir)
    return chain, tokenizer, GrammarCompiler(tokenizer.backend.to_str(), tokenizer.vocab_size,
                                             [tokenizer.eos_token_id])


def generate(tokenizer: ChatTokenizer, constraint: TokenConstraint | None, max_tokens: int = 200,
             sampling: SamplingParams | None = None, **fields) -> tuple[str, DecodeSession]:
    session = DecodeSession(0, tokenizer.encode("tell me", chat=True), max_tokens,
                            [tokenizer.eos_token_id], sampling=sampling, constraint=constraint,
                            **fields)
    model = RandomModel(tokenizer.vocab_size)
    tokens = list(run_session(model, session))
    session.steps_taken = model.steps  # prefill included
    return tokenizer.decode([t for t in tokens if t != tokenizer.eos_token_id]), session


def test_the_bitmask_is_read_little_endian_per_token() -> None:
    words = np.array([0b1010, 1 << 31], dtype="<u4").tobytes()
    assert np.nonzero(allowed_tokens(words, 64))[0].tolist() == [1, 3, 63]
    assert np.nonzero(allowed_tokens(words, 40))[0].tolist() == [1, 3]
    wide = allowed_tokens(words, 80)  # logits beyond the tokenizer's tokens: never allowed
    assert wide.size == 80 and not wide[64:].any()


def test_free_text_from_the_random_model_is_not_json(tokenizer) -> None:
    text, _ = generate(tokenizer, None, max_tokens=40)
    with pytest.raises(ValueError):
        json.loads(text)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_json_schema_holds_greedy_and_sampled_output(tokenizer, compiler, temperature) -> None:
    for seed in range(3):
        sampling = SamplingParams(temperature, seed=seed)
        text, session = generate(tokenizer, compiler.constraint("json_schema", json.dumps(PERSON)),
                                 sampling=sampling)
        value = json.loads(text)
        assert set(value) == {"name", "age", "pet"}
        assert isinstance(value["name"], str) and len(value["name"]) <= 6
        assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
        assert value["pet"] in ("cat", "dog", None)
        assert session.grammar_complete and session.done
        assert session.wants_logits is True  # every logit, to mask
        assert text == json.dumps(value, ensure_ascii=False)  # json.dumps' layout


def test_json_or_text_holds_json_or_lets_go_at_the_first_text_token(tokenizer,
                                                                     compiler) -> None:
    brace = tokenizer.backend.encode("{", add_special_tokens=False).ids[-1]
    schema = json.dumps(PERSON)
    # "{" first: held to the schema to the end
    text, session = generate(tokenizer, compiler.constraint("json_or_text", schema),
                             sampling=SamplingParams(logit_bias=((brace, 100.0),)))
    assert set(json.loads(text)) == {"name", "age", "pet"} and session.grammar_complete
    assert text == json.dumps(json.loads(text), ensure_ascii=False)  # the schema's layout
    # text first: the grammar lets go, and the rest is what free decoding gives
    free, plain = generate(tokenizer, None, max_tokens=30)
    assert not free.startswith("{")
    text, session = generate(tokenizer, compiler.constraint("json_or_text", schema),
                             max_tokens=30)
    assert text == free and session.constraint is None and session.sampling is None
    assert session.wants_logits is False  # the best token only, as plain decoding reads
    assert session.steps_taken == plain.steps_taken
    for bad in ('{"type": "array"}', '{"anyOf": [{"type": "object"}, {"type": "string"}]}',
                "true"):
        with pytest.raises(RequestRefused, match="type is object"):
            compiler.constraint("json_or_text", bad)


def test_a_regex_a_gbnf_grammar_and_choices_hold_the_output(tokenizer, compiler) -> None:
    text, _ = generate(tokenizer, compiler.constraint("regex", r"\d{3}-[a-z]{2,4}/\d"))
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}/[0-9]", text), text  # \d: ASCII digits only
    gbnf = 'root ::= "The answer is " ("yes" | "no") "."'
    text, _ = generate(tokenizer, compiler.constraint("grammar", gbnf))
    assert text in ("The answer is yes.", "The answer is no."), text
    lark = 'start: "colour: " COLOUR\nCOLOUR: "red" | "green" | "blue"'
    text, _ = generate(tokenizer, compiler.constraint("grammar", lark))
    assert text in ("colour: red", "colour: green", "colour: blue"), text
    choices = ["alpha", "beta gamma", "delta"]
    for seed in range(4):
        text, _ = generate(tokenizer, compiler.constraint("choice", json.dumps(choices)),
                           sampling=SamplingParams(1.0, seed=seed))
        assert text in choices


def test_a_regex_digit_is_an_ascii_digit(tokenizer, compiler) -> None:
    def fits(text: str) -> bool:
        constraint = compiler.constraint("regex", r"\d\d")
        try:
            for token in tokenizer.backend.encode(text, add_special_tokens=False).ids:
                constraint.accept(token)
        except RuntimeError:
            return False
        return True

    assert fits("42") and not fits("4\u0663") and not fits("x")  # ARABIC-INDIC DIGIT THREE


def test_an_output_cut_by_max_tokens_is_a_prefix_of_the_grammar(tokenizer, compiler) -> None:
    text, session = generate(tokenizer, compiler.constraint("json_schema", json.dumps(PERSON)),
                             max_tokens=3)
    assert not session.grammar_complete and len(session.emitted) == 3
    assert text.startswith('{"')


@pytest.mark.parametrize(("kind", "text", "why"), [
    ("json_schema", '{"type": "frob"}', "frob"),
    ("json_schema", "{not json", "not JSON"),
    ("json_schema", "[1, 2]", "is an object"),
    ("json_schema", "false", "admits no output"),
    ("regex", "[a-z+", "unclosed character class"),
    ("grammar", "root ::= (", ""),
    ("choice", "[]", "1..256 non-empty strings"),
    ("choice", '["a", 3]', "non-empty strings"),
    ("choice", "nope", "not a JSON list"),
    ("xml", "<a/>", "grammar_kind is one of"),
])
def test_bad_grammars_are_refused_with_the_reason(compiler, kind, text, why) -> None:
    with pytest.raises(RequestRefused, match=re.escape(why)):
        compiler.constraint(kind, text)


def test_the_schema_true_admits_any_json(tokenizer, compiler) -> None:
    text, session = generate(tokenizer, compiler.constraint("json_schema", "true"),
                             max_tokens=300)
    if session.grammar_complete:
        json.loads(text)  # a whole JSON value
    else:
        assert len(session.emitted) == 300  # cut by max_tokens
    assert text[:1] and text[0] in '{["-0123456789tfn', text


def test_every_stop_token_may_end_an_output_the_grammar_accepts(tokenizer) -> None:
    stops = [tokenizer.eos_token_id, tokenizer.backend.token_to_id("</s>")]
    compiler = GrammarCompiler(tokenizer.backend.to_str(), tokenizer.vocab_size, stops)
    constraint = compiler.constraint("regex", "a+")
    for token in tokenizer.backend.encode("a", add_special_tokens=False).ids:
        constraint.accept(token)
    row = constraint.mask(np.zeros(tokenizer.vocab_size))
    assert all(np.isfinite(row[t]) for t in stops) and not constraint.complete


def test_requests_name_a_grammar_with_its_kind() -> None:
    assert GenerationRequest("r", "hi", grammar_kind="regex", grammar="a+").problem() is None
    for bad in (dict(grammar_kind="regex"), dict(grammar="a+"),
                dict(grammar_kind="xml", grammar="<a/>"),
                dict(grammar_kind="regex", grammar="a" * (1 << 16 + 1))):
        assert GenerationRequest("r", "hi", **bad).problem() is not None


def test_drafts_stop_where_the_grammar_forces_tokens(tokenizer, compiler) -> None:
    """usable_drafts keeps the drafts the grammar allows up to where a forced run begins,
    and leaves the grammar as it was; mask_rows masks each row after the drafts before it."""
    constraint = compiler.constraint("json_schema", json.dumps(PERSON))
    start = constraint.forced()
    assert start  # '{"name": "' is forced at first
    for token in start:
        constraint.accept(token)
    text = 'Ann", "age": 7, "pet": "cat"}'
    draft = tokenizer.backend.encode(text, add_special_tokens=False).ids
    kept = constraint.usable_drafts(draft)
    assert draft[:len(kept)] == kept and tokenizer.decode(kept) == "Ann"  # the string's
    # closing quote is dropped: the forced run ', "age": ' begins after it
    assert not constraint.forced()  # the grammar is where it was
    newline = tokenizer.backend.encode("\n", add_special_tokens=False).ids
    assert constraint.usable_drafts(newline) == []  # a raw newline inside a JSON string
    rows = constraint.mask_rows(np.zeros((len(kept) + 1, tokenizer.vocab_size)), kept)
    for i, token in enumerate(kept):
        assert np.isfinite(rows[i, token])
    assert not constraint.forced() and np.isfinite(constraint.mask(np.zeros(
        tokenizer.vocab_size))[kept[0]])  # the grammar is where it was


@pytest.mark.parametrize("paged", [False, True], ids=["stateful", "paged"])
def test_lookup_drafts_checked_by_the_grammar_give_plain_decodings_tokens(dp_export2,
                                                                           paged) -> None:
    """With drafts (prompt lookup) a constrained stream emits exactly the tokens it emits
    without: each draft is masked and verified, and drafts stop where forced runs begin."""
    from zctl.engine.drafting import LookupDrafter

    chain, tokenizer, compiler = exact_chain(dp_export2, paged)
    eos = [tokenizer.eos_token_id]
    schema = json.dumps({"type": "object", "required": ["a", "b"], "additionalProperties": False,
                         "properties": {"a": {"type": "string", "maxLength": 24},
                                        "b": {"type": "string", "maxLength": 24}}})
    prompt = tokenizer.encode('copy {"a": "one two three", "b": "one two three"} and '
                              '{"a": "one two three"', chat=True)
    for temperature in (0.0, 1.0):
        sampling = SamplingParams(temperature, seed=5)
        plain = DecodeSession(1, prompt, 60, eos, sampling=sampling,
                              constraint=compiler.constraint("json_schema", schema))
        want = list(run_session(chain, plain))
        drafted = DecodeSession(2, prompt, 60, eos, sampling=sampling, k=4,
                                drafter=LookupDrafter(),
                                constraint=compiler.constraint("json_schema", schema))
        got = list(run_session(chain, drafted))
        assert drafted.spec.proposed > 0  # drafts were checked
        if temperature == 0:
            assert got == want
        text = tokenizer.decode([t for t in got if t not in eos])
        assert drafted.grammar_complete and set(json.loads(text)) == {"a", "b"}


def test_forced_tokens_ride_in_one_step(tokenizer, compiler) -> None:
    """A schema's keys and punctuation are forced: fed in one step each run of them, so the
    output takes fewer steps than tokens; logprobs turn that off (each position is read)."""
    schema = json.dumps(PERSON)
    text, session = generate(tokenizer, compiler.constraint("json_schema", schema))
    check = json.loads(text)
    assert set(check) == {"name", "age", "pet"}
    assert session.steps_taken <= len(session.emitted) - 10, (session.steps_taken, text)
    read_text, read = generate(tokenizer, compiler.constraint("json_schema", schema),
                               top_logprobs=0)
    assert read.steps_taken == len(read.emitted) == len(read.logprobs)  # a step per token
    assert set(json.loads(read_text)) == {"name", "age", "pet"}


def test_forced_tokens_keep_to_max_tokens(tokenizer, compiler) -> None:
    schema = json.dumps({"type": "object", "required": ["a_rather_long_key_name_to_force"],
                         "additionalProperties": False,
                         "properties": {"a_rather_long_key_name_to_force": {"type": "boolean"}}})
    whole, _ = generate(tokenizer, compiler.constraint("json_schema", schema))
    assert whole in ('{"a_rather_long_key_name_to_force": true}',
                     '{"a_rather_long_key_name_to_force": false}')
    for limit in range(1, 12):
        text, session = generate(tokenizer, compiler.constraint("json_schema", schema),
                                 max_tokens=limit)
        assert len(session.emitted) == limit and whole.startswith(text), (limit, text)


def test_last_row_takes_a_replys_last_answer() -> None:
    reply = StepReply(np.array([4, 5, 6]), np.arange(12.0).reshape(3, 4), [1.0], 7)
    last = last_row(reply)
    assert last.tokens.tolist() == [6] and last.logits.tolist() == [[8.0, 9.0, 10.0, 11.0]]
    assert (last.stage_ms, last.request_id) == ([1.0], 7)


class BrokenConstraint(TokenConstraint):
    """Allows every token, then refuses the third it is given."""

    def __init__(self, vocab: int) -> None:
        super().__init__(None, vocab)
        self.taken = 0

    def mask(self, row: np.ndarray) -> np.ndarray:
        return np.array(row, dtype=np.float64)

    def accept(self, token: int) -> None:
        self.taken += 1
        if self.taken == 3:
            raise RuntimeError(f"token {token} breaks the grammar")

    def forced(self) -> list[int]:
        return []

    @property
    def complete(self) -> bool:
        return False


def test_a_stream_whose_grammar_breaks_fails_alone(tokenizer) -> None:
    vocab = tokenizer.vocab_size
    broken = DecodeSession(0, [5, 6, 7], 10, constraint=BrokenConstraint(vocab))
    healthy = DecodeSession(1, [5, 6, 7], 10)
    updates = list(run_sessions(RandomModel(vocab), [broken, healthy]))
    assert isinstance(broken.error, RuntimeError) and "breaks the grammar" in str(broken.error)
    assert len(broken.emitted) == 2
    assert healthy.error is None and len(healthy.emitted) == 10
    assert sum(len(u.tokens) for u in updates if u.session is healthy) == 10


@pytest.mark.parametrize("paged", [False, True], ids=["stateful-padded", "paged-ragged"])
def test_constrained_rows_in_a_row_group_answer_as_alone(dp_export2, paged) -> None:
    """Forced runs make rows of several tokens beside one-token rows: padded on stateful
    stages, ragged on paged ones; every row's tokens are those of its stream alone."""
    chain, tokenizer, compiler = exact_chain(dp_export2, paged)
    eos = [tokenizer.eos_token_id]
    prompts = [tokenizer.encode(p, chat=True) for p in ("tell me", "one two", "three")]

    def sessions() -> list[DecodeSession]:
        held = [DecodeSession(i, p, 60, eos, constraint=compiler.constraint(
            "json_schema", json.dumps(PERSON))) for i, p in enumerate(prompts[:2])]
        return [*held, DecodeSession(2, prompts[2], 24, eos)]

    alone = [list(run_session(chain, s)) for s in sessions()]
    grouped = sessions()
    list(run_sessions(chain, grouped, row_groups=1))
    assert [s.emitted for s in grouped] == alone
    for session in grouped[:2]:
        assert session.grammar_complete
    assert all(not r.streams for r in chain.runners)  # every stream freed


def test_the_grammar_queue_compiles_off_the_calling_thread(tokenizer) -> None:
    import threading

    made_on: list[int] = []

    def make() -> GrammarCompiler:
        made_on.append(threading.get_ident())
        return GrammarCompiler(tokenizer.backend.to_str(), tokenizer.vocab_size,
                               [tokenizer.eos_token_id])

    queue = GrammarQueue(make)
    try:
        assert queue.ready("nothing")  # not started: nothing to wait for
        queue.start("a", "regex", "[0-9]+")
        queue.start("b", "regex", "[a-z+")
        assert queue.ready("a", 5.0) and queue.ready("b", 5.0)
        assert made_on and made_on[0] != threading.get_ident() and len(made_on) == 1
        assert isinstance(queue.take("a"), TokenConstraint)
        assert queue.take("a") is queue.take("a")  # kept until forgotten
        with pytest.raises(RequestRefused, match="unclosed character class"):
            queue.take("b")
        queue.forget("a")
        queue.forget("b")
        queue.forget("never")
        with pytest.raises(KeyError):
            queue.take("a")
    finally:
        queue.close()


def test_the_engine_steps_other_streams_while_a_grammar_compiles(dp_export2) -> None:
    """A slow compile (the first grammar builds the compiler) holds only its own request:
    a running stream keeps getting tokens meanwhile; a bad grammar is refused; a cancelled
    compiling request ends at once."""
    import threading
    import time

    from dataplane.head.local_chain import LocalChain
    from dataplane.runtime.config import RuntimeSpec
    from zctl.engine.core import GenerationEngine
    from zctl.engine.requests import GenerationChunk, GenerationDone

    chain = LocalChain.load(str(dp_export2), RuntimeSpec(precision="f32"))
    tokenizer = ChatTokenizer(dp_export2)
    engine = GenerationEngine(tokenizer, [tokenizer.eos_token_id], lambda: chain)
    gate = threading.Event()
    make = engine.grammars._make

    def slow_make() -> GrammarCompiler:
        gate.wait(30)
        return make()

    engine.grammars._make = slow_make
    try:
        engine.submit("free", GenerationRequest("f", "one two", 400, ignore_eos=True,
                                                chunk_interval_ms=0))
        seen: list = []
        while not any(c == "free" and isinstance(e, GenerationChunk) for c, e in seen):
            seen += engine.poll(0.0)
        engine.submit("held", GenerationRequest("h", "tell me", 40, grammar_kind="regex",
                                                grammar="[0-9]{3}"))
        engine.submit("gone", GenerationRequest("g", "tell me", 40, grammar_kind="regex",
                                                grammar="[a-z]+"))
        assert engine.cancel("gone", "g")
        start = time.monotonic()
        while time.monotonic() - start < 0.3:  # the compiler is not made yet
            seen += engine.poll(0.0)
        free_tokens = sum(len(e.tokens) for c, e in seen
                          if c == "free" and isinstance(e, GenerationChunk))
        assert free_tokens >= 5 and engine.waiting == 1  # only the held request waits
        gate.set()
        engine.submit("bad", GenerationRequest("b", "tell me", 40, grammar_kind="regex",
                                               grammar="[a-z+"))
        while sum(isinstance(e, GenerationDone) for _, e in seen) < 4:
            seen += engine.poll(0.02)
        dones = {c: e for c, e in seen if isinstance(e, GenerationDone)}
        assert dones["gone"].stop_reason == "cancelled"
        assert dones["free"].stop_reason == "max_tokens" and len(dones["free"].tokens) == 400
        held = tokenizer.decode([t for t in dones["held"].tokens if t != tokenizer.eos_token_id])
        assert re.fullmatch("[0-9]{3}", held) and dones["held"].stop_reason == "stop"
        assert dones["bad"].error_kind == "bad_request" and "unclosed" in dones["bad"].error
        assert not engine.grammars._jobs  # every job forgotten
    finally:
        gate.set()
        engine.grammars.close()


def test_a_constrained_session_restarted_mid_way_gives_the_same_output(dp_export2) -> None:
    """The stream's KV lost between steps, or with a step of forced tokens planned and
    never answered (a node went down under it): the session replays onto fresh KV and
    its grammar goes on where the emitted tokens left it."""
    chain, tokenizer, compiler = exact_chain(dp_export2, paged=False)
    prompt = tokenizer.encode("tell me", chat=True)

    def session() -> DecodeSession:
        return DecodeSession(3, prompt, 60, [tokenizer.eos_token_id], prefill_chunk=4,
                             constraint=compiler.constraint("json_schema", json.dumps(PERSON)))

    want = list(run_session(chain, session()))
    dropped: list[int] = []  # tokens fed by each lost decode step (0: a prefill step)
    for lost_at in (2, 4, 6, 9):
        s = session()
        chain.open(3)
        chain.reset(3)
        steps = 0
        while not s.done:
            decoding = bool(s.emitted)
            plan = s.plan()
            if steps == lost_at:  # this step never answers: the node went down under it
                dropped.append(len(plan.token_ids) if decoding else 0)
                chain.reset(3)
                s.restart()
                plan = s.plan()
            s.advance(chain.compute(plan))
            steps += 1
        chain.close_stream(3)
        assert s.emitted == want, lost_at
    assert max(dropped) > 1 and 0 in dropped, dropped  # lost: forced tokens, a prefill chunk
    assert json.loads(tokenizer.decode([t for t in want if t != tokenizer.eos_token_id]))
