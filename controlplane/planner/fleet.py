"""A fleet file: the PCs a model could run on, their memory, speed and links (TOML).

```toml
head = "desktop"               # optional: the PC that runs stage 0 (the coordinator)

[[pc]]
name = "desktop"
memory_gb = 64                 # its RAM (a GPU's own memory for device = "GPU")
free_gb = 52                   # optional: what it can give the model (default 80% of memory)
device = "CPU"                 # optional (default CPU)
profile = "desktop-ddr5"       # a reference profile, a profile file zctl node profile wrote
                               # (a path ending .json, relative to this file; then memory_gb
                               # may be left out: free memory is the profile's), or a
                               # [pc.speed] table of its figures
link = "ethernet"              # how it reaches the others: a reference link, or its own
                               # { rtt_ms = 3, up_mbit_s = 60, down_mbit_s = 100 } (rtt_ms:
                               # its round trip to the switch or access point; a link
                               # between two PCs adds both PCs' round trips)
cpu_share = 0.5                # optional: a CPU quota it is held to, in cores of CPU time
quota_period_ms = 100          # (quota / period) per period (default 100 ms, the kernel's);
                               # it replaces the quota a measured profile was taken under

[[link]]                       # optional: a link measured between two PCs
between = ["desktop", "laptop"]
rtt_ms = 4.5
mbit_s = [80, 120]             # first to second, second to first (one figure: both ways)
```

``fleet_from_dict`` validates the parsed TOML; every error names the file, the PC and the
field. ``load_fleet`` reads the file. A PC with a measured profile is planned with it for
the shape, format and device it was measured for, and refused for any other.
"""

from __future__ import annotations

import itertools
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from controlplane.cpu_quota import DEFAULT_PERIOD_S, CpuQuota
from controlplane.planner.measured import mismatches, profile_of, read_profiles
from controlplane.planner.profile import LinkProfile, Links, NodeProfile, ProfileError
from controlplane.planner.references import (
    REFERENCE_LINKS,
    REFERENCE_SPEEDS,
    AccessLink,
    DeviceSpeed,
    derive_profile,
)
from controlplane.planner.shape import ModelShape
from controlplane.records import ProfileRecord

GB = 1e9
GIB = 1 << 30  # memory_gb and free_gb: RAM is counted in binary gigabytes
MS = 1e-3
MBIT = 1e6 / 8  # bytes per second in a megabit per second
DEFAULT_FREE_SHARE = 0.8  # of a PC's memory, left to the model when free_gb is not given
PC_KEYS = {"name", "memory_gb", "free_gb", "device", "profile", "speed", "link", "cpu_share",
           "quota_period_ms"}
SPEED_KEYS = {"weight_gbps": ("weight_bps", GB), "compute_gmacs": ("macs_per_s", GB),
              "layer_fixed_ms": ("layer_fixed_s", MS), "row_fixed_ms": ("row_fixed_s", MS),
              "call_ms": ("call_s", MS), "engine_fixed_ms": ("engine_fixed_s", MS),
              "engine_row_ms": ("engine_row_s", MS)}
OPTIONAL_SPEED_KEYS = {"engine_fixed_ms", "engine_row_ms"}  # default: the Xeon core's
ACCESS_KEYS = {"rtt_ms", "up_mbit_s", "down_mbit_s"}
LINK_KEYS = {"between", "rtt_ms", "mbit_s"}


class FleetError(ValueError):
    """A fleet file cannot be read or says something that cannot be; the text names the
    file, the PC and the field."""


@dataclass(frozen=True)
class FleetPC:
    """A PC: its memory, device and link, and its speed as reference figures (``speed``)
    or as the profiles measured on it (``measured``, from the file ``profile_file``)."""

    name: str
    memory: int
    free: int
    device: str
    speed: DeviceSpeed | None
    access: AccessLink
    measured: tuple[ProfileRecord, ...] = ()
    profile_file: str = ""
    quota: CpuQuota | None = None  # a CPU quota the file states (None: the profile's, if any)

    def profile(self, shape: ModelShape, weights: str,
                exact_experts: bool = False) -> NodeProfile:
        """This PC's profile for ``shape`` in ``weights`` (ProfileError when its measured
        profile is of something else), held to the quota the file states. ``exact_experts``:
        a mixture of experts' weights in their exact i8 form (a measured profile must have
        timed them so)."""
        profile = self._profile(shape, weights, exact_experts)
        if self.quota is None:
            return profile
        return replace(profile, cpu_share=self.quota.share, quota_period_s=self.quota.period_s)

    def _profile(self, shape: ModelShape, weights: str, exact_experts: bool) -> NodeProfile:
        if self.speed is not None:
            return derive_profile(self.speed, shape, weights, self.free, exact_experts)
        fits = [r for r in self.measured if r.device == self.device]
        if not fits:
            devices = ", ".join(sorted({r.device for r in self.measured}))
            raise ProfileError(f"pc {self.name!r}: {self.profile_file} profiles {devices}, "
                               f"not its device {self.device}")
        record = fits[0]
        stale = mismatches(record, exact_experts, shape=shape.fingerprint(), weights=weights)
        if stale:
            raise ProfileError(f"pc {self.name!r}: {self.profile_file} was measured for "
                               f"{'; '.join(stale)}: profile {shape.name} in {weights} "
                               f"(zctl node profile --model ... --weights {weights}"
                               f"{' --exact-experts' if exact_experts else ''} --json)")
        return replace(profile_of(record), free_memory=self.free)


@dataclass(frozen=True)
class Fleet:
    source: str
    pcs: tuple[FleetPC, ...]
    head: str | None
    measured: Mapping[tuple[str, str], LinkProfile]  # [[link]] entries by (first, second)

    def links(self) -> Links:
        """Every pair's link: measured where given, else from the two PCs' access links."""
        pairs = {}
        for a, b in itertools.combinations(self.pcs, 2):
            if (a.name, b.name) in self.measured:
                pairs[(a.name, b.name)] = self.measured[(a.name, b.name)]
            elif (b.name, a.name) in self.measured:
                pairs[(a.name, b.name)] = self.measured[(b.name, a.name)].reversed()
            else:
                pairs[(a.name, b.name)] = a.access.to(b.access)
        return Links(pairs)

    def profiles(self, shape: ModelShape, weights: str,
                 exact_experts: bool = False) -> dict[str, NodeProfile]:
        """Each PC's profile for ``shape`` in ``weights`` (``exact_experts``: FleetPC.profile):
        derived from its speed, or its measured one (ProfileError when that is of
        something else)."""
        return {pc.name: pc.profile(shape, weights, exact_experts) for pc in self.pcs}

    @property
    def profiled(self) -> bool:
        """Whether some PC's profile is a measured one."""
        return any(pc.speed is None for pc in self.pcs)


def _number(raw: Mapping[str, Any], key: str, where: str, required: bool = True,
            positive: bool = True) -> float | None:
    if key not in raw:
        if required:
            raise FleetError(f"{where}: {key} is missing")
        return None
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise FleetError(f"{where}: {key} must be a number, not {value!r}")
    if value < 0 or (positive and value == 0):
        raise FleetError(f"{where}: {key} must be {'positive' if positive else '>= 0'}, "
                         f"not {value!r}")
    return float(value)


def _unknown(raw: Mapping[str, Any], known: set[str] | Mapping[str, Any], where: str) -> None:
    extra = sorted(set(raw) - set(known))
    if extra:
        raise FleetError(f"{where}: unknown field(s) {', '.join(extra)}; expected "
                         f"{', '.join(sorted(known))}")


def _measured(path_text: str, base: Path, where: str) -> tuple[ProfileRecord, ...]:
    path = Path(path_text).expanduser()
    path = path if path.is_absolute() else base / path
    try:
        return tuple(read_profiles(path))
    except ProfileError as exc:
        raise FleetError(f"{where}: profile: {exc}") from None


def _speed(raw: Mapping[str, Any], where: str) -> DeviceSpeed:
    profile, speed = raw.get("profile"), raw.get("speed")
    if profile is not None and speed is not None:
        raise FleetError(f"{where}: give profile or a [speed] table, not both")
    if profile is None and speed is None:
        raise FleetError(f"{where}: no profile: give profile = one of "
                         f"{', '.join(REFERENCE_SPEEDS)}, or a [speed] table with "
                         f"{', '.join(SPEED_KEYS)}")
    if profile is not None:
        if profile not in REFERENCE_SPEEDS:
            raise FleetError(f"{where}: profile {profile!r} is not a reference profile; the "
                             f"references are {', '.join(REFERENCE_SPEEDS)}")
        return REFERENCE_SPEEDS[profile]
    if not isinstance(speed, Mapping):
        raise FleetError(f"{where}: speed must be a table of {', '.join(SPEED_KEYS)}")
    _unknown(speed, SPEED_KEYS, f"{where}: speed")
    figures = {}
    for key, (field, scale) in SPEED_KEYS.items():
        value = _number(speed, key, f"{where}: speed", required=key not in OPTIONAL_SPEED_KEYS,
                        positive=key in ("weight_gbps", "compute_gmacs"))
        if value is not None:
            figures[field] = value * scale
    try:
        return DeviceSpeed(str(raw.get("name", "?")), str(raw.get("device", "CPU")),
                           basis="the fleet file's figures", **figures)
    except ProfileError as exc:
        raise FleetError(f"{where}: speed: {exc}") from None


def _access(raw: Mapping[str, Any], where: str) -> AccessLink:
    link = raw.get("link", "ethernet")
    if isinstance(link, str):
        if link not in REFERENCE_LINKS:
            raise FleetError(f"{where}: link {link!r} is not a reference link; the references "
                             f"are {', '.join(REFERENCE_LINKS)}, or give a table of "
                             f"{', '.join(sorted(ACCESS_KEYS))}")
        return REFERENCE_LINKS[link]
    if not isinstance(link, Mapping):
        raise FleetError(f"{where}: link must be a reference link's name or a table")
    _unknown(link, ACCESS_KEYS, f"{where}: link")
    rtt = _number(link, "rtt_ms", f"{where}: link", positive=False)
    up = _number(link, "up_mbit_s", f"{where}: link")
    down = _number(link, "down_mbit_s", f"{where}: link")
    return AccessLink(str(raw.get("name")), rtt * MS, up * MBIT, down * MBIT,
                      basis="the fleet file's figures")


def _quota(raw: Mapping[str, Any], where: str) -> CpuQuota | None:
    share = _number(raw, "cpu_share", where, required=False)
    period = _number(raw, "quota_period_ms", where, required=False)
    if share is None:
        if period is not None:
            raise FleetError(f"{where}: quota_period_ms is given without cpu_share (the "
                             "cores of CPU time it grants per period)")
        return None
    return CpuQuota(share, (period if period is not None else DEFAULT_PERIOD_S / MS) * MS,
                    "the fleet file")


def _pc(raw: Any, index: int, where: str, base: Path) -> FleetPC:
    if not isinstance(raw, Mapping):
        raise FleetError(f"{where}: pc #{index + 1} is not a table")
    name = raw.get("name")
    if not isinstance(name, str) or not name.strip():
        raise FleetError(f"{where}: pc #{index + 1}: name is missing (a non-empty string)")
    at = f"{where}: pc {name!r}"
    _unknown(raw, PC_KEYS, at)
    profile = raw.get("profile")
    measured: tuple[ProfileRecord, ...] = ()
    if isinstance(profile, str) and profile.endswith(".json"):
        if raw.get("speed") is not None:
            raise FleetError(f"{at}: give profile or a [speed] table, not both")
        measured = _measured(profile, base, at)
    memory = _number(raw, "memory_gb", at, required=not measured)
    free = _number(raw, "free_gb", at, required=False)
    if free is not None and memory is not None and free > memory:
        raise FleetError(f"{at}: free_gb ({free:g}) is more than memory_gb ({memory:g})")
    device = raw.get("device", "CPU")
    if not isinstance(device, str) or not device:
        raise FleetError(f"{at}: device must be an OpenVINO device name such as CPU or GPU")
    if measured:
        free_bytes = (int(free * GIB) if free is not None
                      else min(r.free_memory for r in measured))
        total = int(memory * GIB) if memory is not None else free_bytes
        return FleetPC(name, total, free_bytes, device, None, _access(raw, at), measured,
                       profile, _quota(raw, at))
    assert memory is not None
    free_bytes = int((free if free is not None else memory * DEFAULT_FREE_SHARE) * GIB)
    return FleetPC(name, int(memory * GIB), free_bytes, device, _speed(raw, at), _access(raw, at),
                   quota=_quota(raw, at))


def _measured_link(raw: Any, index: int, names: set[str],
                   where: str) -> tuple[tuple[str, str], LinkProfile]:
    at = f"{where}: link #{index + 1}"
    if not isinstance(raw, Mapping):
        raise FleetError(f"{at} is not a table")
    _unknown(raw, LINK_KEYS, at)
    between = raw.get("between")
    if (not isinstance(between, list) or len(between) != 2
            or not all(isinstance(n, str) for n in between)):
        raise FleetError(f"{at}: between must name two PCs, as [\"a\", \"b\"]")
    a, b = between
    for name in (a, b):
        if name not in names:
            raise FleetError(f"{at}: between names {name!r}, which is not a pc of the fleet")
    if a == b:
        raise FleetError(f"{at}: between names {a!r} twice")
    rtt = _number(raw, "rtt_ms", at, positive=False)
    rates = raw.get("mbit_s")
    if isinstance(rates, int | float) and not isinstance(rates, bool):
        rates = [rates, rates]
    if not isinstance(rates, list) or len(rates) != 2:
        raise FleetError(f"{at}: mbit_s must be a number or [first to second, second to first]")
    forward = _number({"mbit_s": rates[0]}, "mbit_s", at)
    backward = _number({"mbit_s": rates[1]}, "mbit_s", at)
    return (a, b), LinkProfile(rtt * MS, forward * MBIT, backward * MBIT)


def fleet_from_dict(raw: Any, source: str, base: Path | None = None) -> Fleet:
    """A fleet from a parsed fleet file; FleetError naming ``source``, the PC and the field.
    Profile files are found relative to ``base`` (default: ``source``'s directory)."""
    if not isinstance(raw, Mapping):
        raise FleetError(f"{source}: not a table")
    _unknown(raw, {"head", "pc", "link"}, source)
    pcs_raw = raw.get("pc")
    if not isinstance(pcs_raw, list) or not pcs_raw:
        raise FleetError(f"{source}: no [[pc]] entries: list the PCs, one [[pc]] table each")
    base = base if base is not None else Path(source).parent
    pcs = tuple(_pc(pc, i, source, base) for i, pc in enumerate(pcs_raw))
    names = [pc.name for pc in pcs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise FleetError(f"{source}: pc {repeated[0]!r} is listed more than once")
    head = raw.get("head")
    if head is not None and head not in names:
        raise FleetError(f"{source}: head {head!r} is not a pc of the fleet "
                         f"({', '.join(names)})")
    links_raw = raw.get("link", [])
    if not isinstance(links_raw, list):
        raise FleetError(f"{source}: link must be a list of [[link]] tables")
    measured: dict[tuple[str, str], LinkProfile] = {}
    for i, link in enumerate(links_raw):
        pair, profile = _measured_link(link, i, set(names), source)
        if pair in measured or pair[::-1] in measured:
            raise FleetError(f"{source}: link #{i + 1}: the link between {pair[0]!r} and "
                             f"{pair[1]!r} is given twice")
        measured[pair] = profile
    return Fleet(source, pcs, head, measured)


def load_fleet(path: Path | str) -> Fleet:
    """Read and validate a fleet file."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise FleetError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise FleetError(f"{path}: not valid TOML: {exc}") from None
    return fleet_from_dict(raw, str(path))
