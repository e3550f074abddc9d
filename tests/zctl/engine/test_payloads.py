"""zctl.engine.payloads: the reply a session asks for is the smallest that answers it exactly,
a row group's rows share one that answers each, and a top-k or float16 reply reads as
full logits would where the payload promises it."""

from __future__ import annotations

import numpy as np
import pytest

from zctl.engine.executor import reply_from_logits
from zctl.engine.payloads import (
    FULL_FP16,
    TOP_MAX,
    LogitsPayload,
    as_payload,
    logprob_rows,
    merge_wants,
    payload_for,
    reply_rows,
    top_logprobs,
)
from zctl.engine.sampling import SamplingParams, draw, log_softmax, target_probs, token_logprobs


def test_a_session_asks_for_the_smallest_exact_payload():
    assert payload_for("auto", sampling_top_k=None, top_logprobs=None) is False
    assert payload_for("fp32", sampling_top_k=None, top_logprobs=None) is False  # top-1 only
    assert payload_for("auto", sampling_top_k=None, top_logprobs=0) == LogitsPayload(top=1)
    assert payload_for("auto", sampling_top_k=None, top_logprobs=5) == LogitsPayload(top=5)
    assert payload_for("auto", sampling_top_k=40, top_logprobs=3) == LogitsPayload(top=40)
    assert payload_for("auto", sampling_top_k=3, top_logprobs=8) == LogitsPayload(top=8)
    assert payload_for("auto", sampling_top_k=0, top_logprobs=None) is True  # unbounded
    assert payload_for("auto", sampling_top_k=TOP_MAX + 1, top_logprobs=None) is True
    assert payload_for("fp16", sampling_top_k=40, top_logprobs=None) == FULL_FP16
    assert payload_for("fp32", sampling_top_k=40, top_logprobs=2) is True
    with pytest.raises(ValueError, match="logits_payload must be one of auto, fp16, fp32"):
        payload_for("fp8", sampling_top_k=None, top_logprobs=1)
    with pytest.raises(ValueError, match="1..64"):
        LogitsPayload(top=TOP_MAX + 1)
    with pytest.raises(ValueError, match="no float16 form"):
        LogitsPayload(top=2, fp16=True)


def test_a_row_group_shares_a_payload_that_answers_every_row():
    top3, top9 = LogitsPayload(top=3), LogitsPayload(top=9)
    assert merge_wants([False, False]) is False
    assert merge_wants([False, top3, top9]) == top9
    assert merge_wants([FULL_FP16, False, FULL_FP16]) == FULL_FP16
    assert merge_wants([top3, FULL_FP16]) is True  # float16 is not exact for the top-k row
    assert merge_wants([True, top3]) is True and merge_wants([FULL_FP16, True]) is True
    assert as_payload(True) == LogitsPayload() and as_payload(False) is None


def test_top_k_log_probabilities_are_the_full_softmax_s():
    rng = np.random.default_rng(3)
    rows = (rng.standard_normal((4, 500)) * 4).astype(np.float32)
    tokens, logprobs = top_logprobs(rows, 7)
    full = log_softmax(rows)
    assert np.array_equal(tokens, np.argsort(-rows, axis=-1, kind="stable")[:, :7])
    assert np.allclose(logprobs, np.take_along_axis(full, tokens, axis=-1), atol=1e-5)
    dense = logprob_rows(tokens, logprobs, 500)
    assert dense.shape == (4, 500) and np.isneginf(dense).sum() == 4 * (500 - 7)
    assert np.array_equal(dense.argmax(axis=-1), rows.argmax(axis=-1))


def test_top_k_rows_sample_and_read_logprobs_as_full_logits_do():
    rng = np.random.default_rng(4)
    rows = (rng.standard_normal((6, 300)) * 3).astype(np.float32)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
    sparse = reply_from_logits(rows, LogitsPayload(top=20))
    full = reply_from_logits(rows, True)
    assert sparse.logprob_rows and not full.logprob_rows
    assert np.array_equal(sparse.tokens, full.tokens)
    assert np.allclose(target_probs(sparse.logits, params), target_probs(full.logits, params),
                       atol=1e-6)
    draws = [[draw(target_probs(r.logits, params)[i], np.random.default_rng(i))
              for i in range(6)] for r in (sparse, full)]
    assert draws[0] == draws[1]
    tokens = [int(t) for t in rows.argmax(axis=-1)]
    got = token_logprobs(sparse.logits, tokens, 5, normalised=True)
    want = token_logprobs(full.logits, tokens, 5)
    for a, b in zip(got, want, strict=True):
        assert a.token == b.token and a.top_tokens == b.top_tokens
        assert np.allclose([a.logprob, *a.top_logprobs], [b.logprob, *b.top_logprobs], atol=1e-5)
    # read as logits, the rows would renormalise over the top 20: the flag is what keeps them
    wrong = token_logprobs(sparse.logits, tokens, 0)
    assert not np.allclose([w.logprob for w in wrong], [b.logprob for b in want], atol=1e-3)


def test_float16_rows_are_the_logits_rounded_and_saturated():
    rows = np.array([[0.1, 2.5, -70000.0, 1e-8]], dtype=np.float32)
    shaped = reply_rows(rows, FULL_FP16)
    assert shaped.dtype == np.float32
    assert shaped.tolist()[0] == [float(np.float16(0.1)), 2.5, -65504.0, float(np.float16(1e-8))]
    assert reply_from_logits(rows, FULL_FP16).tokens.tolist() == [1]
    assert reply_from_logits(rows).logits is None
