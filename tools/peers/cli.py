"""zctl against llama.cpp's RPC backend and llama-server on the same PCs, side by side.

Both on the same GGUF bits, layer splits, CPU sets and loopback addresses, interleaved in
one run.

For each case (a model, a weight format, 1-3 nodes with a core each or shared cores, 0 or
10 ms per hop) both systems are up and served through their OpenAI APIs; one stream
(decode tok/s and TTFT at 128 and 1,024 prompt tokens) and serving levels (1-16 clients:
aggregate tok/s, TTFT and ITL p50/p99, errors) alternate between them, several rounds.
``ratios``: zctl's figure over llama.cpp's, the median of the rounds' paired ratios (above
1: zctl better, latencies inverted). ``targets``: the goals, each {value, target, met}.
llama.cpp is built from a pinned source release into $ZCTL_HOME/peers (flags chosen for
this CPU, each reason printed) or taken from ``--llama-cpp DIR``.

    python -m tools.peers.cli [--json] [--quick] [--llama-cpp DIR] [--models ...] [--weights ...]
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from tools.harness.options import Json, fail, parse_numbers
from tools.harness.report import err, print_result, run_record
from tools.harness.stats import rounded
from tools.peers.build import (
    BinariesError,
    BuildFailure,
    LlamaBinaries,
    build,
    find_binaries,
    plan_build,
    toolchain_versions,
)
from tools.peers.cases import TOPOLOGIES, Case, CasePlan, CaseResult, case_matrix, run_case
from tools.peers.cpu import AMX_POLICIES, choose_isa, probe_amx, read_cpu_flags
from tools.peers.gguf import GgufFailure, GgufFile, GgufLayout, gguf_layout, paired_gguf
from tools.peers.models import MODELS, bench_model, export_ranges, shipped_gguf, token_encoder
from tools.peers.placement import describe
from tools.peers.processes import Node, PeerFailure, llama_bench
from tools.peers.report import (
    LLAMA,
    ZCTL,
    case_ratios,
    greedy_targets,
    render,
    targets,
    unmeasured_targets,
)
from tools.peers.source import PIN, SourceFailure, pinned_tree
from tools.peers.systems import LlamaServed, Served, case_nodes, llama_served, zctl_served

# What each option is when not given: the full run, and the quick smoke run.
FULL = {"models": ",".join(MODELS), "weights": "int4,int8", "topologies": ",".join(TOPOLOGIES),
        "delays": "0,10", "prompts": "128,1024", "tokens": 128, "clients": "1,4,8,16",
        "requests": 0, "rounds": 3, "serve_rounds": 1, "greedy_check": True}
QUICK = {**FULL, "models": "smollm2-135m", "weights": "int4", "topologies": "1,2-split",
         "delays": "0,10", "prompts": "128", "tokens": 32, "clients": "1,4", "requests": 4,
         "rounds": 1, "greedy_check": False}
WEIGHTS = ("int4", "int8")
MEASURED_BY = {
    "one_stream": "tools/harness/load.py (streamed /v1/completions, token-id prompt) for both",
    "serving": "tools/harness/load.py http_level (streamed /v1/chat/completions) for both",
    "llama_bench": "llama-bench -p 0 -n TOKENS -r 3 on one node: llama.cpp's own decode "
                   "figure, a reference in no ratio",
    "placement": "llama-server's load log (offloaded layers, each RPC device's buffer) against "
                 "the GGUF's tensor sizes for zctl's split",
}


@dataclass
class Llama:
    """llama.cpp for the run: its binaries, or why there are none, and its build."""

    binaries: LlamaBinaries | None
    failure: PeerFailure | None
    info: dict[str, Any]


def cmake_cache_options(binaries: Path) -> dict[str, str]:
    """The GGML_* options of the build a binaries directory came from (its CMakeCache.txt
    one level up), when there is one."""
    cache = binaries.parent / "CMakeCache.txt"
    options = {}
    if cache.is_file():
        for line in cache.read_text(errors="replace").splitlines():
            name, _, value = line.partition("=")
            key, _, kind = name.partition(":")
            if key.startswith(("GGML_AVX", "GGML_AMX", "GGML_NATIVE", "GGML_F16C", "GGML_FMA",
                               "GGML_BMI2", "GGML_SSE42", "GGML_RPC")) and kind == "BOOL":
                options[key] = value
    return options


def llama_cpp(given: Path | None, cache: Path, amx: str, sdist: Path | None) -> Llama:
    """The binaries given (checked: a bad directory is a usage error) or the pinned build
    for this CPU (a failed build is llama.cpp's failure in every case)."""
    flags = read_cpu_flags()
    plan = plan_build(choose_isa(flags, probe_amx(flags) if amx == "probe" else None),
                      toolchain=toolchain_versions())
    if given is not None:
        try:
            found = find_binaries(given.expanduser().resolve())
        except BinariesError as exc:
            fail(str(exc))
        return Llama(found, None, {"binaries": str(found.directory), "version": found.version,
                                   "given": True, "cmake_options": cmake_cache_options(
                                       found.directory), "build_for_this_cpu": plan.record()})
    err.print(f"llama.cpp {PIN.version}: building into {cache} on first use: "
              + " ".join(f"{k}={v}" for k, v in plan.options.items()))
    try:
        found = build(plan, cache, sdist=sdist)
    except (BuildFailure, SourceFailure) as exc:
        failure = PeerFailure(f"llama.cpp could not be built: {exc}",
                              exc.log_tail if isinstance(exc, BuildFailure) else "")
        err.print(f"[red]{failure}[/]\n{failure.log_tail}", highlight=False)
        return Llama(None, failure, {"build": plan.record(), "failure": failure.record()})
    return Llama(found, None, {"binaries": str(found.directory), "version": found.version,
                               "given": False, "build": plan.record()})


def check_values(values: list[str], allowed: tuple[str, ...], option: str) -> list[str]:
    if not values or any(v not in allowed for v in values):
        fail(f"{option} takes a comma-separated choice of {', '.join(allowed)}, got "
             f"{','.join(values)!r}")
    return values


def names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def llama_layout(gguf: GgufFile) -> GgufLayout:
    """The layers and tensor sizes of llama.cpp's GGUF; PeerFailure if it cannot be read
    (a damaged file is llama.cpp's failure, as one it could not load would be)."""
    try:
        return gguf_layout(gguf.path)
    except GgufFailure as exc:
        raise PeerFailure(f"llama.cpp's {gguf.kind} GGUF: {exc}") from None


class Run:
    """One benchmark run: its settings, llama.cpp, and the cases' results."""

    def __init__(self, plan: CasePlan, llama: Llama, cache: Path, sdist: Path | None) -> None:
        self.plan, self.llama, self.cache, self.sdist = plan, llama, cache, sdist
        self.ggufs: dict[tuple[str, str], GgufFile | PeerFailure] = {}
        self.records: list[dict[str, Any]] = []

    def result(self, head: dict[str, Any]) -> dict[str, Any]:
        """The output object: ``head``, the GGUFs, every case's record, ratios, targets
        (the greedy check's, from ``head["greedy"]``, first; those of the cases not
        measurable here last, unmet)."""
        ratios = {k: v for record in self.records for k, v in case_ratios(record).items()}
        return {**head, "ggufs": [{"model": m, "weights": w, **g.record()}
                                  for (m, w), g in self.ggufs.items() if isinstance(g, GgufFile)],
                "cases": self.records,
                "ratios": {key: rounded(value) for key, value in ratios.items()},
                "targets": {**greedy_targets(head["greedy"]),
                            **targets(self.records, ratios, self.plan.prompts),
                            **unmeasured_targets(head["not_measured"], self.plan.prompts)}}

    def tree(self) -> Path:
        return pinned_tree(self.cache / "src", PIN, self.sdist)

    def gguf(self, model: str, weights: str) -> GgufFile | PeerFailure:
        """The GGUF paired with zctl's ``weights`` of ``model`` (made once), or why not."""
        key = (model, weights)
        if key not in self.ggufs:
            if self.llama.binaries is None:
                self.ggufs[key] = self.llama.failure or PeerFailure("no llama.cpp binaries")
            else:
                bench = bench_model(model, self.cache.parent)
                try:
                    shipped = shipped_gguf(model)
                    tree = self.tree() if shipped is None or weights != "int4" else Path()
                    self.ggufs[key] = paired_gguf(bench.name, weights, bench.hf_dir, tree,
                                                  self.llama.binaries, self.cache, shipped)
                except (GgufFailure, SourceFailure) as exc:
                    self.ggufs[key] = PeerFailure(f"no GGUF for {model} {weights}: {exc}")
        return self.ggufs[key]

    def greedy(self, model: str) -> dict[str, Any]:
        """zctl fp32 (exact) against llama.cpp F32, greedy, one node: their agreement, or
        llama.cpp's failure with its log's tail."""
        from tools.peers.greedy import (
            GREEDY_TOKENS,
            LLAMA_EXACT,
            agreement,
            llama_greedy,
            zctl_greedy,
        )
        from tools.peers.measure import prompt_ids

        gguf = self.gguf(model, "fp32")
        if isinstance(gguf, PeerFailure):
            return gguf.record()
        export_dir = bench_model(model, self.cache.parent).export(1, "fp32")
        ids = prompt_ids(token_encoder(export_dir), 64, 0)
        nodes = case_nodes(1, "shared")
        logs = self.cache / "logs" / f"greedy-{model}"
        try:
            with llama_served(self.llama.binaries, gguf.path, llama_layout(gguf),
                              export_ranges(export_dir), nodes, 0.0, logs, LLAMA_EXACT) as llama:
                llama.prepare(1, 1024)
                theirs = llama_greedy(llama, ids, GREEDY_TOKENS)
        except PeerFailure as exc:
            err.print(f"[red]llama.cpp failed the greedy check of {model}:[/] {exc}",
                      highlight=False)
            return exc.record()
        return agreement(zctl_greedy(export_dir, ids, GREEDY_TOKENS), theirs)

    def case(self, case: Case) -> dict[str, Any]:
        """Run one case: both systems up, measured in turn; failures kept."""
        err.print(f"[bold]case {case.key}[/]")
        result = CaseResult(case)
        load_before = os.getloadavg()
        bench = bench_model(case.model, self.cache.parent)
        export_dir = bench.export(case.nodes, case.weights)
        ranges = export_ranges(export_dir)
        nodes = case_nodes(case.nodes, case.cpu_sets)
        result.placement[ZCTL] = [f"node {i} ({n.host}, cores {_cores(n)}): {share}"
                                  for i, (n, share) in enumerate(zip(nodes, describe(ranges),
                                                                     strict=True))]
        systems: list[Served] = []
        llama: LlamaServed | None = None
        with ExitStack() as stack:
            try:
                systems.append(stack.enter_context(zctl_served(
                    export_dir, nodes, case.cpu_sets, case.delay_ms, self.cache / "zctl-home")))
            except PeerFailure as exc:
                result.failures[ZCTL] = exc.record()
            gguf = self.gguf(case.model, case.weights)
            if isinstance(gguf, PeerFailure):
                result.failures[LLAMA] = gguf.record()
            else:
                logs = self.cache / "logs" / case.key.replace("/", "_")
                try:
                    llama = stack.enter_context(llama_served(
                        self.llama.binaries, gguf.path, llama_layout(gguf), ranges, nodes,
                        case.delay_ms, logs))
                    systems.append(llama)
                except PeerFailure as exc:
                    result.failures[LLAMA] = exc.record()
            run_case(result, systems, self.plan, token_encoder(export_dir))
            if llama is not None:
                result.placement[LLAMA] = llama.cluster.placement_lines
        record = result.record()
        record["gguf"] = None if isinstance(gguf, PeerFailure) else gguf.record()
        # the machine's 1-minute load average around the case (other work shares the cores)
        record["load_average"] = [round(load_before[0], 2), round(os.getloadavg()[0], 2)]
        if case.nodes == 1 and llama is not None and LLAMA not in result.failures:
            try:  # its own figure, for reference: the HTTP figures are the compared ones
                record["llama_bench"] = llama_bench(
                    self.llama.binaries, gguf.path, nodes[0], self.plan.tokens,
                    self.cache / "logs" / f"{case.key.replace('/', '_')}-llama-bench.log")
            except PeerFailure as exc:
                record["llama_bench"] = exc.record()
        self.records.append(record)
        return record


def _cores(node: Node) -> str:
    return ",".join(map(str, node.cpus)) if node.cpus else "all"


def main(
    as_json: Json = False,
    llama_cpp_dir: Annotated[Path | None, typer.Option(
        "--llama-cpp", help="a directory with llama-server, ggml-rpc-server, llama-bench and "
                            "llama-quantize (default: build the pinned release into "
                            "$ZCTL_HOME/peers on first use)")] = None,
    source: Annotated[Path | None, typer.Option(
        help="the pinned sdist, already downloaded (checked against its sha256)")] = None,
    amx: Annotated[str, typer.Option(
        help="AMX in llama.cpp's build: probe (on when the kernel grants this process AMX "
             "tiles and a tile program configured as ggml's runs, built by the default C++ "
             "compiler, with a header that keeps the tile configuration forced in where "
             "that compiler drops it), or off")] = "probe",
    quick: Annotated[bool, typer.Option(
        "--quick", help="a smoke run: SmolLM2 INT4, 1 and 2 nodes, 128-token prompt, 32 "
                        "tokens, 1 and 4 clients, one round (options given still apply)")] = False,
    models: Annotated[str | None, typer.Option(
        help=f"of {', '.join(MODELS)} (default: both; --quick: smollm2-135m)")] = None,
    weights: Annotated[str | None, typer.Option(
        help="int4 (against Q4_1 for SmolLM2, Q4_0 otherwise), int8 (against Q8_0) "
             "(default: both; --quick: int4)")] = None,
    topologies: Annotated[str | None, typer.Option(
        help=f"of {', '.join(TOPOLOGIES)} (split: a core each; shared: every core) "
             "(default: all; --quick: 1,2-split)")] = None,
    delays: Annotated[str | None, typer.Option(
        help="ms per hop, comma-separated (default: 0,10)")] = None,
    prompts: Annotated[str | None, typer.Option(
        help="one-stream prompt tokens (default: 128,1024; --quick: 128)")] = None,
    tokens: Annotated[int | None, typer.Option(
        help="one-stream new tokens (default: 128; --quick: 32)")] = None,
    clients: Annotated[str | None, typer.Option(
        help="serving levels (default: 1,4,8,16; --quick: 1,4)")] = None,
    requests: Annotated[int | None, typer.Option(
        help="requests per serving level (default 0: twice the clients, at least 8; "
             "--quick: 4)")] = None,
    rounds: Annotated[int | None, typer.Option(
        help="one-stream rounds per system (default: 3; --quick: 1)")] = None,
    serve_rounds: Annotated[int | None, typer.Option(
        help="rounds per serving level (default: 1)")] = None,
    out: Annotated[Path | None, typer.Option(
        help="also write the output object here after every case (a long run's figures so "
             "far)")] = None,
    greedy_check: Annotated[bool | None, typer.Option(
        "--greedy-check/--no-greedy-check",
        help="check greedy tokens at f32 against llama.cpp's F32 before speed (default: "
             "on; --quick: off)")] = None,
) -> None:
    given = {k: v for k, v in dict(
        models=models, weights=weights, topologies=topologies, delays=delays, prompts=prompts,
        tokens=tokens, clients=clients, requests=requests, rounds=rounds,
        serve_rounds=serve_rounds, greedy_check=greedy_check).items() if v is not None}
    settings = {**(QUICK if quick else FULL), **given}
    if amx not in AMX_POLICIES:
        fail(f"--amx takes {' or '.join(AMX_POLICIES)}, got {amx!r}")
    model_names = check_values(names(settings["models"]), MODELS, "--models")
    weight_names = check_values(names(settings["weights"]), WEIGHTS, "--weights")
    topology_names = check_values(names(settings["topologies"]), TOPOLOGIES, "--topologies")
    delay_values = parse_numbers(settings["delays"], "--delays", "delays in ms", float, 0)
    plan = CasePlan(prompts=tuple(parse_numbers(settings["prompts"], "--prompts", "tokens")),
                    tokens=settings["tokens"],
                    clients=tuple(parse_numbers(settings["clients"], "--clients", "clients")),
                    requests=settings["requests"], rounds=settings["rounds"],
                    serve_rounds=settings["serve_rounds"])
    if min(plan.tokens, plan.rounds, plan.serve_rounds) < 1 or plan.requests < 0:
        fail("--tokens, --rounds and --serve-rounds must be >= 1, --requests >= 0")
    cases, not_measured = case_matrix(model_names, weight_names, topology_names, delay_values,
                                      len(os.sched_getaffinity(0)))
    from zctl.paths import zctl_home

    cache = zctl_home() / "peers"
    llama = llama_cpp(llama_cpp_dir, cache, amx, source)
    run = Run(plan, llama, cache, source)
    from tools.peers.links import delay_check

    checks = [delay_check(d, cache / "logs") for d in sorted(set(delay_values)) if d > 0]
    greedy = {m: run.greedy(m) if settings["greedy_check"] else {"not_run": "--no-greedy-check"}
              for m in model_names}
    head = {"run": run_record(), "llama_cpp": llama.info, "settings": settings,
            "measured_by": MEASURED_BY, "delay_check": checks, "greedy": greedy,
            "not_measured": not_measured}
    for case in cases:
        run.case(case)
        if out is not None:  # the run so far, case by case: a long run leaves what it measured
            out.write_text(json.dumps(run.result(head)))
    print_result(run.result(head), as_json, render)


if __name__ == "__main__":
    typer.run(main)
