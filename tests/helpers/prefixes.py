"""What the prefix-cache tests share: prompts, exact stages, and the comparison of a stream
that loaded a prefix with one that prefilled everything."""

from __future__ import annotations

import numpy as np

from dataplane.runtime.config import RuntimeSpec

EXACT = RuntimeSpec(precision="f32", kv_cache_precision="f32")
P = [0, 17, 42, 99, 5, 230, 7, 64, 3, 11]  # the shared prefix
Q = [8, 8, 1, 6, 2, 9, 4]
MORE = [12, 250, 33]  # what follows it in the stream that loads it
TOL = {"rtol": 1e-5, "atol": 1e-5}
DECODE = 4


def logits(ex, sid: int, ids: list[int], start: int) -> np.ndarray:  # noqa: ANN001
    """Logits [T, V] of every position of one step of ``ids`` at ``start``."""
    reply = ex.step(sid, np.asarray(ids), np.arange(start, start + len(ids)),
                    np.arange(len(ids)), want_logits=True)
    return reply.logits


def run_on(ex, sid: int, ids: list[int], start: int, decode: int = DECODE) -> np.ndarray:  # noqa: ANN001
    """Logits of a step of ``ids`` at ``start`` and of ``decode`` greedy steps after it."""
    out = [logits(ex, sid, ids, start)]
    position = start + len(ids)
    for _ in range(decode):
        out.append(logits(ex, sid, [int(out[-1][-1].argmax())], position))
        position += 1
    return np.concatenate(out)


def scratch(ex, sid: int, tokens: list[int], tail: int) -> np.ndarray:  # noqa: ANN001
    """What a fresh stream computes for ``tokens`` then greedy decoding: the logits of the
    last ``tail`` tokens and of every decode step."""
    ex.open(sid)
    ex.reset(sid)
    return run_on(ex, sid, tokens, 0)[-(tail + DECODE):]


def assert_same_continuation(got: np.ndarray, want: np.ndarray, tol: dict | None = None) -> None:
    np.testing.assert_allclose(got, want, **(tol or TOL))
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
