"""The identity cases: each request's tokens in a case against the same request's
reference (sent alone, nothing cached, not streamed, no speculation), per setting.

- cached: every prompt sent again to an engine that served them all once (a whole prompt
  found in the prefix cache), and the first pass too, where later prompts find the
  shared starts of earlier ones;
- follow_up: a second turn (prompt, the answer, another question) on the engine that
  served the first, its start cached, against the same turn sent cold;
- concurrent: the prompts 8 at a time in row groups with the prefix cache on (as
  ``zctl serve`` runs by default), each a row among 7 others;
- lookup: prompt lookup speculation on;
- streamed: each token sent as it comes;
- healed: 8 at a time through an outage (the pipeline down for a moment mid-generation,
  every stream replayed onto fresh KV).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tools.repeatable.lab import Lab, Request
from tools.repeatable.prompts import FOLLOW_UP

CASES = ("cached", "follow_up", "concurrent", "lookup", "streamed", "healed")
GROUP = 8  # streams at once in the concurrent and healed cases
FOLLOW_UPS = 8  # prompts whose second turn is compared


def agreement(got: Sequence[Sequence[int]], want: Sequence[Sequence[int]]) -> dict[str, Any]:
    """How many outputs equal their references token for token, of how many, the
    fraction, and the index of each one that differs."""
    if len(got) != len(want):
        raise ValueError(f"{len(got)} outputs for {len(want)} references")
    differ = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if list(g) != list(w)]
    n = len(want)
    return {"identical": n - len(differ), "of": n,
            "fraction": (n - len(differ)) / n if n else None, "differ": differ}


def batches(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def run_cases(lab: Lab, setting: str, prompts: Sequence[str], max_tokens: int,
              cases: Sequence[str] = CASES) -> dict[str, dict[str, Any]]:
    """Every case's agreement with the references, for one setting."""
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise ValueError(f"unknown case(s) {unknown}: choose from {', '.join(CASES)}")
    requests = [Request(p, max_tokens) for p in prompts]
    ref = [lab.run(lab.engine(setting), [r])[0] for r in requests]
    want = [d.tokens for d in ref]
    out: dict[str, dict[str, Any]] = {}

    def alone(rs: Sequence[Request], engine: Any = None) -> list[list[int]]:
        return [lab.run(engine or lab.engine(setting), [r])[0].tokens for r in rs]

    if "cached" in cases:
        engine = lab.engine(setting, cache=True)
        first = alone(requests, engine)
        again = alone(requests, engine)
        out["cached"] = agreement(again, want)
        out["shared_prefix"] = agreement(first, want)
    if "follow_up" in cases:
        got, cold = [], []
        for request, answer in list(zip(requests, ref, strict=True))[:FOLLOW_UPS]:
            engine = lab.engine(setting, cache=True)
            lab.run(engine, [request])
            second = Request(request.prompt, max_tokens, answer=answer.text, follow_up=FOLLOW_UP)
            got.append(lab.run(engine, [second])[0].tokens)
            cold.append(lab.run(lab.engine(setting), [second])[0].tokens)
        out["follow_up"] = agreement(got, cold)
    if "concurrent" in cases:
        got = []
        for batch in batches(requests, GROUP):
            engine = lab.engine(setting, cache=True, row_groups=lab.stages)
            got += [d.tokens for d in lab.run(engine, batch)]
        out["concurrent"] = agreement(got, want)
    if "lookup" in cases:
        out["lookup"] = agreement(alone([Request(r.prompt, max_tokens, speculative="lookup")
                                         for r in requests]), want)
    if "streamed" in cases:
        out["streamed"] = agreement(alone([Request(r.prompt, max_tokens, streamed=True)
                                           for r in requests]), want)
    if "healed" in cases:
        got, outages = [], lab.outages
        for batch in batches(requests, GROUP):
            engine = lab.engine(setting, row_groups=lab.stages)
            got += [d.tokens for d in lab.run(engine, batch,
                                              outage_after=len(batch) * max_tokens // 4)]
        out["healed"] = {**agreement(got, want), "outages": lab.outages - outages}
    return out
