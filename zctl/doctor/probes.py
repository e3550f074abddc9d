"""Facts for ``zctl doctor``, gathered on this machine: CPU flags, OpenVINO devices, TCP
connects, multicast DNS on the LAN interfaces, the hashes of exports and shard caches,
node ids, and what the stages placed here need in memory. The verdicts on them are ``zctl.doctor.verdicts``'s.

Every probe is bounded (TCP connects time out) and reports a failure as a fact, never
by raising.
"""

from __future__ import annotations

import os
import socket
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from controlplane.checks import NODE_ID_RE, SHA256_RE
from controlplane.placement import (
    RUNTIME_OVERHEAD,
    LayerCost,
    PlacementError,
    layer_range,
    stage_needs,
)
from controlplane.records import ClusterStatus
from zctl.discovery.interfaces import Interface
from zctl.doctor.verdicts import (
    DeviceFacts,
    GrammarFacts,
    HttpFacts,
    IntegrityFacts,
    MemoryNeed,
    MulticastFacts,
    TcpFacts,
)
from zctl.endpoints import split_address
from zctl.manifest import MANIFEST_NAME, ExportManifest, ManifestError, load_manifest, sha256_file
from zctl.serve.tls import own_server_context

STATE_DEPTH = 2  # state dirs (node ids, shard caches) sit this deep under ZCTL_HOME at most


def cpu_flags(path: Path = Path("/proc/cpuinfo")) -> set[str] | None:
    """The first CPU's ``flags`` from /proc/cpuinfo; None where it cannot be read."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return None


def openvino_devices(core: Any | None = None) -> tuple[list[DeviceFacts], str]:
    """Every device OpenVINO lists with its name, optimisation capabilities and memory;
    ([], why) when OpenVINO itself cannot be asked."""
    try:
        if core is None:
            from dataplane.runtime.ov_core import shared_core

            core = shared_core()
        names = list(core.available_devices)
    except Exception as exc:  # noqa: BLE001 - a broken install is what doctor reports
        return [], f"{type(exc).__name__}: {exc}"
    out = []
    for name in names:
        try:
            full = str(core.get_property(name, "FULL_DEVICE_NAME"))
            caps = tuple(str(c) for c in core.get_property(name, "OPTIMIZATION_CAPABILITIES"))
        except Exception as exc:  # noqa: BLE001
            out.append(DeviceFacts(name, error=f"{type(exc).__name__}: {exc}"))
            continue
        memory = None
        if name.startswith("GPU"):
            try:
                memory = int(core.get_property(name, "GPU_DEVICE_TOTAL_MEM_SIZE"))
            except Exception:  # noqa: BLE001 - the plugin need not say
                memory = None
        out.append(DeviceFacts(name, full, caps, memory))
    return out, ""


def tcp_connect(address: str, timeout: float = 1.0) -> TcpFacts:
    """Open and close one TCP connection to ``address`` (nothing is sent)."""
    try:
        host, port = split_address(address)
    except ValueError as exc:
        return TcpFacts(False, error=str(exc))
    start = time.perf_counter()
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return TcpFacts(True, (time.perf_counter() - start) * 1000)
    except TimeoutError:
        return TcpFacts(False, error=f"no answer within {timeout:g} s")
    except OSError as exc:
        return TcpFacts(False, error=exc.strerror or str(exc))


def tcp_connect_all(addresses: Iterable[str], timeout: float = 1.0) -> dict[str, TcpFacts]:
    """``tcp_connect`` to each address at once (a few threads: slow hosts do not add up)."""
    unique = sorted(set(addresses))
    if not unique:
        return {}
    with ThreadPoolExecutor(min(8, len(unique))) as pool:
        return dict(zip(unique, pool.map(lambda a: tcp_connect(a, timeout), unique), strict=True))


# -- LAN discovery --------------------------------------------------------------------------
# The multicast probe joins the mDNS group on an interface, sends one mDNS query for zctl's
# service type there and waits to hear it back: a firewall rule that drops multicast, or an
# interface without it, fails the probe. Hearing one's own query does not prove that a
# switch forwards it; not seeing an announced cluster is the next check's warning.
MDNS_GROUP, MDNS_PORT = "224.0.0.251", 5353


def multicast_loop(interface: Interface, timeout: float = 1.0) -> MulticastFacts:
    """Send one mDNS query on ``interface`` and listen for it (never raises)."""
    from zeroconf import DNSOutgoing, DNSQuestion
    from zeroconf.const import _CLASS_IN, _FLAGS_QR_QUERY, _TYPE_PTR

    from zctl.discovery.records import SERVICE_TYPE

    query = DNSOutgoing(_FLAGS_QR_QUERY)
    query.add_question(DNSQuestion(SERVICE_TYPE, _TYPE_PTR, _CLASS_IN))
    marker = os.urandom(4).hex()  # told apart from other queriers' identical queries
    query.add_question(DNSQuestion(f"zctl-doctor-{marker}.local.", _TYPE_PTR, _CLASS_IN))
    packet = query.packets()[0]
    here = socket.inet_aton(interface.address)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if hasattr(socket, "SO_REUSEPORT"):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(("", MDNS_PORT))
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                            socket.inet_aton(MDNS_GROUP) + here)
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, here)
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 255)
            try:
                sock.sendto(packet, (MDNS_GROUP, MDNS_PORT))
            except OSError as exc:  # EPERM: a firewall rule refused it
                return MulticastFacts(interface, False,
                                      f"sending was refused ({exc.strerror or exc})")
            deadline = time.monotonic() + timeout
            while (left := deadline - time.monotonic()) > 0:
                sock.settimeout(left)
                try:
                    data, _ = sock.recvfrom(9000)
                except TimeoutError:
                    break
                if data == packet:
                    return MulticastFacts(interface, True)
    except OSError as exc:
        return MulticastFacts(interface, False, exc.strerror or str(exc), tested=False)
    return MulticastFacts(interface, False, f"its own query did not come back within {timeout:g} s")


def multicast_loops(interfaces: Iterable[Interface], timeout: float = 1.0
                    ) -> list[MulticastFacts]:
    """``multicast_loop`` on every interface at once (each query told apart by its marker),
    in their order."""
    chosen = list(interfaces)
    if not chosen:
        return []
    with ThreadPoolExecutor(len(chosen)) as pool:
        return list(pool.map(lambda i: multicast_loop(i, timeout), chosen))


def lan_interfaces(interfaces: Iterable[Interface]) -> list[Interface]:
    """Of this machine's ``interfaces``, those a node here finds clusters on: as a
    coordinator binding every interface announces (no container bridges, no loopback)."""
    from zctl.discovery.interfaces import announce_addresses

    return announce_addresses(interfaces, "0.0.0.0")


# -- what lies under ZCTL_HOME --------------------------------------------------------------
def _dirs(root: Path, depth: int) -> Iterator[Path]:
    """``root`` and its visible subdirectories down to ``depth`` levels."""
    yield root
    if depth <= 0:
        return
    try:
        children = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return
    for child in children:
        yield from _dirs(child, depth - 1)


def export_dirs(exports: Path, depth: int = 2) -> list[Path]:
    """Export directories (a manifest.json inside) under ``exports``, to ``depth`` levels."""
    if not exports.is_dir():
        return []
    return [d for d in _dirs(exports, depth) if (d / MANIFEST_NAME).is_file()]


def state_dirs(home: Path, extra: Iterable[Path] = ()) -> list[Path]:
    """Node and coordinator state directories (a node_id or a shards/ inside) under
    ``home`` (ZCTL_HOME/node, ZCTL_HOME/local/node1, ...), plus ``extra``."""
    found = [d for d in _dirs(home, STATE_DEPTH) if d.is_dir() and
             ((d / "node_id").is_file() or (d / "shards").is_dir())] if home.is_dir() else []
    for d in extra:
        if d.is_dir() and d not in found:
            found.append(d)
    return found


def node_ids(states: Iterable[Path]) -> dict[str, Path]:
    """{node id: state dir} of the state directories that hold a valid node id."""
    out = {}
    for d in states:
        try:
            node_id = (d / "node_id").read_text().strip()
        except (OSError, UnicodeDecodeError):
            continue
        if NODE_ID_RE.match(node_id):
            out.setdefault(node_id, d)
    return out


def _hash_problems(base: Path, names: Iterable[str], expected: dict[str, str],
                   prefix: str = "") -> tuple[int, list[str]]:
    """(files hashed, problems naming each missing or damaged file)."""
    checked, problems = 0, []
    for name in names:
        path = base / name
        want = expected.get(name)
        if want is None:
            problems.append(f"{prefix}{name}: not listed in the manifest")
        elif not path.is_file():
            problems.append(f"{prefix}{name}: missing")
        else:
            checked += 1
            try:
                got = sha256_file(path)
            except OSError as exc:
                problems.append(f"{prefix}{name}: unreadable ({exc.strerror or exc})")
                continue
            if got != want:
                problems.append(f"{prefix}{name}: sha256 {got[:12]}... but the manifest says "
                                f"{want[:12]}...")
    return checked, problems


def check_export(export_dir: Path, label: str | None = None) -> IntegrityFacts:
    """Re-hash every file an export's manifest lists."""
    label = label or export_dir.name
    try:
        manifest = load_manifest(export_dir, verify_files=False)
    except ManifestError as exc:
        return IntegrityFacts("export", label, str(export_dir), 0, (f"{MANIFEST_NAME}: {exc}",))
    checked, problems = _hash_problems(export_dir, sorted(manifest.files), manifest.files)
    return IntegrityFacts("export", label, str(export_dir), checked, tuple(problems))


def check_shard_cache(shards: Path, label: str | None = None) -> IntegrityFacts:
    """Re-hash every shard of a node's cache (``<state>/shards/<hash>/``): its stage's xml
    and bin against the manifest cached with it, and the hash it is filed under."""
    label = label or shards.parent.name
    checked, problems = 0, []
    hashes = sorted(p.name for p in shards.iterdir() if p.is_dir() and SHA256_RE.match(p.name)) \
        if shards.is_dir() else []
    for shard_hash in hashes:
        base, short = shards / shard_hash, f"{shard_hash[:12]}/"
        try:
            manifest = load_manifest(base, verify_files=False)
        except ManifestError as exc:
            problems.append(f"{short}{MANIFEST_NAME}: {exc}")
            continue
        index = next((s.index for s in manifest.stages
                      if _stage_hash(manifest, s.index) == shard_hash), None)
        if index is None:
            problems.append(f"{shard_hash[:12]}: its {MANIFEST_NAME} describes no stage with "
                            "this hash")
            continue
        spec = manifest.stages[index]
        n, found = _hash_problems(base, (spec.xml, spec.bin), manifest.files, short)
        checked, problems = checked + n, problems + found
    return IntegrityFacts("shard cache", label, str(shards), checked, tuple(problems),
                          len(hashes))


def _stage_hash(manifest: ExportManifest, index: int) -> str | None:
    try:
        return manifest.stage_hash(index)
    except KeyError:  # a manifest that does not list the stage's files
        return None


# -- memory --------------------------------------------------------------------------------
def _weight_bytes(export_dir: Path, index: int) -> int:
    """The stage's xml + bin sizes in an export or cached shard (0 if they are not there)."""
    try:
        spec = load_manifest(export_dir, verify_files=False).stages[index]
        return sum((export_dir / name).stat().st_size for name in (spec.xml, spec.bin))
    except (ManifestError, OSError, IndexError):
        return 0


def stage_needs_here(status: ClusterStatus, here: dict[str, Path]) -> list[MemoryNeed]:
    """The stages the cluster placed on node ids whose state lives on this machine
    (``here``: node id -> state dir), each with what its serving process already holds."""
    by_index = {s.index: s for s in status.stages}
    out = []
    for node in status.nodes:
        stage = by_index.get(node.stage) if node.stage is not None else None
        if node.node_id not in here or stage is None:
            continue
        files = (Path(status.export_dir) if node.local
                 else here[node.node_id] / "shards" / stage.shard_hash)
        held = (int(_weight_bytes(files, stage.index) * RUNTIME_OVERHEAD)
                if node.state == "serving" else 0)
        out.append(MemoryNeed(f"stage {stage.index} (layers "
                              f"{layer_range(stage.layer_start, stage.layer_end)}) of "
                              f"{node.node_id}", stage.bytes, min(held, stage.bytes)))
    return out


def grammar_probe(export_dir: Path, label: str) -> GrammarFacts:
    """Make the engine's grammar compiler from the export's tokenizer and compile any JSON
    object with it, as the coordinator does at its first structured-output request."""
    from zctl.engine.constraints import GrammarCompiler
    from zctl.engine.tokenizer import ChatTokenizer

    start = time.perf_counter()
    try:
        tokenizer = ChatTokenizer(export_dir)
        eos = tokenizer.eos_token_id
        compiler = GrammarCompiler(tokenizer.backend.to_str(), tokenizer.vocab_size,
                                   [] if eos is None else [eos])
        compiler.constraint("json_schema", '{"type": "object"}')
    except Exception as exc:  # noqa: BLE001 - doctor reports what breaks, it does not raise
        return GrammarFacts(label, error=f"{type(exc).__name__}: {exc}")
    return GrammarFacts(label, tokenizer.vocab_size, (time.perf_counter() - start) * 1e3)


def largest_export_need(exports: Iterable[Path]) -> MemoryNeed | None:
    """What the largest local export needs with all its stages on this machine (as an
    embedded ``zctl run`` or a ``--local`` cluster places them), by the coordinator's
    own estimate."""
    best: MemoryNeed | None = None
    for export_dir in exports:
        try:
            manifest = load_manifest(export_dir, verify_files=False)
            needs = stage_needs(manifest, export_dir, LayerCost.from_export(manifest, export_dir))
        except (ManifestError, PlacementError, OSError, ValueError):
            continue
        total = sum(n.bytes for n in needs)
        if best is None or total > best.bytes:
            best = MemoryNeed(f"the largest local export, {export_dir.name} ({len(needs)} "
                              "stage(s), all on this machine as in an embedded zctl run)", total)
    return best


def http_health(url: str, timeout: float = 2.0, verify: bool = True) -> HttpFacts:
    """GET URL/health: its status and the start of its body, or why there was no answer.
    An HTTPS server whose certificate this machine does not trust is asked again without
    checking it (``untrusted`` in the facts)."""
    target = url.rstrip("/") + "/health"
    if not target.startswith(("http://", "https://")):
        return HttpFacts(error=f"{url!r} is not an http:// or https:// URL")
    context = None if verify else own_server_context(target)
    try:
        with urllib.request.urlopen(target, timeout=timeout,  # noqa: S310
                                    context=context) as reply:
            return HttpFacts(reply.status, reply.read(2048).decode("utf-8", "replace"),
                                untrusted=not verify)
    except urllib.error.HTTPError as exc:
        return HttpFacts(exc.code, exc.read(2048).decode("utf-8", "replace"),
                            untrusted=not verify)
    except urllib.error.URLError as exc:
        reason = exc.reason
        if verify and isinstance(reason, ssl.SSLCertVerificationError):
            return replace(http_health(url, timeout, verify=False),
                           error=reason.verify_message or str(reason))
        refused = isinstance(reason, ConnectionRefusedError)
        text = reason.strerror if isinstance(reason, OSError) and reason.strerror else str(reason)
        return HttpFacts(error=text, refused=refused)
    except (TimeoutError, OSError, ValueError) as exc:
        return HttpFacts(error=str(exc) or type(exc).__name__)
