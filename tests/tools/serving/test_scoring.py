"""tools/serving/scoring's pure parts: the passages it scores and its figures against a
reference (the cluster run is `python -m tools.serving.scoring`)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tools.serving.scoring import MIN_PARAGRAPH_CHARS, passages, score_figures
from zctl.engine.sampling import log_softmax


def test_the_passages_are_the_proses_paragraphs() -> None:
    texts = passages(6)
    assert len(texts) == 6 and len(set(texts)) == 6
    assert all(len(t) >= MIN_PARAGRAPH_CHARS and "\n\n" not in t for t in texts)


def test_the_figures_of_scores_against_a_reference() -> None:
    rng = np.random.default_rng(3)
    ref = log_softmax(rng.normal(size=(5, 7)))
    ids = [0, 3, 1, 6, 2]
    exact = [float(ref[i, ids[i + 1]]) for i in range(4)]
    best = [int(ref[i].argmax()) for i in range(4)]
    same = score_figures([exact], [ref], [ids], [best])
    assert same["tokens"] == 4 and same["ppl_ratio"] == pytest.approx(1.0)
    assert same["mean_abs_diff"] == 0.0 and same["top1"] == 1.0
    assert same["ppl"] == pytest.approx(math.exp(-sum(exact) / 4))
    worse = score_figures([[s - 0.5 for s in exact]], [ref], [ids],
                          [[(b + 1) % 7 for b in best[:2]] + best[2:]])
    assert worse["ppl_ratio"] == pytest.approx(math.exp(0.5))
    assert worse["mean_abs_diff"] == pytest.approx(0.5) and worse["top1"] == 0.5
    with pytest.raises(ValueError, match="3 scores"):
        score_figures([exact[:3]], [ref], [ids], [best])
    with pytest.raises(ValueError, match="no token"):
        score_figures([], [], [], [])
