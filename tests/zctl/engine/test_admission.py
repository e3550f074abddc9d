"""zctl.engine.admission: a request's token budget against the context and the KV budget, and
the session it becomes (plain, speculative, pipelined, held to a grammar), refusals with
their reasons."""

from __future__ import annotations

import pytest

from zctl.engine.admission import AUTO_K_MAX, SessionLimits, new_session, new_tokens_allowed
from zctl.engine.constraints import TokenConstraint
from zctl.engine.pipelined import PipelinedSession
from zctl.engine.requests import GenerationRequest, RequestRefused

LIMITS = SessionLimits(max_context=100, kv_budget_tokens=80, vocab_size=50, stop_ids=[2])


def test_the_token_budget() -> None:
    assert new_tokens_allowed(30, 20, LIMITS) == 20
    assert new_tokens_allowed(30, 0, SessionLimits(100, None, 50, [2])) == 70  # the rest
    for prompt, wanted, why in ((30, 0, "KV memory budget"), (90, 20, "exceed the model's "
                                "context of 100"), (100, 0, "leave no room"),
                                (60, 30, "need more KV")):
        with pytest.raises(RequestRefused, match=why):
            new_tokens_allowed(prompt, wanted, LIMITS)
    with pytest.raises(RequestRefused, match="max_tokens must be given"):
        new_tokens_allowed(5, 0, SessionLimits(None, None, 50, [2]))


def test_the_session_a_request_becomes() -> None:
    ids = [1, 5, 7]
    plain = new_session(0, GenerationRequest("r", "hi", 8), ids, LIMITS)
    assert type(plain).__name__ == "DecodeSession" and plain.k == 0
    assert plain.stops == frozenset({2}) and plain.max_new_tokens == 8
    assert new_session(0, GenerationRequest("r", "hi", 8, ignore_eos=True), ids,
                       LIMITS).stops == frozenset()
    lookup = new_session(0, GenerationRequest("r", "hi", 8, speculative="lookup"), ids, LIMITS)
    assert lookup.k == AUTO_K_MAX and lookup.auto_k
    assert isinstance(new_session(0, GenerationRequest("r", "hi", 8, speculative="pipelined"),
                                  ids, LIMITS), PipelinedSession)
    held = TokenConstraint(None, 50)
    grammar = new_session(0, GenerationRequest("r", "hi", 8, speculative="lookup", k=4,
                                               grammar_kind="regex", grammar="a+"),
                          ids, LIMITS, held)
    assert grammar.constraint is held and grammar.k == 4  # drafts, checked by the grammar
    piped = new_session(0, GenerationRequest("r", "hi", 8, speculative="pipelined",
                                             grammar_kind="regex", grammar="a+"),
                        ids, LIMITS, held)
    assert type(piped).__name__ == "DecodeSession" and piped.constraint is held  # not piped
    with pytest.raises(RequestRefused, match="no draft models"):
        new_session(0, GenerationRequest("r", "hi", 8, speculative="draft:/x"), ids, LIMITS)
    with pytest.raises(RequestRefused, match="beyond the model's vocabulary of 50"):
        new_session(0, GenerationRequest("r", "hi", 8, logit_bias={"50": 1.0}), ids, LIMITS)
