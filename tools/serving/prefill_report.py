"""tools.serving.prefill's figures: the samples a layout collected, their medians and ratios
keyed by prompt length, the inter-token gaps of short streams inside a long prefill, the
issue's targets, the JSON object and the Rich table."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from rich.console import Console
from rich.table import Table

from tools.harness.load import RequestRecord
from tools.harness.stats import percentile
from tools.serving.prefill_systems import ItlRun

SYSTEMS = ("zctl", "genai", "genai_cb")
# JSON key of each (system, kind)'s medians, keyed by prompt length
FIGURE_KEYS = {
    ("zctl", "ttft"): "ttft_ms", ("genai", "ttft"): "genai_ttft_ms",
    ("genai_cb", "ttft"): "genai_cb_ttft_ms",
    ("zctl", "cached"): "cached_ttft_ms", ("genai", "cached"): "genai_cached_ttft_ms",
    ("genai_cb", "cached"): "genai_cb_cached_ttft_ms",
    ("zctl", "decode"): "decode_tok_s", ("genai", "decode"): "genai_decode_tok_s",
}
RATIO_KEYS = {  # ratio key: (numerator, denominator)
    "ttft_ratio": ("ttft_ms", "genai_ttft_ms"),
    "cached_ratio": ("cached_ttft_ms", "genai_cached_ttft_ms"),
    "decode_ratio": ("decode_tok_s", "genai_decode_tok_s"),
    "cb_ttft_ratio": ("ttft_ms", "genai_cb_ttft_ms"),
    "cb_cached_ratio": ("cached_ttft_ms", "genai_cb_cached_ttft_ms"),
}
TTFT_TARGET, TTFT_FROM = 1.0, 1024  # cold TTFT <= 1.0x genai's at 1,024 tokens and above
CACHED_TARGET = 2.0  # a follow-up turn's TTFT <= 2x genai's cached TTFT
DECODE_TARGET, DECODE_AT = 0.95, (2048, 4096)  # decode >= 0.95x genai at 2k and 4k context
ITL_TARGET = 2.0  # the short streams' ITL p99 at most doubles during the long prefill


@dataclass
class Samples:
    """What one layout measured: values by system, kind ("ttft", "cached", "decode") and
    prompt length, and the requests that failed."""

    values: dict[str, dict[str, dict[int, list[float]]]] = field(default_factory=dict)
    errors: list[dict[str, Any]] = field(default_factory=list)

    def add(self, system: str, kind: str, length: int, turn: RequestRecord) -> None:
        """Record ``turn``'s figure of ``kind`` (or its error)."""
        value = turn.decode_tok_s if kind == "decode" else turn.ttft_ms
        if not turn.ok or value is None:
            self.errors.append({"system": system, "kind": kind, "length": length,
                                "error": turn.error or "no tokens"})
            return
        self.values.setdefault(system, {}).setdefault(kind, {}).setdefault(length, []).append(
            round(value, 3))


def median_or_none(values: Sequence[float] | None) -> float | None:
    return round(float(statistics.median(values)), 2) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def figures(samples: Samples, lengths: Sequence[int],
            decode_lengths: Sequence[int]) -> dict[str, dict[str, float | None]]:
    """The medians by JSON key, each keyed by prompt length as a string (None: not
    measured or every request failed), and the ratios zctl / genai."""
    out: dict[str, dict[str, float | None]] = {}
    for (system, kind), key in FIGURE_KEYS.items():
        by_length = samples.values.get(system, {}).get(kind, {})
        out[key] = {str(n): median_or_none(by_length.get(n))
                    for n in (decode_lengths if kind == "decode" else lengths)}
    for key, (num, den) in RATIO_KEYS.items():
        out[key] = {n: ratio(v, out[den][n]) for n, v in out[num].items()}
    return out


# -- inter-token latency inside a long prefill --------------------------------------------------


def overlapping_gaps(times: Sequence[float], start: float, end: float) -> list[float]:
    """The gaps between successive tokens that overlap [start, end] (a gap that straddles
    the window's start or end counts: a stall is a stall)."""
    return [b - a for a, b in pairwise(times) if b > start and a < end]


def gap_stats(gaps: Sequence[float]) -> dict[str, float | int | None]:
    """p50, p99 and max of gaps in ms, and how many there were."""
    def ms(value: float | None) -> float | None:
        return None if value is None else round(value * 1e3, 2)

    return {"p50": ms(percentile(gaps, 50)), "p99": ms(percentile(gaps, 99)),
            "max": ms(max(gaps) if gaps else None), "gaps": len(gaps)}


def itl_figures(alone: ItlRun, during: ItlRun) -> dict[str, Any]:
    """The short streams' gaps alone (from when each had its warm-up tokens to the first
    one's end: all of them decoding) against inside the long prompt's prefill (from its
    request to its first token), and the ratios during / alone."""
    errors = [t.error for t in (*alone.streams, *during.streams, during.long) if t and t.error]
    end_alone = min((t.chunk_times[-1] for t in alone.streams if t.chunk_times), default=alone.ready)
    quiet = [g for t in alone.streams for g in overlapping_gaps(t.chunk_times, alone.ready, end_alone)]
    long = during.long
    if long is None or not long.chunk_times:
        busy: list[float] = []
        window = None
    else:
        window = (long.start, long.chunk_times[0])
        busy = [g for t in during.streams for g in overlapping_gaps(t.chunk_times, *window)]
    a, d = gap_stats(quiet), gap_stats(busy)
    return {
        "alone_ms": a, "during_ms": d,
        "ratio_p50": ratio(d["p50"], a["p50"]), "ratio_p99": ratio(d["p99"], a["p99"]),
        "ratio_max": ratio(d["max"], a["max"]),
        "long_prompt_tokens": long.prompt_tokens if long else None,
        "long_ttft_ms": round(long.ttft_ms, 1) if long and long.ttft_ms else None,
        # short streams still decoding when the long prompt's first token came
        "streams_through_prefill": sum(bool(t.chunk_times) and t.chunk_times[-1] >= window[1]
                                       for t in during.streams) if window else 0,
        "streams": len(during.streams), "errors": errors,
    }


# -- targets, the JSON, the table -----------------------------------------------------------------


def _all(values: Mapping[str, float | None], ok: Any) -> bool | None:
    if not values or any(v is None for v in values.values()):
        return None
    return all(ok(v) for v in values.values())


def targets(fig: Mapping[str, Any], itl_ratio: float | None) -> dict[str, dict[str, Any]]:
    """The issue's targets on a layout's figures: value and met (None: not measured)."""
    cold = {n: v for n, v in fig["ttft_ratio"].items() if int(n) >= TTFT_FROM}
    decode = {n: v for n, v in fig["decode_ratio"].items() if int(n) in DECODE_AT}
    return {
        "ttft_cold": {"target": f"TTFT <= {TTFT_TARGET}x genai LLMPipeline's at "
                                f">= {TTFT_FROM} tokens", "value": cold,
                      "met": _all(cold, lambda v: v <= TTFT_TARGET)},
        "ttft_cached": {"target": f"follow-up TTFT <= {CACHED_TARGET}x genai LLMPipeline's "
                                  "cached TTFT", "value": fig["cached_ratio"],
                        "met": _all(fig["cached_ratio"], lambda v: v <= CACHED_TARGET)},
        "decode_at_context": {"target": f"decode tok/s >= {DECODE_TARGET}x genai LLMPipeline "
                                        f"at {' and '.join(map(str, DECODE_AT))} tokens",
                              "value": decode, "met": _all(decode, lambda v: v >= DECODE_TARGET)},
        "itl_under_prefill": {"target": f"short streams' ITL p99 <= {ITL_TARGET}x alone while "
                                        "a long prompt prefills", "value": itl_ratio,
                              "met": None if itl_ratio is None else itl_ratio <= ITL_TARGET},
    }


def layout_result(samples: Samples, lengths: Sequence[int], decode_lengths: Sequence[int],
                  itl: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """One layout's object: the figures, the ITL under a long prefill of each system that
    ran it, ``itl_ratio`` (zctl's p99 during / alone), the targets, errors, raw samples."""
    fig = figures(samples, lengths, decode_lengths)
    zctl_itl = itl.get("zctl")
    itl_ratio = zctl_itl["ratio_p99"] if zctl_itl else None
    cb = itl.get("genai_cb")
    return {**fig, "itl": dict(itl), "itl_ratio": itl_ratio,
            "genai_cb_itl_ratio": cb["ratio_p99"] if cb else None,
            "targets": targets(fig, itl_ratio), "errors": len(samples.errors),
            "error_list": samples.errors[:20], "samples": samples.values}


def report(layouts: Mapping[str, dict[str, Any]], record: Mapping[str, Any],
           settings: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON object: where and when, the first layout's figures at the top (the
    default: shared cores), every layout under ``layouts``, the settings."""
    first = next(iter(layouts))
    top = {k: v for k, v in layouts[first].items() if k not in ("samples", "error_list")}
    return {**record, "layout": first, **top, "layouts": dict(layouts), "settings": dict(settings)}


def _cell(value: float | None, digits: int = 0, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def print_report(result: Mapping[str, Any], console: Console) -> None:
    """A table per layout (TTFT cold and cached, decode at context), its ITL and targets."""
    console.print(f"zctl (2-node local cluster, zctl serve) vs openvino_genai: {result['cpu']}, "
                  f"{result['date']}, commit {result['commit']}", soft_wrap=True, highlight=False,
                  markup=False)
    for name, lay in result["layouts"].items():
        table = Table(title=f"{name} cores: TTFT ms (cold; follow-up turn), decode tok/s")
        for column in ("tokens", "zctl", "genai", "CB", "ratio", "zctl 2nd", "genai 2nd",
                       "CB 2nd", "ratio", "zctl dec", "genai dec", "ratio"):
            table.add_column(column, justify="right")
        lengths = sorted({*map(int, lay["ttft_ms"]), *map(int, lay["decode_tok_s"])})
        columns = (("ttft_ms", 0, ""), ("genai_ttft_ms", 0, ""), ("genai_cb_ttft_ms", 0, ""),
                   ("ttft_ratio", 2, "x"), ("cached_ttft_ms", 0, ""),
                   ("genai_cached_ttft_ms", 0, ""), ("genai_cb_cached_ttft_ms", 0, ""),
                   ("cached_ratio", 2, "x"), ("decode_tok_s", 1, ""),
                   ("genai_decode_tok_s", 1, ""), ("decode_ratio", 3, "x"))
        for n in map(str, lengths):
            table.add_row(n, *(_cell(lay[key].get(n), digits, suffix)
                               for key, digits, suffix in columns))
        console.print(table)
        for system, it in lay["itl"].items():
            a, d = it["alone_ms"], it["during_ms"]
            console.print(
                f"{system}: {it['streams']} short streams' ITL alone p50 {_cell(a['p50'], 1)} / "
                f"p99 {_cell(a['p99'], 1)} / max {_cell(a['max'], 1)} ms; during a "
                f"{it['long_prompt_tokens']}-token prefill ({_cell(it['long_ttft_ms'])} ms) "
                f"p50 {_cell(d['p50'], 1)} / p99 {_cell(d['p99'], 1)} / max {_cell(d['max'], 1)}"
                f" ms over {d['gaps']} gaps: ratio p99 {_cell(it['ratio_p99'], 2, 'x')}",
                soft_wrap=True, highlight=False, markup=False)
        for key, t in lay["targets"].items():
            verdict = "not measured" if t["met"] is None else "met" if t["met"] else "MISSED"
            console.print(f"target {key} ({t['target']}): {t['value']} -> {verdict}",
                          soft_wrap=True, highlight=False, markup=False)
        if lay["errors"]:
            console.print(f"{lay['errors']} failed requests: {lay['error_list'][:3]}",
                          soft_wrap=True, highlight=False, markup=False, style="red")
