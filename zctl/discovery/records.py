"""What a coordinator announces, as DNS-SD TXT records, and the checks a reader makes.

Pure: ``announcement_txt`` writes an ``Announcement`` as TXT key/values;
``parse_announcement`` reads one back from the bytes a browser received and refuses,
with a reason, anything malformed, forged (a control endpoint at an address the record
did not come from) or of another protocol; ``choose_cluster`` picks the cluster a node
joins, or says why it will not guess.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from zctl.endpoints import split_address

SERVICE_TYPE = "_zctl._tcp.local."
RECORD_FORMAT = "1"  # the TXT layout below; bump when it changes
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
VERSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/+-]{0,79}")
FINGERPRINT_RE = re.compile(r"[0-9a-f]{64}")
NODE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}")
MAX_VALUE_BYTES = 200  # a TXT string holds 255 bytes, key and '=' included


class AnnouncementRefused(ValueError):
    """An announcement this side will not act on; the message says why."""


@dataclass(frozen=True)
class Announcement:
    """A cluster as its coordinator announces it."""

    cluster: str  # the cluster's name (cluster up --cluster-name)
    control: str  # tcp://ADDRESS:PORT, the control endpoint nodes join
    protocol: int  # the control protocol (controlplane.messages.PROTOCOL_VERSION)
    openvino: str  # the coordinator's OpenVINO version
    coordinator_id: str  # the coordinator's node id
    fingerprint: str = ""  # sha256 of its CURVE public key, hex ("": CURVE off)

    @property
    def curve(self) -> bool:
        return bool(self.fingerprint)

    @property
    def host(self) -> str:
        return split_address(self.control)[0]

    @property
    def port(self) -> int:
        return split_address(self.control)[1]

    def describe(self) -> str:
        secured = f", CURVE key {short_fingerprint(self.fingerprint)}" if self.curve else ""
        return (f"{self.cluster} at {self.control} (protocol {self.protocol}, OpenVINO "
                f"{self.openvino}{secured})")


def short_fingerprint(fingerprint: str) -> str:
    """The first 16 hex digits of a fingerprint, in groups of four, to read aloud."""
    head = fingerprint[:16]
    return ":".join(head[i:i + 4] for i in range(0, len(head), 4))


def check_cluster_name(name: str) -> str:
    """``name`` if it can name a cluster; ValueError otherwise."""
    if not NAME_RE.fullmatch(name):
        raise ValueError(f"cluster name {name!r}: 1-63 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit")
    return name


def control_endpoint(value: str) -> tuple[str, int]:
    """(address, port) of ``tcp://ADDRESS:PORT`` with a literal IP address; ValueError
    otherwise (a host name would send the reader to a resolver of the announcer's choice)."""
    if not value.startswith("tcp://"):
        raise ValueError(f"control endpoint {value!r} is not tcp://ADDRESS:PORT")
    try:
        host, port = split_address(value)
    except ValueError:
        host, port = "", 0
    if not 0 < port < 65536:
        raise ValueError(f"control endpoint {value!r} has no port in 1..65535")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"control endpoint {value!r}: {host!r} is not an IP address") from None
    if address.is_multicast or address.is_unspecified:
        raise ValueError(f"control endpoint {value!r}: {host} cannot be connected to")
    return str(address), port


def announcement_txt(announcement: Announcement) -> dict[str, str]:
    """The TXT key/values that announce ``announcement``."""
    txt = {"fmt": RECORD_FORMAT, "cluster": announcement.cluster,
           "control": announcement.control, "proto": str(announcement.protocol),
           "openvino": announcement.openvino, "node": announcement.coordinator_id}
    if announcement.fingerprint:
        txt["key"] = announcement.fingerprint
    return txt


def _text(properties: Mapping[bytes, bytes | None], key: str, required: bool = True) -> str:
    raw = properties.get(key.encode())
    if raw is None:
        if required:
            raise AnnouncementRefused(f"no {key!r} in the record")
        return ""
    if len(raw) > MAX_VALUE_BYTES:
        raise AnnouncementRefused(f"{key!r} is {len(raw)} bytes long (at most {MAX_VALUE_BYTES})")
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        raise AnnouncementRefused(f"{key!r} is not ASCII text") from None


def parse_announcement(properties: Mapping[bytes, bytes | None], sources: Iterable[str],
                       protocol: int) -> Announcement:
    """The announcement in a service's TXT ``properties``, received for a service whose
    address records are ``sources``; AnnouncementRefused says why it cannot be used:
    malformed, another record format or control ``protocol``, or a control endpoint at an
    address the service does not have (forged)."""
    fmt = _text(properties, "fmt")
    if fmt != RECORD_FORMAT:
        raise AnnouncementRefused(f"record format {fmt!r}, this zctl reads {RECORD_FORMAT!r}")
    cluster = _text(properties, "cluster")
    if not NAME_RE.fullmatch(cluster):
        raise AnnouncementRefused(f"cluster name {cluster!r} is not a name")
    proto_text = _text(properties, "proto")
    if not proto_text.isdigit() or len(proto_text) > 6:
        raise AnnouncementRefused(f"cluster {cluster}: protocol {proto_text!r} is not a number")
    if int(proto_text) != protocol:
        raise AnnouncementRefused(f"cluster {cluster} speaks control protocol {int(proto_text)}, "
                                  f"this zctl speaks {protocol}: install the same zctl version")
    control = _text(properties, "control")
    try:
        host, _ = control_endpoint(control)
    except ValueError as exc:
        raise AnnouncementRefused(f"cluster {cluster}: {exc}") from None
    known = set()
    for source in sources:
        try:
            known.add(str(ipaddress.ip_address(source)))
        except ValueError:
            continue
    if host not in known:
        seen = ", ".join(sorted(known)) or "none"
        raise AnnouncementRefused(f"cluster {cluster}: control endpoint {control} is not an "
                                  f"address of the announcing host ({seen}): forged or stale")
    openvino = _text(properties, "openvino")
    if not VERSION_RE.fullmatch(openvino):
        raise AnnouncementRefused(f"cluster {cluster}: OpenVINO version {openvino!r} is malformed")
    node = _text(properties, "node")
    if not NODE_ID_RE.fullmatch(node):
        raise AnnouncementRefused(f"cluster {cluster}: coordinator id {node!r} is malformed")
    fingerprint = _text(properties, "key", required=False)
    if fingerprint and not FINGERPRINT_RE.fullmatch(fingerprint):
        raise AnnouncementRefused(f"cluster {cluster}: key fingerprint {fingerprint!r} is not "
                                  "64 lower-case hex digits")
    return Announcement(cluster, control, int(proto_text), openvino, node, fingerprint)


class ClusterChoiceError(ValueError):
    """No cluster, or no single one, to join; the message lists what was seen."""


# what a node does where discovery fails (said by node join, cluster ls and doctor)
JOIN_BY_ADDRESS = "join by address instead: zctl node join tcp://HOST:PORT"


def listing(found: Iterable[Announcement]) -> str:
    return "\n".join(f"  {a.describe()}" for a in sorted(found, key=lambda a: a.cluster))


def choose_cluster(found: Iterable[Announcement], name: str | None) -> Announcement:
    """The cluster to join among those ``found``: the one named ``name``, or with no name
    the only one; ClusterChoiceError when there is none, or more than one to guess from
    (two coordinators announcing one name included)."""
    distinct = sorted(set(found), key=lambda a: (a.cluster, a.control))
    if name is not None:
        matches = [a for a in distinct if a.cluster == name]
        if not matches:
            seen = f"; visible:\n{listing(distinct)}" if distinct else ""
            raise ClusterChoiceError(f"no cluster named {name!r} is announced on this LAN{seen}\n"
                                     f"{JOIN_BY_ADDRESS}")
        if len({a.control for a in matches}) > 1:
            raise ClusterChoiceError(f"{len(matches)} coordinators announce a cluster named "
                                     f"{name!r}; refusing to guess:\n{listing(matches)}\n"
                                     f"{JOIN_BY_ADDRESS}")
        return matches[0]
    if not distinct:
        raise ClusterChoiceError("no cluster is announced on this LAN (is multicast blocked? "
                                 f"zctl doctor checks); {JOIN_BY_ADDRESS}")
    if len(distinct) > 1:
        raise ClusterChoiceError(f"{len(distinct)} clusters are announced; name one with "
                                 f"--cluster NAME:\n{listing(distinct)}")
    return distinct[0]


def key_problem(announcement: Announcement, server_fingerprint: str) -> str:
    """Why a node holding the coordinator key with ``server_fingerprint`` ("": none) must
    not join ``announcement`` ("" when it may)."""
    if announcement.curve and not server_fingerprint:
        return (f"cluster {announcement.cluster} is CURVE-secured (key "
                f"{short_fingerprint(announcement.fingerprint)}): give --curve-server-key "
                "with the coordinator's coordinator.key")
    if server_fingerprint and not announcement.curve:
        return (f"cluster {announcement.cluster} announces no CURVE key but this node was "
                "given one: an impostor, or a cluster started without --curve")
    if server_fingerprint and server_fingerprint != announcement.fingerprint:
        return (f"cluster {announcement.cluster} announces the key "
                f"{short_fingerprint(announcement.fingerprint)}, not the coordinator key "
                f"given ({short_fingerprint(server_fingerprint)}): an impostor, or another "
                "cluster of that name")
    return ""
