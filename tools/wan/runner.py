"""Run a scenario's grid on local clusters: one cluster per topology, every workload on it.

Each topology gets a fresh local cluster (``zctl.launcher.local.start_local_cluster``)
whose every process shapes what it sends (``links``: hop i is stage i's frames to the next
stage, the last hop the replies to the coordinator; a relayed hop passes one
store-and-forward relay, see ``dataplane.wire.link``); a ``shaper = "tbf"`` topology's nodes
run in network namespaces whose veths the kernel's tbf caps (kernel_links.py), the link
layer adding only the delay. Healing is off: a node that a slow link makes late to its
heartbeats is waited for, never replaced by its neighbour, so every cell measures the
topology it names. After warm-up requests, the
repetitions run in turn, each stepping through every workload, so drift spreads over all
cells alike. One measurement sends ``streams`` requests at once through the generation
service (stream j of repetition r gets prompt (j + r) mod len(prompts)), EOS ignored, and
takes the aggregate decode throughput: the tokens after each stream's first over the time
from the first answer to the last one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from dataplane.runtime.config import RuntimeSpec
from tools.wan.analysis import cell_parameters, summarise_samples
from tools.wan.scenario import Cell, Link, Scenario, Topology, Workload
from zctl.engine.requests import DEFAULT_MAX_STREAMS
from zctl.launcher.processes import LinkShape

if TYPE_CHECKING:
    from zctl.launcher.local import LocalNetwork


class Reporter(Protocol):
    """Where a run says how far it got (a progress bar, or nothing)."""

    def cluster(self, text: str) -> None: ...  # a topology's cluster is starting

    def sample(self, text: str) -> None: ...  # one measurement is done

    def cluster_done(self) -> None: ...  # the topology's every measurement is done


@dataclass(frozen=True)
class RunSettings:
    """How the clusters run: the stages' runtime, where their state and logs go, and the
    seconds to wait for one to serve."""

    runtime: RuntimeSpec
    root: Path
    start_timeout_s: float = 300.0
    first_answer_timeout_s: float = 300.0


def link_shape_of(link: Link) -> LinkShape:
    """The product's link shape for a scenario's link (a relay: one store-and-forward hop;
    where tbf caps the rate, the link layer adds only the delay and jitter)."""
    rate = 0.0 if link.shaper == "tbf" else link.rate_mbit
    return LinkShape(link.delay_ms, link.jitter_ms, rate, 1 if link.relay else 0,
                     link.relay_delay_ms)


# The logprobs a request asks for in the cells whose payload is not top-1: the top-k
# payload then carries this many records per position.
CELL_TOP_LOGPROBS = 5
PAYLOAD_POLICY = {"topk": "auto", "fp16": "fp16", "logits": "fp32"}


def request_fields(work: Workload) -> dict[str, Any]:
    """The GenerationRequest fields of a workload: lookup speculation with its K; greedy
    decoding asks for the top-1 only, so the other payloads are asked through logprobs
    (the same request in each: only what the last stage sends differs)."""
    fields: dict[str, Any] = {}
    if work.decoding == "lookup":
        fields.update(speculative="lookup", k=work.k or 0)
    if work.payload != "top1":
        fields.update(logprobs=True, top_logprobs=CELL_TOP_LOGPROBS,
                      logits_payload=PAYLOAD_POLICY[work.payload])
    return fields


def stream_prompts(prompts: Sequence[str], streams: int, repetition: int) -> list[str]:
    return [prompts[(j + repetition) % len(prompts)] for j in range(streams)]


def _p50(timing: dict[str, dict[str, float]], name: str) -> float | None:
    value = timing.get(name, {}).get("p50")
    return None if value is None else float(value)


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def measure(serve: str, work: Workload, prompts: Sequence[str], tokens: int,
            first_timeout_s: float) -> dict[str, Any]:
    """One measurement of a workload (see the module's text): its sample's figures."""
    from tools.harness.service import bench_request, generate_together

    requests = [bench_request(p, tokens, **request_fields(work)) for p in prompts]
    started = time.monotonic()
    done, span = generate_together(serve, requests, first_timeout=first_timeout_s)
    after_first = sum(max(0, len(d.tokens) - 1) for d in done)
    return {"tok_s": after_first / span if span > 0 else None,
            "per_stream_tok_s": _mean([d.tok_s for d in done]),
            "k_mean": _mean([d.spec.get("k_mean") for d in done]),
            "acceptance": _mean([d.spec.get("acceptance") for d in done]),
            "tokens_per_step": _mean([d.spec.get("tokens_per_step") for d in done]),
            "step_ms": _mean([_p50(d.timing, "total") for d in done]),
            "network_ms": _mean([_p50(d.timing, "network") for d in done]),
            "ttft_ms": _mean([d.ttft_ms for d in done]),
            "seconds": time.monotonic() - started}


WARM_UP_TOKENS = 16


def warm_up(serve: str, scenario: Scenario, streams: int, first_timeout_s: float) -> None:
    """Requests before the first measurement, so that it pays no first-use costs (kernels
    compiled for new shapes, memory first touched): one stream, then ``streams`` at once."""
    plain = Workload("plain", None, 1, "top1")
    measure(serve, plain, scenario.prompts[:1], WARM_UP_TOKENS, first_timeout_s)
    if streams > 1:
        measure(serve, Workload("plain", None, streams, "top1"),
                stream_prompts(scenario.prompts, streams, 0), 4, first_timeout_s)


def run_topology(scenario: Scenario, topology: Topology, export_dir: Path,
                 settings: RunSettings, report: Reporter) -> dict[Workload, list[dict[str, Any]]]:
    """Start the topology's cluster, measure every workload ``repetitions`` times, stop it.
    A failed measurement is kept as a sample with its error; a cluster that does not start
    (or whose kernel links cannot be made) fails every workload with that error."""
    if topology.link.shaper != "tbf":
        return measure_topology(scenario, topology, export_dir, settings, report)
    from tools.wan.kernel_links import KernelLinks, KernelLinksUnavailable

    try:
        with KernelLinks(topology.stages, topology.link.rate_mbit) as net:
            return measure_topology(scenario, topology, export_dir, settings, report, net,
                                    net.shape)
    except KernelLinksUnavailable as exc:
        return {w: [{"error": f"kernel links: {exc}"}] for w in scenario.workloads}


def measure_topology(scenario: Scenario, topology: Topology, export_dir: Path,
                     settings: RunSettings, report: Reporter, network: LocalNetwork | None = None,
                     serving: Callable[[], None] | None = None
                     ) -> dict[Workload, list[dict[str, Any]]]:
    """``run_topology`` on a network made for it (None: 127.0.0.x); ``serving`` is called
    once the cluster serves, before the warm-up (kernel links are capped then)."""
    from zctl.launcher.local import start_local_cluster, stop_processes, wait_serving
    from zctl.launcher.record import ClusterError

    samples: dict[Workload, list[dict[str, Any]]] = {w: [] for w in scenario.workloads}
    streams = max(w.streams for w in scenario.workloads)
    try:
        record = start_local_cluster(
            export_dir, topology.stages, settings.runtime,
            settings.root / f"cluster-{topology.stages}", max_streams=max(DEFAULT_MAX_STREAMS, streams),
            links=[link_shape_of(h) for h in topology.hops], network=network,
            heal_after=None)  # a node a slow link makes late stays: its cells measure the link
    except ClusterError as exc:
        return {w: [{"error": f"cluster: {exc}"}] for w in samples}
    try:
        wait_serving(record, settings.start_timeout_s)
        if serving is not None:
            serving()
        warm_up(record.serve, scenario, streams, settings.first_answer_timeout_s)
        for rep in range(scenario.repetitions):
            for work in scenario.workloads:
                prompts = stream_prompts(scenario.prompts, work.streams, rep)
                try:
                    sample = measure(record.serve, work, prompts, scenario.tokens,
                                     settings.first_answer_timeout_s)
                except Exception as exc:  # a cell's failure is a result, not the run's end
                    sample = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                samples[work].append(sample)
                report.sample(f"{topology.stages} stages, {topology.link.delay_ms:g} ms, "
                          f"{topology.link.label}: {work.config} x{work.streams} {work.payload}")
    except Exception as exc:
        for got in samples.values():
            if len(got) < scenario.repetitions:
                got.append({"error": f"cluster: {type(exc).__name__}: {exc}"[:300]})
    finally:
        stop_processes(record.pids)
    return samples


def run_scenario(scenario: Scenario, exports: dict[int, Path], settings: RunSettings,
                 record: dict[str, Any], report: Reporter) -> list[dict[str, Any]]:
    """Every cell of the scenario, measured: one row per cell (analysis.COLUMNS)."""
    rows = []
    for topology in scenario.topologies:
        report.cluster(f"{topology.stages} stages, {topology.link.delay_ms:g} ms per hop, "
                   f"{topology.link.label}")
        samples = run_topology(scenario, topology, exports[topology.stages], settings, report)
        report.cluster_done()
        for work in scenario.workloads:
            cell = Cell(topology, work)
            rows.append({**cell_parameters(scenario.name, cell, scenario.tokens,
                                           scenario.repetitions),
                         **summarise_samples(samples[work]),
                         "date": record["date"], "cpu": record["cpu"],
                         "commit": record["commit"]})
    return rows
