"""Experiment scenarios: a TOML file read into a checked ``Scenario``, and its grid of cells.

Pure functions, no processes. A scenario names the model, the cluster topologies (stage
counts and the shape of every hop's link) and the workloads to run on each; any value
given as a list is swept, and the grid is the product of every sweep. A file that does not
fit gets a ``ScenarioError`` whose text is one line naming the file, the table and the key.

    name = "latency"                      # optional (default: the file's stem)
    description = "..."

    [model]
    name = "smollm2-135m"                 # smollm2-135m, random-1b or an HF directory
    weights = "int8"
    exports = { 2 = "path/to/export" }    # optional: stage count -> an export directory
                                          # (relative to the file) instead of the cache

    [topology]
    stages = [2, 3]

    [link]                                # every hop (a list sweeps the value)
    delay_ms = [0, 50, 100]               # one-way latency per hop
    jitter_ms = 0                         # plus uniform 0..J ms per frame
    rate_mbit = 0                         # bandwidth cap (0: none)
    relay = false                         # through a store-and-forward relay
    relay_delay_ms = 0                    # the relay's own delay
    shaper = "ours"                       # who caps rate_mbit: our link layer, or the
                                          # kernel's tbf on veths between namespaces

    [[hop]]                               # optional: one hop differs (scalars only)
    index = 1                             # hop i: stage i to i+1; the last: the replies
    rate_mbit = 20

    [workload]
    decoding = ["plain", "lookup"]        # plain greedy, or prompt-lookup speculation
    k = [0, 3, 5]                         # lookup's draft length (0: adaptive K)
    streams = [1, 4]                      # concurrent generations
    payload = ["top1", "logits"]          # the last stage's reply: top1, topk, fp16 or logits
    tokens = 48
    repetitions = 1
    prompts = ["..."]                     # optional (default: rewrite prompts)
"""

from __future__ import annotations

import itertools
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DECODINGS = ("plain", "lookup")
# What the last stage sends back per answered position (zctl.engine.payloads): its top-1
# (token, logit) record (8 bytes; what greedy decoding asks for), or, for a request with
# logprobs, the top-k (token, log-probability) records (k x 8 bytes; what such a request
# gets by default), the full logits as float16 (vocab x 2 bytes) or as float32 (vocab x 4).
PAYLOADS = ("top1", "topk", "fp16", "logits")
MAX_K = 32  # zctl.engine.requests.MAX_DRAFT_TOKENS
# Adaptive K measures (drafts, probes) only while more than 16 tokens remain
# (zctl.engine.sessions.PROBE_EVERY): far fewer tokens than 48 would keep it at K = 0.
DEFAULT_TOKENS = 48
MAX_STREAMS = 64
MAX_STAGES = 8

JSON_OBJECT = ('{"name": "zctl", "host": "10.0.0.1", "port": 5550, "stages": 2, '
               '"weights": "int4", "nodes": ["pc1", "pc2", "pc3"], "curve": false}')
DEFAULT_PROMPTS = (  # rewrite prompts: the answer repeats the input, so lookup drafts hit
    f"Here is a JSON object:\n{JSON_OBJECT}\nRepeat it, with the port set to 8081.",
    f"Convert this JSON to YAML:\n{JSON_OBJECT}",
)

TOP_KEYS = {"name", "description", "model", "topology", "link", "hop", "workload"}
MODEL_KEYS = {"name", "weights", "exports"}
TOPOLOGY_KEYS = {"stages"}
HOP_KEYS = {"delay_ms", "jitter_ms", "rate_mbit", "relay", "relay_delay_ms", "index"}
LINK_KEYS = HOP_KEYS - {"index"} | {"shaper"}
# Who caps a link's bandwidth: our link layer (dataplane.wire.link), or the kernel's tbf qdisc on
# veth links between network namespaces (tools/wan/kernel_links.py; the link layer
# then adds only the delay and jitter).
SHAPERS = ("ours", "tbf")
WORKLOAD_KEYS = {"decoding", "k", "streams", "payload", "tokens", "repetitions", "prompts"}
LINK_LIMITS = {"delay_ms": 60_000.0, "jitter_ms": 60_000.0, "rate_mbit": 1e6,
               "relay_delay_ms": 60_000.0}


class ScenarioError(ValueError):
    """A scenario file that cannot be run; the text is one line saying where and why."""


@dataclass(frozen=True)
class Link:
    """One hop's emulated link."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    rate_mbit: float = 0.0  # 0: no cap
    relay: bool = False
    relay_delay_ms: float = 0.0
    shaper: str = "ours"  # SHAPERS

    @property
    def label(self) -> str:
        """Names the link's bandwidth, relay and shaper, e.g. ``relay-20mbit``,
        ``unlimited``, ``20mbit-tbf``."""
        rate = f"{self.rate_mbit:g}mbit" if self.rate_mbit else "unlimited"
        rate = f"relay-{rate}" if self.relay else rate
        return f"{rate}-tbf" if self.shaper == "tbf" else rate


@dataclass(frozen=True)
class Topology:
    """One cluster: ``stages`` stages (one per process) and the link of every hop."""

    stages: int
    link: Link  # the swept shape every hop has unless a [[hop]] says otherwise
    hops: tuple[Link, ...]  # hop i: stage i's frames to stage i+1; the last: the replies

    @property
    def uniform(self) -> bool:
        return len(set(self.hops)) == 1


@dataclass(frozen=True)
class Workload:
    """What is measured on a cluster: a decoding mode, K, stream count, reply payload."""

    decoding: str
    k: int | None  # lookup's draft length (0: adaptive); None for plain decoding
    streams: int
    payload: str

    @property
    def k_label(self) -> str:
        if self.k is None:
            return ""
        return "auto" if self.k == 0 else str(self.k)

    @property
    def config(self) -> str:
        """The decoding configuration's name: ``plain``, ``lookup-k3``, ``lookup-auto``."""
        if self.k is None:
            return "plain"
        return "lookup-auto" if self.k == 0 else f"lookup-k{self.k}"


@dataclass(frozen=True)
class Cell:
    topology: Topology
    workload: Workload


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    model: str
    weights: str
    exports: dict[int, Path]
    topologies: tuple[Topology, ...]
    workloads: tuple[Workload, ...]
    tokens: int
    repetitions: int
    prompts: tuple[str, ...]
    source: Path | None = field(default=None, compare=False)

    def cells(self) -> list[Cell]:
        """The grid: every workload on every topology, topology by topology."""
        return [Cell(t, w) for t in self.topologies for w in self.workloads]


# -- reading values ---------------------------------------------------------------------------


def _keys(table: Any, where: str, known: set[str]) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise ScenarioError(f"{where} must be a table, got {type(table).__name__}")
    extra = sorted(set(table) - known)
    if extra:
        raise ScenarioError(f"{where} has unknown key {extra[0]!r} (known: "
                            f"{', '.join(sorted(known))})")
    return table


def _number(value: Any, where: str, top: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
            value) or not 0 <= value <= top:
        raise ScenarioError(f"{where} must be a number in 0..{top:g}, got {value!r}")
    return float(value)


def _integer(value: Any, where: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ScenarioError(f"{where} must be an integer in {low}..{high}, got {value!r}")
    return value


def _flag(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ScenarioError(f"{where} must be true or false, got {value!r}")
    return value


def _choice(value: Any, where: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ScenarioError(f"{where} must be one of {', '.join(choices)}, got {value!r}")
    return str(value)


def _sweep(table: dict[str, Any], key: str, where: str, default: Any, read: Any) -> list[Any]:
    """The values of ``key`` (one, or a non-empty list without repeats), each read."""
    raw = table.get(key, default)
    raw = raw if isinstance(raw, list) else [raw]
    if not raw:
        raise ScenarioError(f"{where}.{key} is an empty list")
    values = [read(v, f"{where}.{key}") for v in raw]
    if len(set(values)) != len(values):
        raise ScenarioError(f"{where}.{key} lists a value twice: {raw!r}")
    return values


def _link_value(key: str, value: Any, where: str) -> Any:
    if key == "relay":
        return _flag(value, where)
    if key == "shaper":
        return _choice(value, where, SHAPERS)
    return _number(value, where, LINK_LIMITS[key])


# -- the tables -------------------------------------------------------------------------------


def _links(table: dict[str, Any]) -> list[Link]:
    _keys(table, "[link]", LINK_KEYS)
    sweeps = {key: _sweep(table, key, "[link]", Link.__dataclass_fields__[key].default,
                          lambda v, w, key=key: _link_value(key, v, w))
              for key in sorted(LINK_KEYS)}
    links = [Link(**dict(zip(sweeps, values, strict=True)))
             for values in itertools.product(*sweeps.values())]
    for link in links:
        if link.shaper == "tbf" and (link.relay or not link.rate_mbit):
            raise ScenarioError("[link] shaper = 'tbf' caps a bandwidth (rate_mbit > 0) and "
                                "has no relay (a relay exists only in our link layer)")
    return sorted(links, key=lambda lk: (lk.relay, lk.rate_mbit == 0, lk.rate_mbit,
                                         lk.delay_ms, lk.jitter_ms, lk.relay_delay_ms,
                                         lk.shaper))


def _hop_overrides(raw: Any, min_stages: int) -> dict[int, dict[str, Any]]:
    """[[hop]] entries: hop index -> the values that differ from [link]."""
    if not isinstance(raw, list):
        raise ScenarioError("hop must be an array of tables ([[hop]])")
    out: dict[int, dict[str, Any]] = {}
    for n, entry in enumerate(raw):
        where = f"[[hop]] #{n + 1}"
        _keys(entry, where, HOP_KEYS)
        if "index" not in entry:
            raise ScenarioError(f"{where} needs an index (hop i: stage i to i+1)")
        index = _integer(entry["index"], f"{where}.index", 0, min_stages - 1)
        if index in out:
            raise ScenarioError(f"{where} repeats hop {index}")
        out[index] = {key: _link_value(key, value, f"{where}.{key}")
                      for key, value in entry.items() if key != "index"}
    return out


def _topologies(data: dict[str, Any]) -> tuple[Topology, ...]:
    table = _keys(data.get("topology", {}), "[topology]", TOPOLOGY_KEYS)
    stages = _sweep(table, "stages", "[topology]", 2,
                    lambda v, w: _integer(v, w, 2, MAX_STAGES))
    links = _links(data.get("link", {}))
    overrides = _hop_overrides(data.get("hop", []), min(stages))
    if overrides and any(link.shaper == "tbf" for link in links):
        raise ScenarioError("[[hop]] cannot be used with shaper = 'tbf' (the kernel shapes "
                            "every hop alike)")
    out = []
    for count in sorted(stages):
        for link in links:
            hops = tuple(Link(**{**link.__dict__, **overrides.get(i, {})}) for i in range(count))
            out.append(Topology(count, link, hops))
    return tuple(out)


def _workloads(table: dict[str, Any]) -> tuple[Workload, ...]:
    where = "[workload]"
    decodings = _sweep(table, "decoding", where, "plain", lambda v, w: _choice(v, w, DECODINGS))
    ks = _sweep(table, "k", where, 0, lambda v, w: _integer(v, w, 0, MAX_K))
    if "k" in table and "lookup" not in decodings:
        raise ScenarioError(f"{where}.k is set but no decoding is 'lookup' (K is its draft "
                            "length)")
    streams = _sweep(table, "streams", where, 1, lambda v, w: _integer(v, w, 1, MAX_STREAMS))
    payloads = _sweep(table, "payload", where, "top1", lambda v, w: _choice(v, w, PAYLOADS))
    out = []
    for decoding in decodings:
        for k in ks if decoding == "lookup" else [None]:
            for n in sorted(streams):
                out.extend(Workload(decoding, k, n, p) for p in payloads)
    return tuple(out)


def _prompts(table: dict[str, Any]) -> tuple[str, ...]:
    raw = table.get("prompts", list(DEFAULT_PROMPTS))
    if not isinstance(raw, list) or not raw or not all(isinstance(p, str) and p for p in raw):
        raise ScenarioError("[workload].prompts must be a non-empty list of non-empty strings")
    return tuple(raw)


def _model(data: dict[str, Any], base: Path) -> tuple[str, str, dict[int, Path]]:
    table = _keys(data.get("model", {}), "[model]", MODEL_KEYS)
    name, weights = table.get("name", "smollm2-135m"), table.get("weights", "int8")
    if not isinstance(name, str) or not name:
        raise ScenarioError(f"[model].name must be a model name or directory, got {name!r}")
    weights = _choice(weights, "[model].weights", ("int4", "int8", "fp16", "fp32"))
    raw = table.get("exports", {})
    if not isinstance(raw, dict):
        raise ScenarioError("[model].exports must be a table of stage count = directory")
    exports = {}
    for key, value in raw.items():
        if not key.isdigit() or not isinstance(value, str):
            raise ScenarioError(f"[model].exports takes stage count = \"directory\", got "
                                f"{key!r} = {value!r}")
        exports[int(key)] = base / value
    return name, weights, exports


def parse_scenario(data: dict[str, Any], name: str, base: Path = Path(".")) -> Scenario:
    """The Scenario a parsed TOML document describes; ScenarioError (one line) if bad.
    ``name``: its name unless it gives one; ``base``: where relative paths start."""
    _keys(data, "the scenario", TOP_KEYS)
    model, weights, exports = _model(data, base)
    workload = _keys(data.get("workload", {}), "[workload]", WORKLOAD_KEYS)
    topologies = _topologies(data)
    missing = sorted({t.stages for t in topologies} - set(exports)) if exports else []
    if missing:
        raise ScenarioError(f"[model].exports has no export for {missing[0]} stages")
    title = data.get("name", name)
    description = data.get("description", "")
    if not isinstance(title, str) or not title or not isinstance(description, str):
        raise ScenarioError("name and description must be strings (name non-empty)")
    return Scenario(
        name=title, description=description, model=model, weights=weights, exports=exports,
        topologies=topologies, workloads=_workloads(workload),
        tokens=_integer(workload.get("tokens", DEFAULT_TOKENS), "[workload].tokens", 2, 4096),
        repetitions=_integer(workload.get("repetitions", 1), "[workload].repetitions", 1, 100),
        prompts=_prompts(workload))


def load_scenario(path: Path) -> Scenario:
    """Read and check a scenario file; ScenarioError (one line, naming the file) if bad."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"{path}: not valid TOML: {exc}") from None
    try:
        scenario = parse_scenario(data, path.stem, path.parent)
    except ScenarioError as exc:
        raise ScenarioError(f"{path}: {exc}") from None
    return Scenario(**{**scenario.__dict__, "source": path})
