"""GenerationEngine on its own (no sockets): what each client is told, cancellation, refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dataplane.head.local_chain import LocalChain
from dataplane.runtime.config import RuntimeSpec
from zctl.engine.core import GenerationEngine
from zctl.engine.requests import (
    BAD_REQUEST,
    UNAVAILABLE,
    ChatMessage,
    GenerationChunk,
    GenerationDone,
    GenerationRequest,
)
from zctl.engine.sampling import log_softmax
from zctl.engine.sampling_defaults import model_sampling
from zctl.engine.scheduler import generate_greedy
from zctl.engine.tokenizer import ChatTokenizer
from zctl.manifest import GenerationConfig


@pytest.fixture(scope="module")
def setup(tiny_exports):
    export_dir: Path = tiny_exports.get([(0, 2), (2, 4)])
    chain = LocalChain.load(str(export_dir), RuntimeSpec(precision="f32"))
    return export_dir, chain, ChatTokenizer(export_dir)


# the tiny model's engine as for a model whose generation config says greedy: requests that
# leave sampling out decode greedily, their tokens compared with generate_greedy's
GREEDY_MODEL = model_sampling(GenerationConfig(do_sample=False))


def engine_for(setup, **kwargs) -> GenerationEngine:
    _, chain, tokenizer = setup
    return GenerationEngine(tokenizer, [], lambda: chain, **{"sampling_defaults": GREEDY_MODEL,
                                                             **kwargs})


def drive(engine: GenerationEngine, until, limit: int = 2000) -> list:
    """Poll until ``until(events so far)``; every (client, event) seen."""
    seen: list = []
    for _ in range(limit):
        seen += engine.poll(0.0)
        if until(seen):
            return seen
    raise AssertionError(f"not reached in {limit} polls: {seen[-3:]}")


def done_of(seen: list, client: str) -> GenerationDone:
    return next(e for c, e in seen if c == client and isinstance(e, GenerationDone))


def test_two_clients_get_their_own_tokens(setup) -> None:
    _, chain, tokenizer = setup
    engine = engine_for(setup)
    prompts = {"a": "the sky is", "b": "one two three"}
    for client, prompt in prompts.items():
        engine.submit(client, GenerationRequest(client + "-1", prompt, 12, ignore_eos=True))
    seen = drive(engine, lambda s: sum(isinstance(e, GenerationDone) for _, e in s) == 2)
    for client, prompt in prompts.items():
        done = done_of(seen, client)
        assert done.request_id == client + "-1" and done.stop_reason == "max_tokens"
        assert done.tokens == list(generate_greedy(chain, tokenizer.encode(prompt), 12))
        streamed = [t for c, e in seen if c == client and isinstance(e, GenerationChunk)
                    for t in e.tokens]
        assert streamed == done.tokens
    assert not engine.busy and engine.counters["peak_streams"] == 2


def test_cancel_ends_one_generation_and_leaves_the_other(setup) -> None:
    _, chain, tokenizer = setup
    engine = engine_for(setup)
    engine.submit("a", GenerationRequest("ra", "the sky is", 200, ignore_eos=True))
    engine.submit("b", GenerationRequest("rb", "one two three", 16, ignore_eos=True))
    first = drive(engine, lambda s: any(c == "a" and isinstance(e, GenerationChunk)
                                        for c, e in s))
    for _ in range(6):  # tokens made since that chunk wait for the next one (every 0.1 s)
        first += engine.poll(0.0)
    assert not engine.cancel("a", "rb") and not engine.cancel("nobody", "ra")  # not theirs
    assert engine.cancel("a", "ra")
    seen = engine.poll(0.0) + drive(engine, lambda s: not engine.busy)
    cancelled = done_of(seen, "a")
    assert cancelled.stop_reason == "cancelled" and not cancelled.error
    assert 0 < len(cancelled.tokens) < 200
    want = list(generate_greedy(chain, tokenizer.encode("the sky is"), len(cancelled.tokens)))
    assert cancelled.tokens == want  # what it had, exactly
    streamed = [t for c, e in seen if c == "a" and isinstance(e, GenerationChunk) for t in e.tokens]
    assert [t for c, e in first if c == "a" and isinstance(e, GenerationChunk)
            for t in e.tokens] + streamed == cancelled.tokens  # every token streamed first
    other = done_of(seen, "b")
    assert other.tokens == list(generate_greedy(chain, tokenizer.encode("one two three"), 16))
    assert engine.counters["cancelled"] == 1 and not engine.cancel("a", "ra")  # over now


def test_cancel_a_waiting_request(setup) -> None:
    engine = engine_for(setup, max_streams=1)
    engine.submit("a", GenerationRequest("first", "the sky is", 30, ignore_eos=True))
    engine.submit("b", GenerationRequest("queued", "hello", 30, ignore_eos=True))
    engine.poll(0.0)  # the first starts, the second waits for its stream
    assert engine.active == 1 and engine.cancel("b", "queued")
    seen = drive(engine, lambda s: not engine.busy)
    queued = done_of(seen, "b")
    assert queued.stop_reason == "cancelled" and queued.tokens == []
    assert len(done_of(seen, "a").tokens) == 30


@pytest.mark.parametrize("request_, problem", [
    (GenerationRequest("x", "hi", -1), "bad request: max_tokens must be in 0.."),
    (GenerationRequest("x", "hi " * 70, 0), "leave no room in the model's context of 64"),
    (GenerationRequest("x", "", 4), "bad request: give one of a prompt, messages or prompt token ids"),
    (GenerationRequest("x", "hi", 4, stop=["a", "b", "c", "d", "e"]), "stop takes up to 4"),
    (GenerationRequest("x", "hi", 4, logprobs=True, top_logprobs=21), "top_logprobs must be"),
    (GenerationRequest("x", "hi", 4, logits_payload="fp8"), "logits_payload must be one of"),
    (GenerationRequest("x", "", 4, messages=[ChatMessage("robot", "hi")]), "role is one of"),
    (GenerationRequest("x", "hi", 60), "exceed the model's context of 64 tokens"),
    (GenerationRequest("x", "hi", 4, temperature=-1), "bad request: temperature"),
    (GenerationRequest("x", "hi", 4, speculative="draft:/m"), "has no draft models"),
])
def test_bad_requests_are_refused_and_the_engine_keeps_serving(setup, request_, problem) -> None:
    engine = engine_for(setup, max_context=64)
    engine.submit("a", request_)
    engine.submit("b", GenerationRequest("ok", "hello", 3, ignore_eos=True))
    seen = drive(engine, lambda s: not engine.busy)
    refused = done_of(seen, "a")
    assert refused.stop_reason == "error" and problem in refused.error and refused.tokens == []
    assert refused.error_kind == BAD_REQUEST
    assert len(done_of(seen, "b").tokens) == 3 and not done_of(seen, "b").error


def test_no_executor_yet_is_refused_clearly(setup) -> None:
    _, _, tokenizer = setup
    engine = GenerationEngine(tokenizer, [], lambda: None)
    engine.submit("a", GenerationRequest("x", "hi", 3))
    (client, done), = engine.poll(0.0)
    assert client == "a" and isinstance(done, GenerationDone)
    assert "not wired yet" in done.error and not engine.busy


def kv_slots(chain: LocalChain) -> list[int]:
    """KV slots held on each stage, over its streams and row groups."""
    return [sum(s.physical for s in r.streams.values()) + sum(
        g.physical for g in r.groups.values()) for r in chain.runners]


def test_a_cancelled_or_finished_stream_frees_its_kv_on_every_stage(setup) -> None:
    _, chain, _ = setup
    engine = engine_for(setup)
    engine.submit("a", GenerationRequest("long", "count with me", 40, ignore_eos=True,
                                         chunk_interval_ms=0))
    engine.submit("b", GenerationRequest("short", "hello", 3, ignore_eos=True))
    drive(engine, lambda s: any(c == "a" and isinstance(e, GenerationChunk) and e.produced >= 5
                                for c, e in s))
    assert all(n > 0 for n in kv_slots(chain))
    assert engine.cancel("a", "long")
    seen = drive(engine, lambda s: not engine.busy)
    assert done_of(seen, "a").stop_reason == "cancelled"
    assert kv_slots(chain) == [0, 0]  # both streams: freed on every stage


def stream_of(seen: list, client: str) -> tuple[str, list[int]]:
    chunks = [e for c, e in seen if c == client and isinstance(e, GenerationChunk)]
    return "".join(e.text for e in chunks), [t for e in chunks for t in e.tokens]


def test_a_stop_string_ends_the_generation_and_is_never_sent(setup) -> None:
    _, chain, tokenizer = setup
    free = engine_for(setup)
    free.submit("a", GenerationRequest("free", "the sky is", 24, ignore_eos=True,
                                       chunk_interval_ms=0))
    full = done_of(drive(free, lambda s: not free.busy), "a").text
    assert len(full) > 12
    stop = full[5:9]  # whatever the model says there: a stop string inside some token
    engine = engine_for(setup)
    engine.submit("a", GenerationRequest("cut", "the sky is", 24, ignore_eos=True,
                                         stop=["zzzz-never", stop], chunk_interval_ms=0))
    seen = drive(engine, lambda s: not engine.busy)
    done = done_of(seen, "a")
    text, tokens = stream_of(seen, "a")
    assert done.stop_reason == "stop" and done.text == text == full[:full.index(stop)]
    assert tokens == done.tokens and len(tokens) < 24
    assert kv_slots(chain) == [0, 0]


@pytest.mark.parametrize(("payload", "within"), [("auto", 1e-4), ("fp32", 1e-4), ("fp16", 2e-2)])
def test_logprobs_are_the_models_log_softmax_at_each_token(setup, payload, within) -> None:
    _, chain, tokenizer = setup
    engine = engine_for(setup)
    engine.submit("a", GenerationRequest("lp", "one two three", 5, ignore_eos=True,
                                         logprobs=True, top_logprobs=3, chunk_interval_ms=0,
                                         logits_payload=payload))
    seen = drive(engine, lambda s: not engine.busy)
    chunks = [e for c, e in seen if isinstance(e, GenerationChunk)]
    tokens = [t for e in chunks for t in e.tokens]
    logprobs = [lp for e in chunks for lp in e.logprobs]
    assert [lp.token for lp in logprobs] == tokens and len(tokens) == 5
    ids = tokenizer.encode("one two three")
    chain.open(99)
    chain.reset(99)
    rows = [chain.step(99, np.array(ids), np.arange(len(ids)), want_logits=True).logits]
    for i, token in enumerate(tokens[:-1]):  # the engine's steps, one token each
        rows.append(chain.step(99, np.array([token]), np.array([len(ids) + i]),
                               want_logits=True).logits)
    chain.close_stream(99)
    want = log_softmax(np.concatenate([r.reshape(1, -1) for r in rows]))
    for lp, row in zip(logprobs, want, strict=True):
        assert lp.top_tokens[0] == lp.token  # greedy: the chosen token is the most likely
        assert abs(lp.logprob - row[lp.token]) < within
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True) and len(lp.top_tokens) == 3
        assert abs(lp.top_logprobs[1] - np.sort(row)[-2]) < within


def test_top_k_sampling_draws_the_same_tokens_from_a_top_k_reply_as_from_logits(setup) -> None:
    outputs = []
    for payload in ("auto", "fp32"):  # auto: the last stage sends the 8 best tokens only
        engine = engine_for(setup)
        engine.submit("a", GenerationRequest("s", "one two three", 12, ignore_eos=True,
                                             temperature=1.3, top_k=8, top_p=0.95, seed=11,
                                             logits_payload=payload, chunk_interval_ms=0))
        outputs.append(done_of(drive(engine, lambda s, e=engine: not e.busy), "a").tokens)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 12


def test_messages_go_through_the_chat_template(setup) -> None:
    _, chain, tokenizer = setup
    engine = engine_for(setup)
    turns = [ChatMessage("system", "be brief"), ChatMessage("user", "hi"),
             ChatMessage("assistant", "hello"), ChatMessage("user", "the sky is")]
    engine.submit("a", GenerationRequest("m", messages=turns, max_tokens=6, ignore_eos=True))
    done = done_of(drive(engine, lambda s: not engine.busy), "a")
    ids = tokenizer.encode_chat([(m.role, m.content) for m in turns])
    assert done.prompt_tokens == len(ids) and ids != tokenizer.encode("the sky is")
    assert done.tokens == list(generate_greedy(chain, ids, 6))


def test_a_failed_pipeline_is_reported_as_unavailable(setup) -> None:
    engine = engine_for(setup, health=lambda: "stage 1 is down", resume_timeout_s=0)
    engine.submit("a", GenerationRequest("x", "hi", 4))
    done = done_of(drive(engine, lambda s: not engine.busy), "a")
    assert done.stop_reason == "error" and done.error_kind == UNAVAILABLE


def test_a_chunk_carries_the_timing_figures_only_when_they_are_new_to_its_client(
        setup, monkeypatch) -> None:
    _, chain, _ = setup
    summaries = iter(range(1, 1000))
    monkeypatch.setattr(chain, "timing_summary",
                        lambda: {"stage0": {"compute": float(next(summaries))}})
    engine = engine_for(setup)
    for client in ("a", "b"):  # a chunk per token
        engine.submit(client, GenerationRequest(client, "the sky is", 12, ignore_eos=True,
                                                chunk_interval_ms=0))
    seen = drive(engine, lambda s: not engine.busy)
    for client in ("a", "b"):
        chunks = [e for c, e in seen if c == client and isinstance(e, GenerationChunk)]
        assert len(chunks) >= 6
        carried = [e.timing for e in chunks if e.timing]
        # each client gets the figures on its first chunk, then only when recomputed
        # (at most every TIMING_REFRESH_S): not one summary twice, none left out
        assert chunks[0].timing and len(carried) == len({str(t) for t in carried})
        assert len(carried) < len(chunks)
        assert done_of(seen, client).timing  # the end carries fresh figures
    monkeypatch.setattr("zctl.engine.core.TIMING_REFRESH_S", 0.0)  # recomputed every time
    engine.submit("c", GenerationRequest("c", "one two", 6, ignore_eos=True,
                                         chunk_interval_ms=0))
    seen = drive(engine, lambda s: not engine.busy)
    assert all(e.timing for c, e in seen if isinstance(e, GenerationChunk))


def test_stop_token_ids_end_a_generation_as_a_stop(setup) -> None:
    """vLLM's stop_token_ids: the first of them generated ends the stream with "stop",
    its text left out; with ignore_eos too."""
    _, chain, tokenizer = setup
    ids = tokenizer.encode("one two three", chat=False)
    greedy = list(generate_greedy(chain, ids, 12))
    stop = greedy[4]
    cut = greedy.index(stop)
    for ignore_eos in (False, True):
        engine = engine_for(setup)
        engine.submit("a", GenerationRequest("s", "one two three", 12, chat=False,
                                             ignore_eos=ignore_eos, stop_token_ids=[stop]))
        seen = drive(engine, lambda s, e=engine: not e.busy)
        done = next(e for _, e in seen if isinstance(e, GenerationDone))
        assert done.stop_reason == "stop" and done.tokens == greedy[:cut + 1]
        assert done.text == tokenizer.decode(greedy[:cut])
    assert GenerationRequest("s", "x", stop_token_ids=[-1]).problem() is not None
    assert GenerationRequest("s", "x", stop_token_ids=list(range(65))).problem() is not None


@pytest.mark.parametrize("fails", ["reset", "submit"])
def test_a_next_stage_taking_no_frames_holds_the_generation_until_it_does(
        setup, monkeypatch, fails) -> None:
    """A node gone before the cluster noticed: its stage takes no frame, at the request's
    admission (its stream's reset) or mid-generation (a step). The generation is held, not
    failed, and resumes by replay with the tokens it would have had."""
    import zctl.engine.core as core
    from zctl.engine.executor import PipelineUnreachable

    _, chain, tokenizer = setup
    monkeypatch.setattr(core, "HEALTH_CHECK_S", 0.0)
    down = {"left": 2, "calls": 0}
    real = getattr(chain, fails)
    first_failing = 1 if fails == "reset" else 4  # the 4th step: mid-generation

    def flaky(*args, **kwargs):
        down["calls"] += 1
        if down["left"] and down["calls"] >= first_failing:
            down["left"] -= 1
            raise PipelineUnreachable("stage 1 at tcp://x is not taking frames")
        return real(*args, **kwargs)

    monkeypatch.setattr(chain, fails, flaky)
    engine = engine_for(setup)
    engine.submit("a", GenerationRequest("x", "the sky is", 8, ignore_eos=True))
    seen = drive(engine, lambda s: not engine.busy)
    done = done_of(seen, "a")
    assert not done.error and done.stop_reason == "max_tokens" and down["left"] == 0
    assert done.tokens == list(generate_greedy(chain, tokenizer.encode("the sky is"), 8))
    notes = [e.note for c, e in seen if isinstance(e, GenerationChunk) and e.note]
    assert any("paused: stage 1 at tcp://x is not taking frames" in n for n in notes), notes


def test_the_engine_measures_aggregate_decode_tok_s_by_streams_decoding_together(setup) -> None:
    """Two streams decoding together count their tokens after the first at two streams; the
    tokens sum to what they decoded while both ran, and a new executor starts again."""
    engine = engine_for(setup)
    for client, prompt in {"a": "the sky is", "b": "one two three"}.items():
        engine.submit(client, GenerationRequest(client, prompt, 40, ignore_eos=True))
    drive(engine, lambda s: sum(isinstance(e, GenerationDone) for _, e in s) == 2)
    rates = {r.streams: r for r in engine.decode_rates.rates(min_seconds=0.0)}
    assert set(rates) <= {1, 2} and 2 in rates
    assert rates[2].seconds > 0 and rates[2].tokens > 0
    # every token after each prompt's first, counted once, whether one or two decoded
    assert sum(r.tokens for r in rates.values()) == 2 * 39
    engine.decode_rates.reset()
    assert engine.decode_rates.rates(min_seconds=0.0) == []
