"""What tools.robustness.soak watches while it runs: the resident memory of every process of the
cluster (each root pid and every process under it, by psutil), the generation
service's running and waiting requests and KV slots, and the HTTP API's requests in
flight; and the figures made from those samples (resident memory after warm-up, at the
end, its maximum and growth; the idle state the cluster returns to)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import psutil
from prometheus_client.parser import text_string_to_metric_families

# -- resident memory, by psutil -----------------------------------------------------------


def read_rss_kb(pid: int) -> int | None:
    """The process's resident memory in kB now (None: it is gone, or has none, as a
    zombie)."""
    try:
        rss = psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return None
    return rss // 1024 if rss else None


def process_tree(roots: Mapping[str, int]) -> dict[int, str]:
    """Every process of ``roots`` (name -> pid) and all their descendants, pid -> name; a
    descendant is named after its root and its command (``node1/python3``)."""
    named: dict[int, str] = {}
    for root_name, root in roots.items():
        named[root] = root_name
        try:
            descendants = psutil.Process(root).children(recursive=True)
        except psutil.Error:  # the root is gone
            continue
        for child in descendants:
            if child.pid not in named:
                try:
                    command = child.name()
                except psutil.Error:
                    command = "?"
                named[child.pid] = f"{root_name}/{command}"
    return named


# -- figures from the samples ----------------------------------------------------------------


def growth_pct(before: float, after: float) -> float:
    """How much ``after`` exceeds ``before``, in % of ``before`` (negative: it shrank)."""
    if before <= 0:
        raise ValueError(f"growth from {before} is undefined")
    return round(100.0 * (after - before) / before, 2)


@dataclass
class RssSeries:
    """One process's resident memory samples: (seconds since the soak started, kB)."""

    name: str
    pid: int
    samples: list[tuple[float, int]] = field(default_factory=list)

    def figures(self, warm_s: float, end_s: float) -> dict[str, Any] | None:
        """RSS at the end of warm-up (the first sample at or after ``warm_s``), at the end
        of the load (the last sample at or before ``end_s``), the largest sample, and the
        growth from the first to the second (MB, %); the growth over the second half of
        that window (a leak grows in both halves, a pool that settles does not), and the
        last sample of each minute (MB). None: no sample after warm-up (a process that
        started late, or ended early)."""
        during = [(t, kb) for t, kb in self.samples if warm_s <= t <= end_s]
        if not during:
            return None
        warm, end = during[0][1], during[-1][1]
        middle = next(kb for t, kb in during if t >= (warm_s + during[-1][0]) / 2)
        minutes: dict[int, int] = {}
        for t, kb in self.samples:
            minutes[int(t // 60)] = kb
        return {"name": self.name, "pid": self.pid, "rss_warm_mb": round(warm / 1024, 1),
                "rss_end_mb": round(end / 1024, 1),
                "rss_max_mb": round(max(kb for _, kb in self.samples) / 1024, 1),
                "growth_pct": growth_pct(warm, end),
                "growth_second_half_pct": growth_pct(middle, end), "samples": len(self.samples),
                "rss_by_minute_mb": [round(kb / 1024, 1) for _, kb in sorted(minutes.items())]}


def metric_value(text: str, name: str) -> float | None:
    """The first sample of metric ``name`` (any labels) in a Prometheus text, or None."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return None


# -- the sampler -----------------------------------------------------------------------------


@dataclass
class ServiceSample:
    """The generation service and the API at one moment."""

    t: float
    running: int
    waiting: int
    kv_slots: list[int]  # per stage (-1: unknown)
    prefix_cached_tokens: int
    api_in_flight: int | None  # None: the API does not export it, or did not answer


def service_sample(serve: str, api_url: str, t: float) -> ServiceSample:
    """One look at the generation service (ServiceStats) and the API's /metrics."""
    import httpx

    from zctl.service.client import query_service_stats

    stats = query_service_stats(serve, timeout=5.0)
    in_flight = None
    try:
        text = httpx.get(f"{api_url}/metrics", timeout=5.0).text
        value = metric_value(text, "zctl_api_requests_in_flight")
        in_flight = None if value is None else int(value)
    except httpx.HTTPError:
        pass
    return ServiceSample(t, stats.running, stats.waiting, [s.kv_slots for s in stats.stages],
                         stats.counters.get("prefix_cached_tokens", 0), in_flight)


class Sampler:
    """A thread sampling every process under ``roots`` and the service every
    ``every_s`` seconds until stopped; ``clock`` gives the seconds since the soak began."""

    def __init__(self, roots: Mapping[str, int], serve: str, api_url: str, every_s: float,
                 clock: Callable[[], float]) -> None:
        self.roots, self.serve, self.api_url = dict(roots), serve, api_url
        self.every_s, self.clock = every_s, clock
        self.rss: dict[int, RssSeries] = {}
        self.service: list[ServiceSample] = []
        self.problems: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def sample_once(self) -> None:
        now = self.clock()
        for pid, name in process_tree(self.roots).items():
            kb = read_rss_kb(pid)
            if kb is not None:
                self.rss.setdefault(pid, RssSeries(name, pid)).samples.append((now, kb))
        try:
            self.service.append(service_sample(self.serve, self.api_url, now))
        except Exception as exc:  # noqa: BLE001 - a missed look is reported, not fatal
            self.problems.append(f"{now:.0f} s: {type(exc).__name__}: {exc}")

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.sample_once()
            self._stop.wait(max(0.0, self.every_s - (time.monotonic() - started)))

    def processes(self, warm_s: float, end_s: float) -> list[dict[str, Any]]:
        """Every sampled process's figures (see RssSeries.figures), roots first."""
        order = {pid: i for i, pid in enumerate(self.roots.values())}
        rows = [s.figures(warm_s, end_s) for s in self.rss.values()]
        return sorted((r for r in rows if r is not None),
                      key=lambda r: (order.get(r["pid"], len(order)), r["name"], r["pid"]))

    def peaks(self) -> dict[str, int]:
        """The most requests running, waiting (in the engine) and in flight (in the API)
        seen in any sample."""
        s = self.service
        return {"running": max((x.running for x in s), default=0),
                "waiting": max((x.waiting for x in s), default=0),
                "api_in_flight": max((x.api_in_flight or 0 for x in s), default=0)}
