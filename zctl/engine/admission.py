"""How a request becomes a session (pure): its token budget against the model's context
and the KV a stage may hold, its sampling (the model's defaults for what it leaves out:
zctl.engine.sampling_defaults), and how it decodes (plainly, speculating, or
held to a grammar).

``GenerationEngine`` (zctl.engine.core) tokenizes the prompt and takes the request's
compiled grammar; ``new_session`` does the rest, raising ``RequestRefused`` with the
reason for a request that cannot run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from zctl.engine.constraints import TokenConstraint
from zctl.engine.drafting import Drafter, LookupDrafter
from zctl.engine.kv_cost import EVERY_TOKEN, KvCost
from zctl.engine.pipelined import PipelinedSession
from zctl.engine.requests import MAX_DRAFT_TOKENS, GenerationRequest, RequestRefused, Sampling
from zctl.engine.sampling import SamplingParams
from zctl.engine.sampling_defaults import LLAMA_SERVER_SAMPLING, request_sampling
from zctl.engine.sessions import DecodeSession

AUTO_K_MAX = MAX_DRAFT_TOKENS // 2
# a scored prompt's step answers every position with float32 logits: its chunks hold
# about this many bytes of them (170 positions of a 49k vocabulary, 65 of a 128k one)
SCORING_STEP_BYTES = 32 << 20
DrafterLoader = Callable[[str, int], Drafter]  # (draft model path, stream id) -> drafter


@dataclass(frozen=True)
class SessionLimits:
    """What every request must fit: the model's context (None: no limit), the KV tokens a
    stage may hold for one stream (None: no limit), the logits' vocabulary, and the
    tokens that end a generation."""

    max_context: int | None
    kv_budget_tokens: int | None
    vocab_size: int
    stop_ids: Sequence[int]
    kv_cost: KvCost = EVERY_TOKEN  # what a stream's tokens cost against the budget


def new_tokens_allowed(prompt_tokens: int, max_tokens: int, limits: SessionLimits) -> int:
    """The new tokens a request may generate: its ``max_tokens``, or with 0 the rest of the
    context; RequestRefused when the prompt plus them do not fit."""
    context = limits.max_context
    limit = max_tokens or (context or 0) - prompt_tokens
    if max_tokens == 0 and limit <= 0:
        raise RequestRefused(f"the prompt's {prompt_tokens} tokens leave no room in the model's "
                             f"context of {context} tokens"
                             if context else "max_tokens must be given (> 0)")
    if context is not None and prompt_tokens + limit > context:
        raise RequestRefused(f"the prompt's {prompt_tokens} tokens plus max_tokens {limit} "
                             f"exceed the model's context of {context} tokens")
    budget = limits.kv_budget_tokens
    if budget is not None and limits.kv_cost.tokens(prompt_tokens + limit) > budget:
        raise RequestRefused(
            f"the prompt's {prompt_tokens} tokens plus max_tokens {limit} need more KV than "
            f"a stage may hold for one stream ({budget} tokens: its KV memory budget)")
    return limit


def scoring_chunk(vocab_size: int) -> int:
    """A scored prompt's (``prompt_logprobs``) prefill chunk: the positions whose float32
    logits fill about SCORING_STEP_BYTES, at least 16."""
    return max(16, SCORING_STEP_BYTES // (4 * max(1, vocab_size)))


def new_session(stream_id: int, req: GenerationRequest, ids: Sequence[int],
                limits: SessionLimits, constraint: TokenConstraint | None = None,
                load_drafter: DrafterLoader | None = None,
                defaults: Sampling = LLAMA_SERVER_SAMPLING) -> DecodeSession:
    """The session for ``req`` (its prompt tokenized as ``ids``, its grammar compiled as
    ``constraint``), sampling as it asks, with the model's ``defaults`` for the sampling
    fields it leaves out."""
    req = replace(req, max_tokens=new_tokens_allowed(len(ids), req.max_tokens, limits))
    stops = [*(() if req.ignore_eos else limits.stop_ids), *req.stop_token_ids]
    biases = req.biases()
    if biases and biases[-1][0] >= limits.vocab_size:
        raise RequestRefused(f"logit_bias names token {biases[-1][0]}, beyond the "
                             f"model's vocabulary of {limits.vocab_size}")
    used = request_sampling(req, defaults)
    sampling = SamplingParams(used.temperature, used.top_k, used.top_p, req.seed,
                              req.presence_penalty, req.frequency_penalty, biases,
                              used.repetition_penalty, used.min_p)
    top = req.top_logprobs if req.logprobs else None
    reads: dict = dict(sampling=sampling, top_logprobs=top, logits_payload=req.logits_payload)
    if req.prompt_logprobs:
        reads.update(prompt_logprobs=True, prefill_chunk=scoring_chunk(limits.vocab_size))
    if constraint is not None:  # held to a grammar: drafts checked by it, not pipelined
        reads["constraint"] = constraint
    plain = constraint is not None or req.prompt_logprobs  # ... and so is a prompt scored
    if not req.speculative or (plain and req.speculative == "pipelined"):
        return DecodeSession(stream_id, ids, req.max_tokens, stops, **reads)
    if req.speculative == "pipelined":
        return PipelinedSession(stream_id, ids, req.max_tokens, stops, width=req.k or None,
                                **reads)
    if req.speculative == "lookup":
        drafter: Drafter = LookupDrafter()
    elif load_drafter is None:
        raise RequestRefused("this service has no draft models: use speculative='lookup'")
    else:
        drafter = load_drafter(req.speculative.removeprefix("draft:"), stream_id)
    return DecodeSession(stream_id, ids, req.max_tokens, stops, drafter=drafter,
                         k=req.k or AUTO_K_MAX, auto_k=req.k == 0, **reads)
