"""An experiment's results: one row per cell, the CSV they are written to, and the ratios the
paper's evaluation reports (best K per latency, speedups over plain decoding, top-1 (and
top-k, float16) over full logits, adaptive K against the best fixed K, concurrent streams
over one). Pure functions over the rows.

A row is a dict with ``COLUMNS``; ``tok_s`` is the cell's aggregate decode throughput (the
median over its repetitions). Ratios compare cells that differ only in what is compared.
"""

from __future__ import annotations

import csv
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from tools.harness.stats import paired_ratio
from tools.wan.scenario import Cell

# Parameters of a cell, then its figures, then where and when it was measured.
PARAMETERS = ("scenario", "stages", "delay_ms", "jitter_ms", "rate_mbit", "relay",
              "relay_delay_ms", "shaper", "link", "hops", "decoding", "k", "config", "streams",
              "payload", "tokens", "repetitions")
FIGURES = ("tok_s", "tok_s_runs", "per_stream_tok_s", "k_mean", "acceptance",
           "tokens_per_step", "step_ms", "network_ms", "ttft_ms", "seconds", "error")
RECORD = ("date", "cpu", "commit")
COLUMNS = PARAMETERS + FIGURES + RECORD

# What a cell's throughput is compared within: the cluster (stage count and link).
LINK_KEY = ("stages", "delay_ms", "jitter_ms", "rate_mbit", "relay", "relay_delay_ms", "shaper",
            "hops")


def hops_text(cell: Cell) -> str:
    """The hops' shapes when they differ (empty when every hop has the swept link)."""
    topology = cell.topology
    if topology.uniform:
        return ""
    return "|".join(f"{h.delay_ms:g}ms/{h.label}" for h in topology.hops)


def cell_parameters(scenario: str, cell: Cell, tokens: int, repetitions: int) -> dict[str, Any]:
    """The PARAMETERS columns of a cell."""
    link, work = cell.topology.link, cell.workload
    return {"scenario": scenario, "stages": cell.topology.stages, "delay_ms": link.delay_ms,
            "jitter_ms": link.jitter_ms, "rate_mbit": link.rate_mbit, "relay": link.relay,
            "relay_delay_ms": link.relay_delay_ms, "shaper": link.shaper, "link": link.label,
            "hops": hops_text(cell),
            "decoding": work.decoding, "k": work.k_label, "config": work.config,
            "streams": work.streams, "payload": work.payload, "tokens": tokens,
            "repetitions": repetitions}


def summarise_samples(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A cell's FIGURES from its repetitions' samples (medians; the runs' tok/s listed)."""

    def med(key: str) -> float | None:
        values = [s[key] for s in samples if s.get(key) is not None]
        return round(statistics.median(values), 3) if values else None

    errors = [s["error"] for s in samples if s.get("error")]
    return {"tok_s": med("tok_s"), "k_mean": med("k_mean"), "acceptance": med("acceptance"),
            "tok_s_runs": " ".join(f"{s['tok_s']:.3f}" for s in samples
                                   if s.get("tok_s") is not None),
            "per_stream_tok_s": med("per_stream_tok_s"),
            "tokens_per_step": med("tokens_per_step"), "step_ms": med("step_ms"),
            "network_ms": med("network_ms"), "ttft_ms": med("ttft_ms"),
            "seconds": round(sum(s.get("seconds", 0.0) for s in samples), 2),
            "error": errors[0] if errors else ""}


def write_csv(rows: Iterable[dict[str, Any]], path: Path) -> None:
    """``rows`` as CSV with COLUMNS as its header (missing values empty)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(COLUMNS), extrasaction="raise")
        writer.writeheader()
        for row in rows:
            writer.writerow({c: "" if row.get(c) is None else row.get(c) for c in COLUMNS})


# -- comparisons --------------------------------------------------------------------------------


def _measured(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r.get("tok_s")]


def _key(row: dict[str, Any], columns: Sequence[str]) -> tuple[Any, ...]:
    return tuple(row[c] for c in columns)


def _varies(rows: Sequence[dict[str, Any]], column: str) -> bool:
    return len({r[column] for r in rows}) > 1


def latency_key(row: dict[str, Any], rows: Sequence[dict[str, Any]]) -> str:
    """The per-hop latency in ms (``100``), naming the stage count and the link as well
    (``100@3stages@relay-20mbit``) where the rows have more than one of them. (The hops'
    shapes follow from the swept link: [[hop]] overrides are fixed.)"""
    key = f"{row['delay_ms']:g}"
    if _varies(rows, "stages"):
        key += f"@{row['stages']}stages"
    for column in ("link", "jitter_ms", "relay_delay_ms"):
        if _varies(rows, column):
            key += f"@{row['link']}" if column == "link" else f"@{column}={row[column]}"
    return key


def _ratio(num: float, den: float) -> float:
    return round(num / den, 3)


def best_fixed_k(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per latency (``latency_key``): the fixed K whose single-stream top-1 lookup decoding
    was fastest, its tok/s, and adaptive K's mean K there when measured."""
    rows = _measured(rows)
    single = [r for r in rows if r["streams"] == 1 and r["payload"] == "top1"
              and r["decoding"] == "lookup"]
    out: dict[str, dict[str, Any]] = {}
    for r in single:
        if r["k"] == "auto":
            continue
        key = latency_key(r, rows)
        if key not in out or r["tok_s"] > out[key]["tok_s"]:
            out[key] = {"k": int(r["k"]), "tok_s": r["tok_s"], "delay_ms": r["delay_ms"],
                        "stages": r["stages"], "auto_k_mean": None}
    for r in single:
        key = latency_key(r, rows)
        if r["k"] == "auto" and key in out:
            out[key]["auto_k_mean"] = r["k_mean"]
    return out


def best_over_plain(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Per latency: the fastest cell's aggregate tok/s over plain single-stream greedy
    decoding with a top-1 payload on the same cluster."""
    rows = _measured(rows)
    base = {_key(r, LINK_KEY): r for r in rows
            if r["config"] == "plain" and r["streams"] == 1 and r["payload"] == "top1"}
    best: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in rows:
        k = _key(r, LINK_KEY)
        if k in base and (k not in best or r["tok_s"] > best[k]["tok_s"]):
            best[k] = r
    return {latency_key(base[k], rows): _ratio(r["tok_s"], base[k]["tok_s"])
            for k, r in best.items()}


def best_configuration(rows: Sequence[dict[str, Any]]) -> dict[str, str]:
    """Per latency: which cell was fastest (config, streams, payload)."""
    rows = _measured(rows)
    best: dict[str, dict[str, Any]] = {}
    for r in rows:
        key = latency_key(r, rows)
        if key not in best or r["tok_s"] > best[key]["tok_s"]:
            best[key] = r
    return {key: f"{r['config']} x{r['streams']} {r['payload']}" for key, r in best.items()}


def paired_ratios(rows: Sequence[dict[str, Any]], same: Sequence[str],
                  is_base: Callable[[dict[str, Any]], bool],
                  is_compared: Callable[[dict[str, Any]], bool],
                  name: Callable[[dict[str, Any]], str]) -> dict[str, float]:
    """Compared rows' tok/s over their base twin's (equal in the ``same`` columns), paired
    row by row, the median per ``name`` (``paired_ratio``; with the latency and stage
    count appended where those vary)."""
    rows = _measured(rows)
    base = {_key(r, same): r for r in rows if is_base(r)}
    values: dict[str, list[float]] = defaultdict(list)
    bases: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        if is_compared(r) and _key(r, same) in base:
            key = name(r)
            if _varies(rows, "delay_ms"):
                key += f"@{r['delay_ms']:g}ms"
            if _varies(rows, "stages"):
                key += f"@{r['stages']}stages"
            values[key].append(r["tok_s"])
            bases[key].append(base[_key(r, same)]["tok_s"])
    return {key: round(ratio, 3) for key in values  # (every key has a pair: never None)
            if (ratio := paired_ratio(values[key], bases[key])) is not None}


def payload_over_full(rows: Sequence[dict[str, Any]], payload: str = "top1") -> dict[str, float]:
    """Per link (its label, e.g. ``relay-20mbit``; with the latency and stage count where
    those vary): ``payload`` tok/s over full-logits tok/s, for the same decoding, K and
    streams on the same cluster; the median over those pairs."""
    return paired_ratios(rows, (*LINK_KEY, "config", "streams"),
                         lambda r: r["payload"] == "logits", lambda r: r["payload"] == payload,
                         lambda r: r["link"])


def top1_over_full(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """``payload_over_full`` for top-1 replies (the paper's comparison)."""
    return payload_over_full(rows, "top1")


def tbf_over_ours(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Per rate and payload (e.g. ``10mbit/logits``; with the latency and stage count where
    those vary): tok/s over the kernel's tbf over tok/s over our link layer's shaping at the
    same rate, for the same decoding, K and streams; the median over those pairs."""
    return paired_ratios(rows, ("stages", "delay_ms", "jitter_ms", "rate_mbit", "config",
                                "streams", "payload"),
                         lambda r: r["shaper"] == "ours" and not r["relay"],
                         lambda r: r["shaper"] == "tbf",
                         lambda r: f"{r['rate_mbit']:g}mbit/{r['payload']}")


def lookup_over_plain(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Per lookup configuration and stream count (e.g. ``lookup-auto x1``; with the latency
    and stage count where those vary): its tok/s over plain greedy decoding's with the same
    streams and payload on the same cluster (speculation's speedup)."""
    return paired_ratios(rows, (*LINK_KEY, "streams", "payload"),
                         lambda r: r["config"] == "plain", lambda r: r["decoding"] == "lookup",
                         lambda r: f"{r['config']} x{r['streams']}")


def streams_over_one(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Per configuration and stream count above one (e.g. ``plain x4``; with the latency and
    stage count where those vary): the streams' aggregate tok/s over one stream's of the
    same configuration and payload on the same cluster."""
    return paired_ratios(rows, (*LINK_KEY, "config", "payload"),
                         lambda r: r["streams"] == 1, lambda r: r["streams"] > 1,
                         lambda r: f"{r['config']} x{r['streams']}")


def auto_k_over_best_fixed(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Per latency: adaptive K's tok/s over the best fixed K's (single stream, top-1)."""
    best = best_fixed_k(rows)
    measured = _measured(rows)
    out = {}
    for r in measured:
        key = latency_key(r, measured)
        if (r["k"] == "auto" and r["streams"] == 1 and r["payload"] == "top1"
                and key in best):
            out[key] = _ratio(r["tok_s"], best[key]["tok_s"])
    return out


def comparisons(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Every ratio of the run, as its --json object carries them."""
    return {"best_over_plain": best_over_plain(rows),
            "best_configuration": best_configuration(rows),
            "top1_over_full": top1_over_full(rows),
            "topk_over_full": payload_over_full(rows, "topk"),
            "fp16_over_full": payload_over_full(rows, "fp16"),
            "tbf_over_ours": tbf_over_ours(rows),
            "lookup_over_plain": lookup_over_plain(rows),
            "streams_over_one": streams_over_one(rows),
            "auto_k_over_best_fixed": auto_k_over_best_fixed(rows),
            "best_k": {key: value["k"] for key, value in best_fixed_k(rows).items()}}
