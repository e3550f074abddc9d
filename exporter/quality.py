"""How far an export's predictions drift from the fp32 Hugging Face model: teacher-forced.

Both sides read the same token ids, a fixed text shipped next to this module (English
prose, self-written: quality_prose.txt; a short chat: quality_chat.json), and give logits
at every position. A candidate is scored against the reference at each position that
predicts a token of the text (all but the last):

- top-1 agreement: the fraction of those positions where both pick the same argmax;
- perplexity: exp of the mean negative log-likelihood of the text's actual next token,
  for the candidate and for the reference;
- KL: the mean KL(reference || candidate) of the next-token distributions, in nats.

The figures of several passages combine exactly (``combine``): positions weigh alike.
The scoring (``compare_logits``) is pure numpy; the reference and the stage chain are
run by ``hf_logits`` and ``chain_logits``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from dataplane.head.local_chain import LocalChain

PROSE_FILE = Path(__file__).with_name("quality_prose.txt")
CHAT_FILE = Path(__file__).with_name("quality_chat.json")
ROW_BLOCK = 256  # positions scored at a time: float64 temporaries stay ~100 MB at 49k vocab


@dataclass(frozen=True)
class Agreement:
    """A candidate's figures against the reference over ``positions`` scored positions."""

    positions: int
    top1_agreement: float
    perplexity: float
    ref_perplexity: float
    kl: float

    def rounded(self, digits: int = 4) -> dict[str, float | int]:
        """The figures as a JSON-ready dict: ``digits`` decimals, KL to as many significant
        digits (it is often 1e-5 and below)."""
        out: dict[str, float | int] = {key: value if isinstance(value, int) else round(value, digits)
                                       for key, value in asdict(self).items()}
        out["kl"] = float(f"{self.kl:.{digits}g}")
        return out


def _log_softmax(rows: np.ndarray) -> np.ndarray:
    shifted = rows.astype(np.float64) - rows.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def compare_logits(reference: np.ndarray, candidate: np.ndarray,
                   token_ids: Sequence[int]) -> Agreement:
    """Score ``candidate`` logits [T, V] against ``reference`` logits [T, V], both computed
    over ``token_ids`` (T of them): position i predicts token i + 1, so T - 1 positions
    are scored."""
    ids = np.asarray(token_ids, dtype=np.int64)
    if reference.shape != candidate.shape or reference.ndim != 2:
        raise ValueError(f"logits must be [tokens, vocab] of one shape, got {reference.shape} "
                         f"and {candidate.shape}")
    if len(ids) != reference.shape[0] or len(ids) < 2:
        raise ValueError(f"{len(ids)} token ids for {reference.shape[0]} positions: need one id "
                         "per position and at least two")
    scored = len(ids) - 1
    agree = nll_ref = nll_cand = kl = 0.0
    for start in range(0, scored, ROW_BLOCK):
        end = min(start + ROW_BLOCK, scored)
        ref, cand = reference[start:end], candidate[start:end]
        agree += float((ref.argmax(axis=-1) == cand.argmax(axis=-1)).sum())
        log_ref, log_cand = _log_softmax(ref), _log_softmax(cand)
        rows, targets = np.arange(end - start), ids[start + 1:end + 1]
        nll_ref -= float(log_ref[rows, targets].sum())
        nll_cand -= float(log_cand[rows, targets].sum())
        kl += float((np.exp(log_ref) * (log_ref - log_cand)).sum())
    return Agreement(scored, agree / scored, math.exp(nll_cand / scored),
                     math.exp(nll_ref / scored), kl / scored)


def combine(parts: Sequence[Agreement]) -> Agreement:
    """The figures over every position of ``parts`` together (perplexities through their
    mean log-likelihoods, so this equals scoring all the positions at once)."""
    total = sum(part.positions for part in parts)
    if not total:
        raise ValueError("nothing to combine")

    def mean(values: Sequence[float]) -> float:
        return sum(part.positions * v for part, v in zip(parts, values, strict=True)) / total

    return Agreement(
        total,
        mean([p.top1_agreement for p in parts]),
        math.exp(mean([math.log(p.perplexity) for p in parts])),
        math.exp(mean([math.log(p.ref_perplexity) for p in parts])),
        mean([p.kl for p in parts]),
    )


# -- the fixed text --------------------------------------------------------------------------


@dataclass(frozen=True)
class Passage:
    """One teacher-forced sequence of the evaluation text."""

    name: str
    token_ids: tuple[int, ...]


def eval_messages() -> list[dict[str, str]]:
    """The chat passage's conversation (user and assistant turns)."""
    return list(json.loads(CHAT_FILE.read_text(encoding="utf-8")))


def eval_passages(export_dir: Path | str, limit: int = 0) -> list[Passage]:
    """The evaluation text as the export's tokenizer encodes it: the prose raw (with the
    tokenizer's special tokens, e.g. BOS), the chat through the model's chat template (as
    a served conversation is encoded; left out if the model has none). ``limit``: at most
    that many tokens per passage (0: all)."""
    from tokenizers import Tokenizer

    from zctl.engine.tokenizer import ChatTokenizer

    export_dir = Path(export_dir)
    chat = ChatTokenizer(export_dir)
    raw = Tokenizer.from_file(str(export_dir / "tokenizer.json"))
    texts = [("prose", PROSE_FILE.read_text(encoding="utf-8"), True)]
    if chat.chat_template:
        texts.append(("chat", chat.render_chat(eval_messages()), False))
    passages = []
    for name, text, specials in texts:
        ids = raw.encode(text, add_special_tokens=specials).ids
        passages.append(Passage(name, tuple(ids[:limit] if limit else ids)))
    return passages


# -- running both sides ------------------------------------------------------------------------


def hf_logits(model: Any, token_ids: Sequence[int]) -> np.ndarray:
    """Logits [T, V] of a Hugging Face causal LM over ``token_ids`` in one forward pass."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(token_ids)], dtype=torch.long), use_cache=False)
    return out.logits[0].float().numpy()


def chain_logits(chain: LocalChain, token_ids: Sequence[int], chunk: int = 0,
                 stream: int = 0) -> np.ndarray:
    """Logits [T, V] at every position of ``token_ids`` fed through the stage chain on a
    fresh ``stream``, ``chunk`` tokens a step (0: all in one step; 1: as decode does, each
    token reading the KV cache the earlier steps wrote)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    step = chunk or len(ids)
    chain.open(stream)
    chain.reset(stream)
    parts = []
    for start in range(0, len(ids), step):
        part = ids[start:start + step]
        reply = chain.step(stream, part, np.arange(start, start + len(part)),
                           logits_idx=np.arange(len(part)), want_logits=True)
        assert reply.logits is not None  # want_logits
        parts.append(reply.logits)
    chain.reset(stream)
    return np.concatenate(parts)


def measure_chain(chain: LocalChain, passages: Sequence[Passage],
                  reference: Mapping[str, np.ndarray], chunk: int = 0) -> dict[str, Agreement]:
    """The chain's figures per passage against ``reference`` (logits by passage name), and
    over all of them together under "all"."""
    figures = {p.name: compare_logits(reference[p.name], chain_logits(chain, p.token_ids, chunk),
                                      p.token_ids)
               for p in passages}
    figures["all"] = combine(list(figures.values()))
    return figures
