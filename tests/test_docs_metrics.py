"""The metrics the command reference (docs/cli.md) lists and docs/serving.md describes are
the ones /metrics serves: a metric added or renamed without its documentation fails here."""

from __future__ import annotations

import re

import pytest

from tests.helpers.repo import ROOT

NAME = re.compile(r"`((?:vllm:|zctl_)[a-z0-9_:]+)(?:\{[^}]*\})?`")


def served() -> set[str]:
    pytest.importorskip("prometheus_client")
    from zctl.serve.metrics import ServeMetrics
    from zctl.service import messages as sm

    histogram = sm.HistogramSnapshot([1.0], [1, 0], 0.5)
    stats = sm.ServiceStats(1, 0, {"requests": 1}, [sm.StageStats(0, "coordinator", True, 4,
                                                                  histogram)],
                            [sm.HopStats("0-1", 64, histogram)], {"coordinator": True}, "",
                            "tiny", 512, 1)
    text = ServeMetrics().render(stats, "tiny").decode()
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}


def documented(text: str) -> set[str]:
    return set(NAME.findall(text))


def test_the_command_reference_lists_every_served_metric() -> None:
    cli = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    listed = cli[cli.index("`GET /metrics`"):cli.index("Errors are OpenAI's shape")]
    assert documented(listed) == served()


def test_the_serving_doc_describes_every_served_metric() -> None:
    doc = (ROOT / "docs" / "serving.md").read_text(encoding="utf-8")
    table = doc[doc.index("## Metrics"):]
    table = table[:table.index("\n## ")] if "\n## " in table else table
    assert documented(table) == served()
