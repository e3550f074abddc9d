"""Teacher-forced quality figures (exporter/quality.py) on logits with hand-computed values,
the shipped evaluation text, and the stage chain against Hugging Face on the tiny model."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from exporter.quality import (
    CHAT_FILE,
    PROSE_FILE,
    Agreement,
    chain_logits,
    combine,
    compare_logits,
    eval_passages,
    hf_logits,
    measure_chain,
)

SPLIT2 = [(0, 2), (2, 4)]


def _logits(*rows: list[float]) -> np.ndarray:
    """Logits whose softmax is each row's probabilities."""
    return np.log(np.array(rows, dtype=np.float32))


def test_figures_on_hand_computed_logits() -> None:
    ids = [0, 1, 0]  # position 0 predicts token 1, position 1 predicts token 0
    reference = _logits([0.5, 0.25, 0.25], [0.8, 0.1, 0.1], [0.1, 0.1, 0.8])
    candidate = _logits([0.25, 0.5, 0.25], [0.8, 0.1, 0.1], [0.8, 0.1, 0.1])
    candidate[1] += 7.0  # a constant added to a row's logits changes no probability
    figures = compare_logits(reference, candidate, ids)
    # the last position predicts nothing in the text: it is not scored (counted, its
    # disagreement would make top-1 1/3)
    assert figures.positions == 2
    assert figures.top1_agreement == pytest.approx(0.5)  # argmax 0 vs 1, then 0 vs 0
    # exp(-(ln 0.25 + ln 0.8) / 2) and exp(-(ln 0.5 + ln 0.8) / 2): the next token's
    # probability (scoring token i instead of i + 1 would read 0.5 and 0.1)
    assert figures.ref_perplexity == pytest.approx(1 / math.sqrt(0.2), rel=1e-6)
    assert figures.perplexity == pytest.approx(1 / math.sqrt(0.4), rel=1e-6)
    # KL(ref || cand): 0.5 ln 2 - 0.25 ln 2 at position 0, 0 at position 1
    assert figures.kl == pytest.approx(0.125 * math.log(2), rel=1e-5)


def test_identical_logits_agree_fully_and_blocks_do_not_change_the_figures(monkeypatch) -> None:
    import exporter.quality as quality

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(40, 17)).astype(np.float32) * 3
    ids = rng.integers(0, 17, size=40)
    same = compare_logits(logits, logits.copy(), ids)
    assert same.top1_agreement == 1.0 and same.kl == pytest.approx(0.0, abs=1e-9)
    assert same.perplexity == pytest.approx(same.ref_perplexity)
    noisy = logits + rng.normal(size=logits.shape).astype(np.float32)
    whole = compare_logits(logits, noisy, ids)
    monkeypatch.setattr(quality, "ROW_BLOCK", 7)  # scored 7 positions at a time
    assert asdict(compare_logits(logits, noisy, ids)) == pytest.approx(asdict(whole))
    assert whole.top1_agreement < 1.0 and whole.kl > 0


def test_combine_weighs_every_position_alike() -> None:
    a = Agreement(positions=30, top1_agreement=0.9, perplexity=20.0, ref_perplexity=18.0, kl=0.1)
    b = Agreement(positions=10, top1_agreement=0.5, perplexity=5.0, ref_perplexity=4.0, kl=0.3)
    both = combine([a, b])
    assert both.positions == 40
    assert both.top1_agreement == pytest.approx((30 * 0.9 + 10 * 0.5) / 40)
    assert both.kl == pytest.approx((30 * 0.1 + 10 * 0.3) / 40)
    # through the mean NLL: exp((30 ln 20 + 10 ln 5) / 40), not the mean of 20 and 5
    assert both.perplexity == pytest.approx(math.exp((30 * math.log(20) + 10 * math.log(5)) / 40))
    assert both.ref_perplexity == pytest.approx(math.exp((30 * math.log(18) + 10 * math.log(4)) / 40))


def test_bad_shapes_are_refused() -> None:
    logits = np.zeros((3, 5), dtype=np.float32)
    with pytest.raises(ValueError, match="one shape"):
        compare_logits(logits, np.zeros((3, 6), dtype=np.float32), [0, 1, 2])
    with pytest.raises(ValueError, match="one id per position"):
        compare_logits(logits, logits, [0, 1])
    with pytest.raises(ValueError):
        combine([])


def test_the_evaluation_text_ships_with_the_exporter(tiny_exports) -> None:
    assert 4000 < len(PROSE_FILE.read_text()) < 12000
    messages = json.loads(CHAT_FILE.read_text())
    assert {m["role"] for m in messages} == {"user", "assistant"}
    export = tiny_exports.get(SPLIT2)
    prose, chat = eval_passages(export)
    assert (prose.name, chat.name) == ("prose", "chat")
    assert prose.token_ids[0] == 0  # the tiny tokenizer's BOS, added to the raw prose
    from zctl.engine.tokenizer import ChatTokenizer

    text = ChatTokenizer(export).decode(list(chat.token_ids), skip_special_tokens=False)
    assert text.startswith("<|im_start|>") and messages[-1]["content"] in text
    assert [len(p.token_ids) for p in eval_passages(export, limit=50)] == [50, 50]


@pytest.fixture(scope="module")
def tiny_reference(tiny_llama_dir: Path, tiny_exports):
    """The tiny model's passages (64 tokens each) and its HF logits over them."""
    from exporter.sources import open_source

    passages = eval_passages(tiny_exports.get(SPLIT2), limit=64)
    model = open_source(str(tiny_llama_dir)).load_hf_model()
    return passages, {p.name: hf_logits(model, p.token_ids) for p in passages}


def test_an_fp32_chain_agrees_with_hugging_face_at_every_position(tiny_exports,
                                                                  tiny_reference) -> None:
    from dataplane.head.local_chain import LocalChain
    from exporter.verify import EXACT_CONFIG

    passages, reference = tiny_reference
    chain = LocalChain.load(str(tiny_exports.get(SPLIT2)), EXACT_CONFIG)
    whole = measure_chain(chain, passages, reference)
    assert set(whole) == {"prose", "chat", "all"} and whole["all"].positions == 2 * 63
    assert whole["all"].top1_agreement == 1.0 and whole["all"].kl < 1e-5
    assert whole["all"].perplexity == pytest.approx(whole["all"].ref_perplexity, rel=1e-4)
    # token by token (each step reading the KV the earlier ones wrote): the same logits
    stepped = chain_logits(chain, passages[0].token_ids, chunk=1)
    np.testing.assert_allclose(stepped, reference["prose"], atol=2e-3)
    # a reference one position off is caught (the figures read positions, not a bag)
    shifted = compare_logits(reference["prose"][1:], stepped[:-1], passages[0].token_ids[1:])
    assert shifted.top1_agreement < 0.5
