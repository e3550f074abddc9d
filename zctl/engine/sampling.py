"""Sampling, and lossless speculative sampling (rejection sampling), as small pure functions.

``SamplingParams`` turn a row of target logits into the distribution a token is drawn
from (temperature, then top-k and top-p truncation). ``adjust_logits`` first applies
OpenAI's presence and frequency penalties (over the tokens generated so far) and a
logit bias. With temperature 0 decoding is greedy (over the adjusted logits) and
speculation checks drafts by equality (``accept_prefix``). With temperature
> 0 ``speculative_sample`` checks drafts by rejection sampling (Leviathan et al. 2023,
Chen et al. 2023): draft ``d_i`` proposed with probability ``q_i(d_i)`` is accepted with
probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection a token is drawn from
the residual ``max(p_i - q_i, 0)`` (renormalised), and after K acceptances the bonus
token is drawn from ``p_K``. Every emitted token is then distributed exactly as if it
had been sampled from the target alone. Our drafters propose deterministically (prompt
lookup, a greedy draft model), so ``q_i`` is one-hot: accept ``d_i`` with probability
``p_i(d_i)``, else draw from ``p_i`` with ``d_i`` removed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from zctl.engine.requests import MAX_LOGIT_BIAS, MAX_PENALTY, MAX_REPETITION_PENALTY, TokenLogprob


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k 0, top_p 1.0 and min_p 0 = no truncation (min_p keeps
    the tokens at least that fraction as likely as the most likely one, after top-k and
    top-p, as llama.cpp and vLLM do); seed for repeatability.

    ``presence_penalty`` is taken off the logit of every token generated so far, and
    ``frequency_penalty`` once for each time it was (OpenAI's and vLLM's meaning: the
    prompt's tokens are not counted); ``repetition_penalty`` divides the logit of every
    token of the prompt or the output so far when it is positive and multiplies it when
    it is negative (Hugging Face's, vLLM's and llama.cpp's ``repeat_penalty``: 1 is none);
    ``logit_bias`` holds (token id, bias) pairs added to those tokens' logits. They apply
    under greedy decoding too."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(f"{name} must be in -{MAX_PENALTY:g}..{MAX_PENALTY:g}, "
                                 f"got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], "
                             f"got {self.repetition_penalty}")
        for token, bias in self.logit_bias:
            if token < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias maps token ids >= 0 to -{MAX_LOGIT_BIAS:g}.."
                                 f"{MAX_LOGIT_BIAS:g}, got {token}: {bias}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Penalties or a bias change the logits, so even greedy decoding reads them."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0)

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)


def adjust_logits(logits: np.ndarray, params: SamplingParams, generated: Sequence[int],
                  drafts: Sequence[int] = (), prompt: Sequence[int] = ()) -> np.ndarray:
    """The rows of ``logits`` [K+1, V] (float64) with ``params``' penalties and bias.

    Row 0 follows the ``prompt`` and the ``generated`` tokens; row i > 0 follows them and
    ``drafts[:i]`` (a speculative step's row i is read only once the drafts before it are
    accepted)."""
    rows = np.array(logits, dtype=np.float64).reshape(-1, np.shape(logits)[-1])
    if params.repetition_penalty != 1.0:
        repeat_penalise(rows, params.repetition_penalty,
                        np.concatenate([np.asarray(prompt, dtype=np.int64),
                                        np.asarray(generated, dtype=np.int64)]), drafts)
    if params.logit_bias:
        ids = np.array([t for t, _ in params.logit_bias], dtype=np.int64)
        if ids.max() >= rows.shape[1]:
            raise ValueError(f"logit_bias names token {int(ids.max())}, beyond the "
                             f"vocabulary of {rows.shape[1]}")
        rows[:, ids] += np.array([b for _, b in params.logit_bias])
    presence, frequency = params.presence_penalty, params.frequency_penalty
    if not (presence or frequency):
        return rows
    ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
    rows[:, ids] -= frequency * counts + presence
    seen = set(ids.tolist())
    for i, token in enumerate(int(t) for t in drafts[:rows.shape[0] - 1]):
        rows[i + 1:, token] -= frequency + (0.0 if token in seen else presence)
        seen.add(token)
    return rows


def repeat_penalise(rows: np.ndarray, penalty: float, seen: np.ndarray,
                    drafts: Sequence[int]) -> None:
    """Penalise in place, in every row, the tokens ``seen`` (each once, however often it
    came), and in row i > 0 also ``drafts[:i]``: a positive logit divided by ``penalty``, a
    negative one multiplied by it."""
    def penalise(view: np.ndarray) -> np.ndarray:
        return np.where(view > 0, view / penalty, view * penalty)

    ids = np.unique(seen)
    ids = ids[(ids >= 0) & (ids < rows.shape[1])]
    rows[:, ids] = penalise(rows[:, ids])
    done = set(ids.tolist())
    for i, token in enumerate(int(t) for t in drafts[:rows.shape[0] - 1]):
        if token not in done and 0 <= token < rows.shape[1]:
            rows[i + 1:, token] = penalise(rows[i + 1:, token])
            done.add(token)


def target_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The sampling distribution of each row of ``logits`` [..., V] (float64, rows sum to 1).

    Only a row's candidates (``candidates``: its top-k, its finite logits) are worked on:
    with top-k 40 (llama-server's default) over a 49k vocabulary, top-p's sort then takes
    40 values instead of 49k, a few ms less for every token."""
    if params.greedy:
        raise ValueError("greedy decoding has no sampling distribution")
    z = np.asarray(logits, dtype=np.float64) / params.temperature
    rows = z.reshape(-1, z.shape[-1])
    probs = np.zeros_like(rows)
    for row, out in zip(rows, probs, strict=True):
        kept = candidates(row, params.top_k)
        out[kept] = truncated_softmax(row[kept], params.top_p, params.min_p)
    return probs.reshape(z.shape)


def candidates(z: np.ndarray, top_k: int) -> np.ndarray | slice:
    """The token ids a row of scaled logits ``z`` [V] may draw from: the ``top_k`` best (all
    that tie with the k-th; 0: every one), leaving out those at -inf (a top-k reply's rest);
    ``slice(None)``: every token."""
    finite = z > -np.inf
    count = int(np.count_nonzero(finite))
    sparse = 0 < count < z.size
    ids = np.flatnonzero(finite) if sparse else None
    if 0 < top_k < count:
        values = z[ids] if ids is not None else z
        kth = np.partition(values, values.size - top_k)[values.size - top_k]
        best = np.flatnonzero(values >= kth)
        return ids[best] if ids is not None else best
    return ids if ids is not None else slice(None)


def truncated_softmax(z: np.ndarray, top_p: float, min_p: float) -> np.ndarray:
    """The softmax of the candidates' scaled logits ``z``, cut to the smallest most likely
    set reaching ``top_p`` and then to those at least ``min_p`` times as likely as the
    best, renormalised."""
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p)
        sorted_p = p[order]
        before = np.cumsum(sorted_p) - sorted_p  # mass of the tokens ranked above
        keep = np.zeros(p.size, dtype=bool)
        keep[order] = before < top_p  # the smallest prefix reaching top_p
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    if min_p > 0.0:
        p = np.where(p >= min_p * p.max(), p, 0.0)
        p /= p.sum()
    return p


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from a distribution (inverse CDF: robust to rounding in the sum); over the
    tokens of nonzero probability alone when there are few (the same token, without a sum
    over the vocabulary)."""
    flat = np.ravel(probs)
    count = int(np.count_nonzero(flat))
    ids = np.flatnonzero(flat) if 0 < count < flat.size else None
    cdf = np.cumsum(flat if ids is None else flat[ids])
    i = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), cdf.size - 1)
    return i if ids is None else int(ids[i])


def speculative_sample(draft: Sequence[int], probs: np.ndarray, rng: np.random.Generator,
                       draft_probs: np.ndarray | None = None) -> tuple[int, int]:
    """Rejection-sample K drafts against the target distributions ``probs`` [K+1, V].

    ``draft_probs`` [K, V] are the drafter's distributions (None: deterministic drafts,
    one-hot). Returns ``(n, token)``: the first n drafts are accepted and ``token`` comes
    next (the residual draw at the first rejection, or the bonus draw after all K).
    """
    k = len(draft)
    if probs.shape[0] < k + 1:
        raise ValueError(f"{k} drafts need {k + 1} target distributions, got {probs.shape[0]}")
    for i, token in enumerate(int(t) for t in draft):
        p = probs[i]
        q_token = 1.0 if draft_probs is None else float(draft_probs[i, token])
        if q_token > 0.0 and rng.random() * q_token < p[token]:
            continue
        if draft_probs is None:
            residual = p.copy()
            residual[token] = 0.0
        else:
            residual = np.maximum(p - draft_probs[i], 0.0)
        if residual.sum() <= 0.0:  # p is (numerically) one-hot on the draft: accept it
            continue
        return i, draw(residual, rng)
    return k, draw(probs[k], rng)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-probabilities of ``logits`` [..., V] (float64)."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def token_logprobs(logits: np.ndarray, tokens: Sequence[int], top: int = 0, *,
                   normalised: bool = False) -> list[TokenLogprob]:
    """Each token's log-probability under the model's raw distribution at its row of
    ``logits`` [len(tokens), V], and the ``top`` most likely tokens there (best first).
    ``normalised``: the rows hold log-probabilities already (a top-k reply's, -inf off
    its tokens), which a softmax over the row would wrongly renormalise."""
    rows = np.asarray(logits).reshape(-1, np.asarray(logits).shape[-1])
    if rows.shape[0] < len(tokens):
        raise ValueError(f"{len(tokens)} tokens need {len(tokens)} rows of logits, got {rows.shape[0]}")
    out = []
    for row, token in zip(rows, tokens, strict=False):
        lp = np.asarray(row, dtype=np.float64) if normalised else log_softmax(row)
        best: list[int] = []
        if top > 0:
            best = np.argpartition(-lp, min(top, lp.size - 1))[:top].tolist()
            best.sort(key=lambda t: (-lp[t], t))
        out.append(TokenLogprob(int(token), float(lp[token]), [int(t) for t in best],
                                [float(lp[t]) for t in best]))
    return out
