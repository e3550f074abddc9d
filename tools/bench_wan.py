"""WAN sweep: throughput against injected per-hop latency (the paper's Figure 2 / Table 10).

No netem here: every process of a local 2-node cluster delays each data frame it sends
by a fixed one-way latency in its own link layer (``dataplane.wire.link``; ``zctl``'s
``start_local_cluster(..., link_delay_ms=D)``), so each hop (stage 0 -> 1 and the last
stage's reply -> coordinator) gets D ms. The cluster is restarted per delay and driven
through the generation service as ``zctl run`` drives it. For each delay:

- plain greedy decoding, one stream: tok/s and the per-token step time (p50);
- greedy with prompt-lookup speculation and adaptive K (``k=0``): tok/s, the mean K the
  service reports (``spec["k_mean"]``, over its last 16 steps) and the acceptance rate;
  rewrite/repeat prompts (code, JSON) where lookup drafts can work, and one free-form one;
- 4 concurrent streams (plain greedy): aggregate decode tok/s (micro-batching hides latency;
  the local cluster's defaults: every stream in flight on its own behind a delayed link,
  one row group at 0 ms).

Tok/s is the service's own figure (decode tokens after the first / decode time), averaged
over the prompts; ``speedup`` is speculative / plain on the same prompts. ``network_ms`` is
the dashboard's network figure (p50, both hops): it should grow by 2 x the delay.

    python -m tools.bench_wan [--delays 0,5,10,25,50] [--tokens 48] [--runs 1] [--json]
                              [--plot docs/wan_sweep.png]
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from controlplane.records import RuntimeSpec
from tools.bench_common import (
    BenchModel,
    Json,
    Model,
    Precision,
    Threads,
    Weights,
    err,
    fail,
    generate_done,
    parse_numbers,
    plugin_properties,
)
from zctl.launcher.local import runtime_spec, start_local_cluster, stop_processes, wait_serving

JSON = ('{"name": "zctl", "host": "10.0.0.1", "port": 5550, "stages": 2, "weights": "int4", '
        '"nodes": ["pc1", "pc2", "pc3"], "curve": false}')
PROMPTS = [  # (kind, prompt): "edit" prompts make the model repeat its input: lookup drafts hit
    ("edit", f"Here is a JSON object:\n{JSON}\nRepeat it, with the port set to 8081."),
    ("edit", f"Convert this JSON to YAML:\n{JSON}"),
    ("free", "Explain in detail how a bicycle's gears work."),
]
STREAMS = 4


def run_one(serve: str, prompt: str, tokens: int, speculative: str = "") -> dict[str, Any]:
    """One request through the generation service: tok/s, step time, network, spec figures."""
    done = generate_done(serve, prompt, tokens, speculative=speculative, k=0)
    timing = done.timing

    def p50(name: str) -> float | None:
        value = timing.get(name, {}).get("p50")
        return None if value is None else round(value, 2)

    return {"tok_s": round(done.tok_s, 2), "step_ms": p50("total"), "network_ms": p50("network"),
            "hop_network_ms": [p50("hop0-1.network"), p50("hop1-2.network")],
            "k_mean": done.spec.get("k_mean"), "acceptance": done.spec.get("acceptance"),
            "tokens_per_step": done.spec.get("tokens_per_step")}


def run_streams(serve: str, tokens: int, n: int) -> float:
    """Aggregate decode tok/s of n concurrent plain-greedy streams (prefill excluded)."""
    from tools.bench_microbatch import cluster_aggregate

    prompts = [PROMPTS[i % len(PROMPTS)][1] for i in range(n)]
    return round(cluster_aggregate(serve, prompts, tokens)["aggregate_tok_s"], 2)


def measure_delay(export_dir: Path, delay: float, runtime: RuntimeSpec, root: Path, tokens: int,
                  runs: int) -> dict[str, Any]:
    """Start a cluster with ``delay`` ms per hop, measure every mode, stop it."""
    started = time.monotonic()
    record = start_local_cluster(export_dir, 2, runtime, root, link_delay_ms=delay)
    plain: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(PROMPTS))}
    spec: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(PROMPTS))}
    streams: list[float] = []
    try:
        wait_serving(record, 300)
        run_one(record.serve, PROMPTS[0][1], 8)  # warm-up (compiles, first-request costs)
        for _ in range(runs):
            for i, (_, prompt) in enumerate(PROMPTS):
                plain[i].append(run_one(record.serve, prompt, tokens))
                spec[i].append(run_one(record.serve, prompt, tokens, "lookup"))
            streams.append(run_streams(record.serve, tokens, STREAMS))
    finally:
        stop_processes(record.pids)

    def med(samples: list[dict[str, Any]], key: str) -> float | None:
        values = [s[key] for s in samples if s.get(key) is not None]
        return round(statistics.median(values), 3) if values else None

    prompts = []
    for i, (kind, _) in enumerate(PROMPTS):
        p, s = med(plain[i], "tok_s"), med(spec[i], "tok_s")
        prompts.append({"kind": kind, "plain_tok_s": p, "spec_tok_s": s,
                        "speedup": round(s / p, 3) if p and s else None,
                        "step_ms": med(plain[i], "step_ms"),
                        "network_ms": med(plain[i], "network_ms"),
                        "k_mean": med(spec[i], "k_mean"), "acceptance": med(spec[i], "acceptance"),
                        "tokens_per_step": med(spec[i], "tokens_per_step")})

    def mean(key: str, kind: str | None = None) -> float | None:
        values = [p[key] for p in prompts if p[key] is not None and kind in (None, p["kind"])]
        return round(statistics.mean(values), 2) if values else None

    hop_net = [[s["hop_network_ms"][h] for v in plain.values() for s in v
                if s["hop_network_ms"][h] is not None] for h in range(2)]
    plain_tok_s, spec_tok_s = mean("plain_tok_s"), mean("spec_tok_s")
    return {
        "delay_ms": delay, "step_ms": mean("step_ms"), "network_ms": mean("network_ms"),
        "hop_network_ms": [round(statistics.median(h), 2) if h else None for h in hop_net],
        "plain_tok_s": plain_tok_s, "spec_tok_s": spec_tok_s,
        "speedup": round(spec_tok_s / plain_tok_s, 3) if plain_tok_s and spec_tok_s else None,
        "speedup_edit": mean("speedup", "edit"), "speedup_free": mean("speedup", "free"),
        "k_mean": mean("k_mean"), "k_mean_edit": mean("k_mean", "edit"),
        "k_mean_free": mean("k_mean", "free"), "acceptance": mean("acceptance"),
        f"streams{STREAMS}_tok_s": round(statistics.median(streams), 2),
        "prompts": prompts, "seconds": round(time.monotonic() - started, 1),
    }


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    delays = [r["delay_ms"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(delays, [r["plain_tok_s"] for r in rows], "o-", label="greedy, 1 stream")
    left.plot(delays, [r["spec_tok_s"] for r in rows], "s-", label="greedy + lookup (adaptive K)")
    left.plot(delays, [r[f"streams{STREAMS}_tok_s"] for r in rows], "^-",
              label=f"{STREAMS} streams, aggregate")
    left.set_xlabel("injected one-way latency per hop (ms)")
    left.set_ylabel("tok/s")
    left.set_yscale("log")
    left.grid(True, which="both", alpha=0.3)
    left.legend()
    right.plot(delays, [r["k_mean_edit"] for r in rows], "o-", label="mean K (rewrite prompts)")
    right.plot(delays, [r["k_mean_free"] for r in rows], "s--", label="mean K (free-form)")
    right.set_xlabel("injected one-way latency per hop (ms)")
    right.set_ylabel("mean draft length K")
    right.grid(True, alpha=0.3)
    twin = right.twinx()
    twin.plot(delays, [r["speedup"] for r in rows], "d:", color="tab:red", label="speedup")
    twin.set_ylabel("speculative / plain", color="tab:red")
    lines = right.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    right.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def wan_table(title: str, rows: list[dict[str, Any]]) -> Table:
    """The table printed without --json: one row per delay."""
    table = Table(title=title)
    for column in ("delay ms", "step ms", "network ms", "tok/s plain", "tok/s spec", "speedup",
                   "speedup free-form", "mean K", "acceptance", f"{STREAMS}-stream tok/s"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(*(str(v) if v is not None else "-" for v in (
            f"{r['delay_ms']:g}", r["step_ms"], r["network_ms"], r["plain_tok_s"],
            r["spec_tok_s"], r["speedup"], r["speedup_free"], r["k_mean"], r["acceptance"],
            r[f"streams{STREAMS}_tok_s"])))
    return table


def main(
    delays: Annotated[str, typer.Option(help="one-way ms per hop, comma-separated")] = "0,5,10,25,50",
    model: Model = "smollm2-135m",
    weights: Weights = "int4",
    tokens: Annotated[int, typer.Option(help="new tokens per request")] = 48,
    runs: Annotated[int, typer.Option(help="runs per delay (median per prompt)")] = 1,
    precision: Precision = "f32",
    threads: Threads = 0,
    plot_path: Annotated[Path | None, typer.Option(
        "--plot", help="write a PNG of the sweep here")] = None,
    as_json: Json = False,
) -> None:
    sweep = parse_numbers(delays, "--delays", "delays in ms", float, minimum=0)
    if tokens < 2 or runs < 1:
        fail("--tokens must be >= 2 and --runs >= 1")
    bench_model = BenchModel.resolve(model)
    export_dir = bench_model.export(2, weights)
    props = plugin_properties(precision, threads)
    runtime = runtime_spec(props.get("INFERENCE_PRECISION_HINT"), threads or None, "CPU")
    rows = []
    for delay in sweep:
        row = measure_delay(export_dir, delay, runtime, bench_model.cache / "bench-wan", tokens,
                            runs)
        rows.append(row)
        err.print(f"delay {delay:g} ms: step {row['step_ms']} ms, plain {row['plain_tok_s']}, "
                  f"spec {row['spec_tok_s']} tok/s (K {row['k_mean']}), {STREAMS} streams "
                  f"{row[f'streams{STREAMS}_tok_s']} tok/s ({row['seconds']} s)")
    title = f"2-node local cluster, {model} {weights}, {tokens} tokens, delay on every hop"
    if plot_path is not None:
        plot(rows, plot_path, title)
    result = {"model": model, "stages": 2, "weights": weights, "tokens": tokens, "runs": runs,
              "properties": props, "delays_ms": sweep, "rows": rows,
              "plot": str(plot_path) if plot_path else None}
    if as_json:
        print(json.dumps(result))
        return
    Console().print(wan_table(title, rows))
    if plot_path is not None:
        Console().print(f"plot: {plot_path}")


if __name__ == "__main__":
    typer.run(main)
