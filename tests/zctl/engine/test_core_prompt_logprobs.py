"""A prompt's own logprobs (``GenerationRequest.prompt_logprobs``): each token's under the
tokens before it, read from every position of the prefill chunks, equal to one step over
the whole prompt; the first chunk carries them even when the first new token ends the
stream; a cached prefix is not used for such a prompt; a restart mid-prompt gives the same."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dataplane.head.local_chain import LocalChain
from dataplane.runtime.config import RuntimeSpec
from tests.zctl.engine.test_core import drive, engine_for
from zctl.engine import admission
from zctl.engine.requests import GenerationChunk, GenerationDone, GenerationRequest
from zctl.engine.sampling import log_softmax
from zctl.engine.scheduler import generate_greedy
from zctl.engine.sessions import DecodeSession
from zctl.engine.tokenizer import ChatTokenizer

PROMPT = ("the quick brown fox jumps over the lazy dog while the sky is blue and one two "
          "three four five six seven")


CHUNK = 16  # a scored prompt's steps here (the tiny vocabulary would take it whole)


@pytest.fixture(autouse=True)
def small_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission, "SCORING_STEP_BYTES", 0)  # scoring_chunk's least: 16
    assert admission.scoring_chunk(512) == CHUNK


@pytest.fixture(scope="module")
def setup(tiny_exports):
    export_dir: Path = tiny_exports.get([(0, 2), (2, 4)])
    chain = LocalChain.load(str(export_dir),  # exact numerics: an f32 KV cache too
                            RuntimeSpec(precision="f32", kv_cache_precision="f32"))
    return export_dir, chain, ChatTokenizer(export_dir)


def whole_prompt_logprobs(chain: LocalChain, ids: list[int]) -> np.ndarray:
    """log_softmax at every position of the prompt, in one step."""
    chain.open(99)
    chain.reset(99)
    reply = chain.step(99, np.array(ids), np.arange(len(ids)), np.arange(len(ids)),
                       want_logits=True)
    chain.close_stream(99)
    return log_softmax(reply.logits.reshape(len(ids), -1))


def scored(engine, request: GenerationRequest) -> tuple[list, GenerationDone]:
    engine.submit("a", request)
    seen = drive(engine, lambda s: not engine.busy)
    chunks = [e for _, e in seen if isinstance(e, GenerationChunk)]
    assert [bool(c.prompt_logprobs) for c in chunks][:1] == [True]
    assert not any(c.prompt_logprobs for c in chunks[1:])  # in the first chunk only
    done = next(e for _, e in seen if isinstance(e, GenerationDone))
    first = chunks[0].prompt_logprobs[0]
    assert first.logprob == 0.0 and not first.top_tokens  # nothing before it
    return chunks[0].prompt_logprobs, done


@pytest.mark.parametrize("top", [0, 3])
def test_a_prompts_logprobs_are_one_steps_over_the_whole_prompt(setup, top) -> None:
    _, chain, tokenizer = setup
    ids = tokenizer.encode(PROMPT, chat=False)
    assert len(ids) > 2 * CHUNK  # several chunks
    every, done = scored(engine_for(setup), GenerationRequest(
        "p", PROMPT, 4, chat=False, ignore_eos=True, logprobs=True, top_logprobs=top,
        prompt_logprobs=True, chunk_interval_ms=0))
    assert [lp.token for lp in every] == ids
    assert "".join(lp.text for lp in every) == tokenizer.decode(ids)  # pieces of its text
    want, lps = whole_prompt_logprobs(chain, ids), every[1:]
    for i, lp in enumerate(lps):  # token i + 1 under the tokens before it
        assert abs(lp.logprob - want[i, lp.token]) < 1e-4
        assert len(lp.top_tokens) == top
        if top:
            assert lp.top_tokens[0] == int(want[i].argmax())
    assert done.tokens == list(generate_greedy(chain, ids, 4))  # and it generates as ever


def test_the_first_chunk_carries_them_when_the_first_token_ends_the_stream(setup) -> None:
    _, chain, tokenizer = setup
    ids = tokenizer.encode(PROMPT, chat=False)
    first = list(generate_greedy(chain, ids, 1))[0]
    engine = engine_for(setup)
    engine.stop_ids = [first]  # the first new token is a stop token: no text to send
    engine.submit("a", GenerationRequest("p", PROMPT, 4, chat=False, logprobs=True,
                                         prompt_logprobs=True, chunk_interval_ms=0))
    seen = drive(engine, lambda s: not engine.busy)
    chunks = [e for _, e in seen if isinstance(e, GenerationChunk)]
    done = next(e for _, e in seen if isinstance(e, GenerationDone))
    assert done.stop_reason == "eos" and done.tokens == [first]
    assert len(chunks) == 1 and chunks[0].tokens == [] and chunks[0].text == ""
    assert len(chunks[0].prompt_logprobs) == len(ids)


def test_a_scored_prompt_runs_whole_beside_the_prefix_cache(setup) -> None:
    _, chain, tokenizer = setup
    engine = engine_for(setup, prefix_cache_tokens=4096)
    plain = GenerationRequest("c", PROMPT, 2, chat=False, ignore_eos=True)
    engine.submit("a", plain)
    drive(engine, lambda s: not engine.busy)
    lps, done = scored(engine, GenerationRequest(
        "p", PROMPT, 2, chat=False, ignore_eos=True, logprobs=True, prompt_logprobs=True))
    assert done.cached_tokens == 0 and len(lps) == len(tokenizer.encode(PROMPT, chat=False))
    engine.submit("a", plain)  # and a plain one still finds it
    seen = drive(engine, lambda s: not engine.busy)
    assert next(e for _, e in seen if isinstance(e, GenerationDone)).cached_tokens > 0


def test_a_restart_mid_prompt_scores_it_the_same(setup) -> None:
    _, chain, tokenizer = setup
    ids = tokenizer.encode(PROMPT, chat=False)
    session = DecodeSession(7, ids, 2, top_logprobs=0, prompt_logprobs=True, prefill_chunk=CHUNK)
    chain.open(7)
    chain.reset(7)
    session.advance(chain.compute(session.plan()))
    session.restart()  # the stages lost the stream after its first chunk
    chain.reset(7)
    while not session.done:
        session.advance(chain.compute(session.plan()))
    chain.close_stream(7)
    want = whole_prompt_logprobs(chain, ids)
    assert all(abs(lp.logprob - want[i, lp.token]) < 1e-4
               for i, lp in enumerate(session.prompt_logprobs))


def test_a_prompt_scored_beside_a_decoding_stream(setup) -> None:
    """A scored prompt arriving while another stream decodes (its chunks may ride in the
    other's steps): both come out as they do alone."""
    _, chain, tokenizer = setup
    ids = tokenizer.encode(PROMPT, chat=False)
    engine = engine_for(setup)
    engine.submit("a", GenerationRequest("a", "one two three", 40, chat=False, ignore_eos=True,
                                         chunk_interval_ms=0))
    seen = drive(engine, lambda s: any(isinstance(e, GenerationChunk) for _, e in s))
    engine.submit("b", GenerationRequest("b", PROMPT, 4, chat=False, ignore_eos=True,
                                         logprobs=True, prompt_logprobs=True))
    seen += drive(engine, lambda s: not engine.busy)
    done = {e.request_id: e for _, e in seen if isinstance(e, GenerationDone)}
    assert done["a"].tokens == list(generate_greedy(chain, tokenizer.encode("one two three",
                                                                            chat=False), 40))
    assert done["b"].tokens == list(generate_greedy(chain, ids, 4))
    lps = next(e.prompt_logprobs for c, e in seen if c == "b" and isinstance(e, GenerationChunk)
               and e.prompt_logprobs)
    want = whole_prompt_logprobs(chain, ids)
    assert all(abs(lp.logprob - want[i, lp.token]) < 1e-4 for i, lp in enumerate(lps[1:]))
