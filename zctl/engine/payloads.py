"""What of the logits a step's reply carries (pure): the smallest payload that answers a
session exactly, merged over a row group's sessions, and the reply rows it makes.

A greedy session without logprobs needs only each position's best token (a top-1 reply:
8 bytes a position). Sampling and logprobs need more. Full float32 logits answer every
request exactly but cost 4 bytes per vocabulary entry a position (196 KB for a 49k
vocabulary), which a slow link or a relay feels on every step. Two smaller payloads:

- **top-k**: the k most likely tokens with their log-probabilities (the last stage takes
  the log-sum-exp over the whole vocabulary). It answers exactly a greedy session's
  logprobs (up to k alternatives) and sampling with ``top_k`` <= k: the tokens outside
  the top k can never be drawn there, and top-p is applied after top-k. The reply's rows
  are log-probabilities on those k tokens and -inf elsewhere (``StepReply.logprob_rows``).
- **fp16**: the full logits as float16: half the bytes, logprobs within about 2e-2 for
  logits up to 32, and a greedy near-tie closer than float16's resolution may break the
  other way.

A request's ``logits_payload`` policy picks: ``auto`` (top-1, else top-k where it is
exact, else float32 logits), ``fp16`` (float16 wherever logits are needed) or ``fp32``
(float32 wherever logits are needed: the baseline).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from zctl.engine.requests import PAYLOAD_POLICIES

TOP_MAX = 64  # the most tokens a top-k reply carries; a session wanting more gets logits


@dataclass(frozen=True)
class LogitsPayload:
    """A reply's logits: the ``top`` > 0 most likely tokens' log-probabilities, or else the
    full logits (as float16 when ``fp16``)."""

    top: int = 0
    fp16: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.top <= TOP_MAX:
            raise ValueError(f"a top-k payload carries 1..{TOP_MAX} tokens, got {self.top}")
        if self.top and self.fp16:
            raise ValueError("a top-k payload has no float16 form")


FULL_FP32 = LogitsPayload()
FULL_FP16 = LogitsPayload(fp16=True)

# What a step asks of its reply: False, the best token only; True, full float32 logits; or
# a LogitsPayload.
Want = bool | LogitsPayload


def as_payload(want: Want) -> LogitsPayload | None:
    """The LogitsPayload a step's ``want_logits`` asks for (None: the best token only)."""
    if isinstance(want, LogitsPayload):
        return want
    return FULL_FP32 if want else None


def payload_for(policy: str, *, sampling_top_k: int | None, top_logprobs: int | None) -> Want:
    """What a session's steps ask for. ``sampling_top_k``: None for greedy decoding, else the
    sampler's top-k (0: none); ``top_logprobs``: None without logprobs, else the
    alternatives asked per token."""
    if policy not in PAYLOAD_POLICIES:
        raise ValueError(f"logits_payload must be one of {', '.join(PAYLOAD_POLICIES)}, "
                         f"got {policy!r}")
    if sampling_top_k is None and top_logprobs is None:
        return False
    if policy == "fp32":
        return True
    if policy == "fp16":
        return FULL_FP16
    if sampling_top_k == 0:  # unbounded sampling needs every token's logit
        return True
    top = max(sampling_top_k or 1, top_logprobs or 1)
    return LogitsPayload(top=top) if top <= TOP_MAX else True


def merge_wants(wants: Iterable[Want]) -> Want:
    """One payload answering every row of a row group exactly as its own would: top-k
    rows share the largest k; float16 rows share float16; any other mix gets float32."""
    asked = [p for p in (as_payload(w) for w in wants) if p is not None]
    if not asked:
        return False
    if all(p.top for p in asked):
        return LogitsPayload(top=max(p.top for p in asked))
    if all(p.fp16 for p in asked):
        return FULL_FP16
    return True


def top_logprobs(rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` most likely tokens of each row of logits [..., V] and their
    log-probabilities (float32), best first (ties: the lower id first, as argmax):
    ``(tokens [P, k] int64, logprobs [P, k])``."""
    rows = np.asarray(rows, dtype=np.float32).reshape(-1, np.shape(rows)[-1])
    top = rows.max(axis=-1, keepdims=True)
    lse = top + np.log(np.exp(rows - top).sum(axis=-1, keepdims=True, dtype=np.float64))
    if k == 1:
        ids = rows.argmax(axis=-1)[:, None]
    else:
        part = np.sort(np.argpartition(rows, -k, axis=-1)[:, -k:], axis=-1)
        order = np.argsort(-np.take_along_axis(rows, part, axis=-1), axis=-1, kind="stable")
        ids = np.take_along_axis(part, order, axis=-1)
    values = np.take_along_axis(rows, ids, axis=-1) - lse
    return ids.astype(np.int64), values.astype(np.float32)


def logprob_rows(tokens: np.ndarray, logprobs: np.ndarray, vocab: int) -> np.ndarray:
    """Dense rows [P, vocab] of top-k records: their log-probabilities, -inf elsewhere."""
    tokens = np.asarray(tokens).reshape(-1, np.shape(tokens)[-1])
    rows = np.full((tokens.shape[0], vocab), -np.inf, dtype=np.float32)
    np.put_along_axis(rows, tokens.astype(np.int64), np.asarray(logprobs).reshape(tokens.shape),
                      axis=-1)
    return rows


FP16_MAX = float(np.finfo(np.float16).max)


def as_float16(rows: np.ndarray) -> np.ndarray:
    """Logits as a float16 reply carries them: rounded, and held within float16's range
    (saturated, not turned into infinities)."""
    return np.clip(rows, -FP16_MAX, FP16_MAX).astype(np.float16)


def reply_rows(rows: np.ndarray, payload: LogitsPayload) -> np.ndarray:
    """The logits rows [P, V] a reply of ``payload`` makes of the stages' logits ``rows``,
    as a pipeline's last stage and its coordinator together make them (a local executor
    answers exactly as a cluster would)."""
    if payload.top:
        return logprob_rows(*top_logprobs(rows, payload.top), rows.shape[-1])
    if payload.fp16:
        return as_float16(rows).astype(np.float32)
    return np.array(rows, dtype=np.float32)
