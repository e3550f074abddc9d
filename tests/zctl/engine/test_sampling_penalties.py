"""Presence, frequency and repetition penalties and the logit bias
(zctl.engine.sampling.adjust_logits):
the pure function against a naive reference, then sessions that apply them under greedy
decoding, speculation, pipelined speculation and sampling, and requests that ask for
them wrongly."""

from __future__ import annotations

import numpy as np
import pytest

from tests.zctl.engine.test_pipelined import PROMPT as TEXT_PROMPT
from tests.zctl.engine.test_pipelined import OverlappingModel
from tests.zctl.engine.test_sampling import TableModel
from zctl.engine.drafting import LookupDrafter
from zctl.engine.payloads import LogitsPayload
from zctl.engine.pipelined import PipelinedSession
from zctl.engine.requests import GenerationRequest
from zctl.engine.sampling import SamplingParams, adjust_logits
from zctl.engine.scheduler import run_session
from zctl.engine.sessions import DecodeSession


def naive_adjusted(row: np.ndarray, params: SamplingParams, history: list[int],
                   prompt: list[int] = ()) -> np.ndarray:
    out = np.array(row, dtype=np.float64)
    for token in set(prompt) | set(history):  # Hugging Face's rule, each token once
        r = params.repetition_penalty
        out[token] = out[token] / r if out[token] > 0 else out[token] * r
    for token, bias in params.logit_bias:
        out[token] += bias
    for token in set(history):
        out[token] -= params.frequency_penalty * history.count(token) + params.presence_penalty
    return out


def test_adjust_logits_counts_the_generated_tokens_and_each_rows_drafts() -> None:
    rng = np.random.default_rng(0)
    for trial in range(200):
        vocab, k = 6, int(rng.integers(0, 5))  # small: drafts repeat generated tokens
        params = SamplingParams(presence_penalty=float(rng.uniform(-2, 2)),
                                frequency_penalty=float(rng.uniform(-2, 2)),
                                logit_bias=((int(rng.integers(vocab)), 5.0),) if trial % 2 else (),
                                repetition_penalty=float(rng.uniform(0.5, 2)) if trial % 3 else 1.0)
        logits = rng.normal(size=(k + 1, vocab))
        generated = rng.integers(0, vocab, size=int(rng.integers(0, 9))).tolist()
        drafts = rng.integers(0, vocab, size=k).tolist()
        prompt = rng.integers(0, vocab, size=int(rng.integers(1, 4))).tolist()
        got = adjust_logits(logits, params, generated, drafts, prompt)
        for i in range(k + 1):
            want = naive_adjusted(logits[i], params, generated + drafts[:i], prompt)
            np.testing.assert_allclose(got[i], want, err_msg=f"trial {trial}, row {i}")
    assert np.array_equal(adjust_logits(logits, SamplingParams(), [1, 2]), logits)


def test_bad_penalties_and_biases_are_refused() -> None:
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-3.0),
                dict(repetition_penalty=0.0), dict(repetition_penalty=2.01),
                dict(logit_bias=((3, 101.0),)), dict(logit_bias=((-1, 1.0),))):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="beyond the vocabulary"):
        adjust_logits(np.zeros((1, 4)), SamplingParams(logit_bias=((4, 1.0),)), [])
    ok = GenerationRequest("r", "hi", logit_bias={"7": -100, "12": 3.5}, frequency_penalty=1)
    assert ok.problem() is None and ok.biases() == ((7, -100.0), (12, 3.5))
    assert GenerationRequest("r", "hi", logit_bias={"7": 1, "07": 2}).biases() == ((7, 2.0),)
    for bad_request in (GenerationRequest("r", "hi", presence_penalty=-2.01),
                        GenerationRequest("r", "hi", logit_bias={"x7": 1.0}),
                        GenerationRequest("r", "hi", logit_bias={"-7": 1.0}),
                        GenerationRequest("r", "hi", logit_bias={"7": 100.5}),
                        GenerationRequest("r", "hi", repetition_penalty=0.0)):
        assert bad_request.problem() is not None


def table_reference(model: TableModel, prompt: list[int], n: int,
                    params: SamplingParams) -> list[int]:
    """Greedy over adjusted logits, one token at a time (the table's row for the token after
    ``t`` at position ``p`` is ``table[t, p]``)."""
    out: list[int] = []
    last, position = prompt[-1], len(prompt) - 1
    for _ in range(n):
        last = int(naive_adjusted(model.table[last, position], params, out, prompt).argmax())
        out.append(last)
        position += 1
    return out


@pytest.mark.parametrize(("k", "params"), [
    (k, params) for k in (0, 3) for params in (
        SamplingParams(frequency_penalty=0.8, presence_penalty=0.3),
        SamplingParams(repetition_penalty=1.3))])
def test_greedy_decoding_follows_the_penalised_logits(k: int, params: SamplingParams) -> None:
    model = TableModel()
    prompt = [1, 2, 1, 2, 1, 2, 1]  # repetitive: lookup drafts
    want = table_reference(model, prompt, 30, params)
    assert want != table_reference(model, prompt, 30, SamplingParams())  # penalties bite
    session = DecodeSession(0, prompt, 30, k=k, drafter=LookupDrafter(), sampling=params)
    assert session.wants_logits is True  # a penalty may lift any token: every logit
    assert list(run_session(model, session)) == want
    if k:
        assert session.spec.proposed > 0  # drafts were checked against penalised rows


def test_a_logit_bias_steers_greedy_and_sampled_tokens() -> None:
    model = TableModel()
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature, seed=1, logit_bias=((3, 100.0),))
        assert list(run_session(model, DecodeSession(0, [1, 2], 12, sampling=params))) == [3] * 12
    banned = SamplingParams(1.0, seed=2, logit_bias=((0, -100.0), (1, -100.0)))
    drawn = list(run_session(model, DecodeSession(0, [1, 2], 40, sampling=banned)))
    assert set(drawn) <= {2, 3} and len(set(drawn)) == 2


def test_sampling_with_a_top_k_still_reads_every_logit_under_penalties() -> None:
    plain = DecodeSession(0, [1, 2], 4, sampling=SamplingParams(1.0, top_k=2))
    assert plain.wants_logits == LogitsPayload(top=2)
    penalised = DecodeSession(0, [1, 2], 4, sampling=SamplingParams(1.0, top_k=2,
                                                                     presence_penalty=1.0))
    assert penalised.wants_logits is True


def test_pipelined_speculation_applies_the_penalties_as_plain_decoding_does() -> None:
    params = SamplingParams(frequency_penalty=0.5)
    plain = list(run_session(OverlappingModel(), DecodeSession(0, TEXT_PROMPT, 60,
                                                               sampling=params)))
    unpenalised = list(run_session(OverlappingModel(), DecodeSession(0, TEXT_PROMPT, 60)))
    assert plain != unpenalised
    model = OverlappingModel()
    got = list(run_session(model, PipelinedSession(0, TEXT_PROMPT, 60, depth=3,
                                                   sampling=params)))
    assert got == plain
    assert model.most_in_flight == 3 and model.cancels  # it ran ahead, and guessed wrong too
    # the last stage may not check a guess against its own best token: that is not the
    # penalised one
    assert set(model.guessed) == {None}
    assert model.kv == {} and model.in_flight == 0
