"""``zctl doctor``'s verdicts: small pure functions from gathered facts to pass/warn/fail lines.

Nothing here opens a socket or a file or asks OpenVINO: ``zctl.doctor.probes`` gathers
the facts (the status round trip, TCP connects, hashes, CPU flags, memory needs) and
``zctl.doctor.checks`` runs both and prints one line per ``Check``, so every verdict can be
tested without a cluster.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

from controlplane.placement import fmt_bytes, layer_range
from controlplane.records import ClusterStatus, NodeStatus
from zctl.discovery.interfaces import Interface
from zctl.discovery.records import JOIN_BY_ADDRESS, Announcement

PASS, WARN, FAIL = "pass", "warn", "fail"
STATUSES = (PASS, WARN, FAIL)


@dataclass(frozen=True)
class Check:
    """One line of ``zctl doctor``: what was checked, its verdict, and what was found."""

    name: str
    status: str
    detail: str

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"a check's status is one of {STATUSES}, not {self.status!r}")

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def all_ok(checks: Iterable[Check]) -> bool:
    """No check failed (warnings are allowed)."""
    return all(c.status != FAIL for c in checks)


# -- this machine ------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceFacts:
    """One OpenVINO device as this machine's plugin describes it ("" / () when it will not)."""

    name: str
    full_name: str = ""
    capabilities: tuple[str, ...] = ()
    memory_bytes: int | None = None
    error: str = ""


NUMERICS_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16",
                  "amx_int8")


def versions_here_check(openvino: str, zctl: str, protocol: int) -> Check:
    detail = f"OpenVINO {openvino}, zctl {zctl}, control protocol {protocol}"
    if zctl == "unknown":
        return Check("versions here", WARN, detail + ": zctl is not installed as a package "
                     "(its version cannot be compared with the other nodes')")
    return Check("versions here", PASS, detail)


def device_checks(devices: Sequence[DeviceFacts], error: str = "") -> list[Check]:
    """One line per OpenVINO device; a fail when OpenVINO lists none (or cannot list)."""
    if error or not devices:
        return [Check("devices", FAIL, f"OpenVINO lists no device here: {error or 'none found'}")]
    out = []
    for dev in devices:
        if dev.error:
            out.append(Check(f"device {dev.name}", WARN, f"listed, but its properties cannot "
                             f"be read: {dev.error}"))
            continue
        parts = [dev.full_name or "(no name)",
                 f"capabilities {', '.join(dev.capabilities) or 'not reported'}"]
        if dev.memory_bytes:
            parts.append(f"memory {fmt_bytes(dev.memory_bytes)}")
        out.append(Check(f"device {dev.name}", PASS, "; ".join(parts)))
    return out


def cpu_features_check(flags: Iterable[str] | None, capabilities: Sequence[str] = (),
                       source: str = "/proc/cpuinfo") -> Check:
    """The CPU features that change numerics: int8/int4 matmuls (dynamic quantization)
    take VNNI or AMX kernels where the CPU has them, so fast-numerics tokens can differ
    between machines of different kinds."""
    ov = ("; OpenVINO's CPU reports BF16, so its own default precision here is bf16 (zctl "
          "compiles f32 unless told --precision default)" if "BF16" in capabilities else "")
    if flags is None:
        return Check("cpu features", WARN, f"cannot read the CPU flags from {source}: which "
                     "int8 kernels (VNNI, AMX) run here is unknown" + ov)
    have = set(flags)
    found = [f for f in NUMERICS_FLAGS if f in have]
    kind = ("AMX" if "amx_int8" in have or "amx_tile" in have else
            "AVX-512-VNNI" if "avx512_vnni" in have else
            "AVX-VNNI" if "avx_vnni" in have else "no VNNI")
    detail = (f"{', '.join(found) or 'none of ' + ', '.join(NUMERICS_FLAGS)}: int8/int4 "
              f"matmuls take {kind} kernels here; int8/int4 numerics differ between VNNI/AMX "
              "and non-VNNI CPUs, so token-identical output across machines of different "
              "kinds is not guaranteed" + ov)
    if "avx2" not in have:
        return Check("cpu features", WARN, detail + "; without AVX2 OpenVINO's CPU kernels "
                     "are slow")
    return Check("cpu features", PASS, detail)


@dataclass(frozen=True)
class IntegrityFacts:
    """What re-hashing one export or one node's shard cache found."""

    kind: str  # "export" or "shard cache"
    label: str  # its name, e.g. smollm2-135m-int4-2stages or node1
    path: str
    checked: int  # files hashed
    problems: tuple[str, ...] = ()  # each names its file: "stage1.bin: sha256 ... but ..."
    shards: int = 0  # for a shard cache: shards in it


def integrity_check(facts: IntegrityFacts) -> Check:
    """A fail naming every damaged or missing file; else how many files matched."""
    name = f"{facts.kind} {facts.label}"
    if facts.problems:
        shown = "; ".join(facts.problems[:8])
        more = f"; and {len(facts.problems) - 8} more" if len(facts.problems) > 8 else ""
        return Check(name, FAIL, f"{facts.path}: {len(facts.problems)} problem(s): {shown}{more}")
    if facts.checked == 0:
        return Check(name, WARN, f"{facts.path}: no files to check")
    held = f"{facts.shards} shard(s), " if facts.kind == "shard cache" else ""
    return Check(name, PASS, f"{facts.path}: {held}{facts.checked} files, every sha256 matches "
                             "its manifest")


@dataclass(frozen=True)
class MemoryNeed:
    """What a stage placed on this machine needs: ``bytes`` in all (weights with the
    runtime's overhead plus the KV reserve), ``held`` of them already loaded by the process
    serving it here (0 when it does not run yet)."""

    label: str
    bytes: int
    held: int = 0


TIGHT = 0.8  # a need above this share of the available memory leaves too little headroom


def memory_check(available: int, total: int, needs: Sequence[MemoryNeed],
                 without: str = "no stage is assigned to this machine") -> Check:
    """Free memory against what the stages here still need to load."""
    have = f"{fmt_bytes(available)} available of {fmt_bytes(total)}"
    if not needs:
        return Check("memory", PASS, f"{have}; {without}: nothing to compare")
    more = sum(max(0, n.bytes - n.held) for n in needs)
    what = "; ".join(f"{n.label} needs {fmt_bytes(n.bytes)}"
                     + (f" ({fmt_bytes(n.held)} of it loaded)" if n.held else "") for n in needs)
    if any(n.held for n in needs):
        what += f"; {fmt_bytes(more)} still to load"
    if more > available:
        return Check("memory", FAIL, f"{what}: does not fit in the {have}")
    if more > TIGHT * available:
        return Check("memory", WARN, f"{what}: leaves {fmt_bytes(available - more)} of the "
                                     f"{have} (tight)")
    return Check("memory", PASS, f"{what}: fits in the {have}")


@dataclass(frozen=True)
class HttpFacts:
    """One GET: the HTTP status and the start of the body, or why there was none
    (``refused``: nothing listens there)."""

    status: int | None = None
    body: str = ""
    error: str = ""
    refused: bool = False
    untrusted: bool = False  # HTTPS whose certificate this machine does not trust


def api_check(url: str, facts: HttpFacts, explicit: bool) -> Check:
    """GET URL/health: 200 passes (warns if its certificate is not trusted here), 503 (up,
    not ready) warns, any other answer fails; nothing listening warns unless the user named
    the URL."""
    where = f"GET {url.rstrip('/')}/health"
    body = " ".join(facts.body.split())[:160]
    if facts.status == 200 and facts.untrusted:
        return Check("api", WARN, f"{where}: 200, but its TLS certificate is not trusted here "
                     f"({facts.error or 'unverified'}): clients need it (SSL_CERT_FILE) or a "
                     "certificate from a CA they trust")
    if facts.status == 200:
        return Check("api", PASS, f"{where}: 200 {body}".rstrip())
    if facts.status is not None:
        verdict = WARN if facts.status == 503 else FAIL
        return Check("api", verdict, f"{where}: {facts.status} {body or '(no body)'}")
    if facts.refused and not explicit:
        return Check("api", WARN, f"no API server at {url} (zctl serve starts one)")
    return Check("api", FAIL if explicit else WARN, f"{where}: {facts.error}")


@dataclass(frozen=True)
class GrammarFacts:
    """Whether llguidance compiles a grammar against an export's tokenizer here (the
    coordinator's engine does, for structured output), and how long making it took."""

    label: str
    vocab: int = 0
    build_ms: float = 0.0
    error: str = ""


def grammar_check(facts: GrammarFacts) -> Check:
    """Compiled: pass; else warn (only requests that ask for a structured output fail)."""
    if facts.error:
        return Check("structured output", WARN, f"{facts.label}: {facts.error}: requests with "
                     "response_format or a grammar would be refused here")
    return Check("structured output", PASS, f"{facts.label}: llguidance compiles against its "
                 f"tokenizer ({facts.vocab:,} tokens) in {facts.build_ms:.0f} ms")


# -- the cluster ---------------------------------------------------------------------------
@dataclass(frozen=True)
class TcpFacts:
    """A TCP connect from here: whether it was accepted, in how long, or the error."""

    ok: bool
    ms: float = 0.0
    error: str = ""

    def describe(self) -> str:
        return f"ok in {self.ms:.1f} ms" if self.ok else f"failed ({self.error})"


def skipped_cluster_check(reason: str) -> Check:
    return Check("cluster", WARN, f"{reason}: the control port, clock, pipeline, node "
                                  "versions, heartbeats and data pipes were not checked")


def control_check(endpoint: str, rtt_s: float | None, error: str = "",
                  tcp: TcpFacts | None = None, curve: bool = False) -> Check:
    """The status round trip from here to the coordinator's control port."""
    if rtt_s is not None:
        return Check("control port", PASS, f"{endpoint}: status round trip "
                                           f"{rtt_s * 1000:.1f} ms")
    if tcp is None:
        return Check("control port", FAIL, f"{endpoint}: {error}")
    if not tcp.ok:
        return Check("control port", FAIL, f"{endpoint}: nothing accepts a TCP connection "
                                           f"({tcp.error}); {error}")
    hint = "" if curve else " (a --curve cluster needs --curve-server-key and --curve-keys)"
    return Check("control port", FAIL, f"{endpoint}: TCP connects, but {error}{hint}")


def clock_check(sent: float, coordinator_time: float, received: float, warn_s: float = 0.5,
                fail_s: float = 30.0, note: str = "") -> Check:
    """NTP-style: offset = t_coordinator - (t_sent + t_received) / 2, +- half the round trip.
    Above ``warn_s`` per-stage timings across machines mislead; above ``fail_s`` so do logs."""
    if coordinator_time <= 0:
        return Check("clock offset", WARN, "the coordinator does not report its clock (a zctl "
                                           "older than this one)")
    rtt = max(0.0, received - sent)
    offset = coordinator_time - (sent + received) / 2
    detail = (f"coordinator {'ahead' if offset >= 0 else 'behind'} by {abs(offset) * 1000:.1f} "
              f"ms +- {rtt * 500:.1f} ms (round trip {rtt * 1000:.1f} ms)" + note)
    if abs(offset) > fail_s:
        return Check("clock offset", FAIL, detail + f": over {fail_s:g} s, timings and logs "
                                                    "across machines are wrong; sync the clocks "
                                                    "(NTP)")
    if abs(offset) > warn_s:
        return Check("clock offset", WARN, detail + f": over {warn_s:g} s, per-stage timings "
                                                    "across machines mislead; sync the clocks")
    return Check("clock offset", PASS, detail)


def _versions(openvino: str, zctl: str) -> str:
    return f"OpenVINO {openvino}, zctl {zctl}"


def version_checks(status: ClusterStatus, openvino: str, zctl: str, protocol: int) -> list[Check]:
    """This machine against the coordinator (a difference warns: this machine could not
    join as a node), then every enrolled node against the coordinator (one that differs
    fails, naming both)."""
    coord = _versions(status.openvino, status.zctl) + f", protocol {status.protocol}"
    here = (openvino, zctl, protocol) == (status.openvino, status.zctl, status.protocol)
    out = [Check("versions coordinator", PASS if here else WARN,
                 f"{coord}: as here" if here else
                 f"{coord}, but this machine runs {_versions(openvino, zctl)}, protocol "
                 f"{protocol}: it could not join this cluster as a node")]
    remote = [n for n in status.nodes if not n.local]
    differ = [n for n in remote if (n.openvino, n.zctl) != (status.openvino, status.zctl)]
    for n in differ:
        out.append(Check(f"versions {n.node_id}", FAIL,
                         f"{n.host} runs {_versions(n.openvino, n.zctl)} but the coordinator "
                         f"{_versions(status.openvino, status.zctl)}; run one release on every "
                         "node"))
    same = len(remote) - len(differ)
    if same:
        out.append(Check("versions nodes", PASS,
                         f"{same} of {len(remote)} enrolled node(s) run the coordinator's "
                         f"versions (and its protocol {status.protocol}: it admits no other)"))
    elif not remote:
        out.append(Check("versions nodes", PASS if len(status.stages) <= 1 else WARN,
                         "no node is enrolled besides the coordinator"))
    return out


VERSION_REFUSALS = ("openvino-version", "protocol-version")


def refusal_checks(status: ClusterStatus) -> list[Check]:
    """The coordinator's latest refusal of each node that is not enrolled now: a version
    refusal fails (that machine cannot join until it is upgraded), any other warns."""
    enrolled = {n.node_id for n in status.nodes if n.state not in ("dead", "left")}
    latest = {r.node_id: r for r in sorted(status.refused, key=lambda r: -r.age_s)}
    out = []
    for node_id, r in latest.items():
        if node_id in enrolled:
            continue
        verdict = FAIL if r.code in VERSION_REFUSALS else WARN
        out.append(Check(f"refused {node_id}", verdict,
                         f"{r.host} refused {r.age_s:.0f} s ago"
                         + (f" ({r.code})" if r.code else "") + f": {r.reason}"))
    return out


DOWN = ("dead", "left", "failed")


def pipeline_check(status: ClusterStatus) -> Check:
    rt = status.runtime
    what = (f"{status.model} on {len(status.stages)} stage(s), epoch {status.epoch}, "
            f"{rt.device}, {'exact' if rt.exact else 'fast'} numerics"
            + (", CURVE" if status.curve else ""))
    if status.pipeline == "serving":
        return Check("pipeline", PASS, f"serving {what}")
    if status.plan_error:
        return Check("pipeline", FAIL, f"{status.pipeline}: placement failed: {status.plan_error}")
    down = [s for s in status.stages if s.state in DOWN]
    if status.pipeline in ("degraded", "failed") or down:
        names = ", ".join(f"stage {s.index} (layers {layer_range(s.layer_start, s.layer_end)}) "
                          f"on {s.node_id} is {s.state}" for s in down)
        return Check("pipeline", FAIL, f"{status.pipeline}: {names or what}")
    return Check("pipeline", WARN, f"{status.pipeline} (not serving yet): {what}")


def heartbeat_checks(status: ClusterStatus) -> list[Check]:
    """The coordinator's view of each remote node: when it last heard from it (the
    node->coordinator direction) and last sent to it (coordinator->node)."""
    interval = status.heartbeat_interval or 1.0
    liveness = status.liveness or 3
    assumed = "" if status.heartbeat_interval else " (assumed: the coordinator does not say)"
    pace = f"heartbeat every {interval:g} s, dead after {liveness} missed{assumed}"
    out = []
    for n in (n for n in status.nodes if not n.local):
        sent = (f"last sent {n.last_sent_s:.1f} s ago" if n.last_sent_s is not None
                else "sending not reported")
        seen = f"node->coordinator: last heard {n.last_seen_s:.1f} s ago"
        detail = f"{n.host}: {seen}; coordinator->node: {sent} ({pace})"
        if n.state == "dead":
            out.append(Check(f"heartbeats {n.node_id}", FAIL, f"marked dead; {detail}"))
        elif n.state == "left":
            out.append(Check(f"heartbeats {n.node_id}", WARN, f"left the cluster; {detail}"))
        elif n.last_seen_s > 2 * interval:
            out.append(Check(f"heartbeats {n.node_id}", WARN, f"late; {detail}"))
        else:
            out.append(Check(f"heartbeats {n.node_id}", PASS, detail))
    return out


def data_pipe_checks(status: ClusterStatus, connects: Mapping[str, TcpFacts],
                     on_coordinator: bool) -> list[Check]:
    """Each stage's inbound PULL: what the coordinator records of it, and whether a TCP
    connect from here to its address is accepted (no frame is sent). ``on_coordinator``:
    this is the coordinator's machine, which itself sends to stage 1 and hears the last."""
    nodes: dict[str, NodeStatus] = {n.node_id: n for n in status.nodes}
    count = len(status.stages)
    out = []
    for stage in status.stages:
        name = f"data pipe stage {stage.index}"
        node = nodes.get(stage.node_id or "")
        if node is None:
            out.append(Check(name, WARN, f"stage {stage.index} is not placed (pipeline "
                                         f"{status.pipeline})"))
            continue
        prev = (stage.index - 1) % count
        tcp = connects.get(node.data_addr)
        hop = (f"stage {prev} -> {stage.index} at {node.data_addr} (bound by {node.node_id}): "
               f"coordinator records {node.state}"
               + (f" at epoch {status.epoch}" if node.state == "serving" else "")
               + f"; TCP connect from here {tcp.describe() if tcp else 'not tried'}")
        if node.state in DOWN:
            out.append(Check(name, FAIL, hop + (f": {node.error}" if node.error else "")))
        elif node.state != "serving":
            out.append(Check(name, WARN, hop + " (not serving yet)"))
        elif tcp is not None and not tcp.ok:
            out.append(Check(name, FAIL if on_coordinator else WARN, hop + (
                "" if on_coordinator else " (this is not the coordinator's machine: the hop "
                                          "between the nodes may still work)")))
        else:
            out.append(Check(name, PASS, hop))
    return out


# -- LAN discovery: multicast here, the clusters announced, their endpoints, node ids -----
@dataclass(frozen=True)
class MulticastFacts:
    """Whether this machine heard its own mDNS query on ``interface``."""

    interface: Interface
    heard: bool
    error: str = ""
    tested: bool = True  # False: the probe's socket could not be set up (no verdict)


def multicast_check(facts: Sequence[MulticastFacts]) -> Check:
    if not facts:
        return Check("LAN multicast", WARN, "no LAN interface here (only loopback or container "
                                            f"bridges): nothing to announce on; {JOIN_BY_ADDRESS}")
    bad = [f for f in facts if not f.heard and f.tested]
    untested = [f for f in facts if not f.tested]
    where = ", ".join(f"{f.interface.name} {f.interface.address}" for f in facts if f.heard)
    if not bad and untested:
        detail = "; ".join(f"{f.interface.name} {f.interface.address}: {f.error}" for f in untested)
        return Check("LAN multicast", WARN, f"could not test multicast DNS ({detail})"
                                            + (f"; it loops back on {where}" if where else ""))
    if not bad:
        return Check("LAN multicast", PASS, f"multicast DNS loops back on {where}")
    detail = "; ".join(f"{f.interface.name} {f.interface.address}: {f.error}" for f in bad)
    return Check("LAN multicast", FAIL, f"multicast DNS does not get through ({detail}): a "
                                        "firewall dropping multicast, or an interface without "
                                        f"it; nodes cannot find clusters here: {JOIN_BY_ADDRESS}")


def clusters_check(found: Sequence[Announcement], refused: dict[str, str]) -> Check:
    names = ", ".join(sorted({f"{a.cluster} ({a.control})" for a in found}))
    skipped = (f"; refused {len(refused)}: " + "; ".join(
        f"{name.split('.')[0]}: {why}" for name, why in sorted(refused.items()))) if refused else ""
    if not found:
        return Check("LAN clusters", WARN, f"no cluster is announced on this LAN{skipped}; "
                                           f"{JOIN_BY_ADDRESS}")
    return Check("LAN clusters", WARN if refused else PASS, f"announced: {names}{skipped}")


def same_name_check(found: Sequence[Announcement]) -> Check:
    by_name: dict[str, set[str]] = {}
    for a in found:
        by_name.setdefault(a.cluster, set()).add(a.control)
    twins = {name: sorted(controls) for name, controls in by_name.items() if len(controls) > 1}
    if not twins:
        return Check("cluster names", PASS, "no two coordinators announce one name")
    detail = "; ".join(f"{name} at {', '.join(c)}" for name, c in sorted(twins.items()))
    return Check("cluster names", FAIL, f"two coordinators announce one name ({detail}): a node "
                                        "joining by name refuses to guess; give one cluster "
                                        "another --cluster-name")


def endpoint_checks(found: Sequence[Announcement], reachable: dict[str, str]) -> list[Check]:
    """``reachable``: control endpoint -> "" if a TCP connect worked, else why not."""
    out = []
    for a in sorted(found, key=lambda a: (a.cluster, a.control)):
        why = reachable.get(a.control, "not probed")
        if why:
            out.append(Check(f"announced {a.cluster}", FAIL, f"{a.cluster} at {a.control} is "
                                                         f"announced but unreachable from here "
                                                         f"({why}): a firewall, or the wrong "
                                                         "interface announced "
                                                         "(cluster up --announce-interface)"))
        else:
            out.append(Check(f"announced {a.cluster}", PASS, f"{a.cluster} at {a.control} reachable"))
    return out


def node_id_check(here: Iterable[str], addresses: Iterable[str], found: Sequence[Announcement],
                  members: Sequence[tuple[str, str]] = ()) -> Check:
    """``here``: this machine's node ids; ``addresses``: its own addresses; ``members``:
    (node id, host) of the nodes a cluster's status lists."""
    ours, local = set(here), {str(ipaddress.ip_address(a)) for a in addresses}
    clashes = [f"{a.coordinator_id} (the coordinator of {a.cluster} at {a.host})" for a in found
               if a.coordinator_id in ours and a.host not in local]
    clashes += [f"{node_id} (a node at {host})" for node_id, host in members
                if node_id in ours and host not in local]
    if not ours:
        return Check("node id", PASS, "no node id here yet (made on first join)")
    if clashes:
        return Check("node id", FAIL, f"this machine's node id is used by another machine: "
                                      f"{'; '.join(sorted(set(clashes)))}; a cloned state "
                                      "directory? delete node_id in one of them")
    return Check("node id", PASS, f"{', '.join(sorted(ours))}: not seen elsewhere")
