"""Where a node keeps its profiles: ``<state_dir>/profiles/``, one JSON file per model shape,
weight format (with its INT8 form where it is not the one an export is written in now),
device and OpenVINO version. A node whose OpenVINO changes measures again beside the old
version's file, which serves again if that version comes back.

``load`` gives a profile that fits this node now, or says why there is none: never
measured, measured with another OpenVINO version only, by an older zctl or on another
version of the synthetic layer graph (stale), or a file that cannot be read (damaged): each
is measured again, and the reason logged. (The processes of one machine measure one at a
time: controlplane/profile_turn.py.) ``anchor`` keeps with a profile the time the host's
reference workload took when the node that holds it first checked it
(controlplane/host_speed.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
import time
from dataclasses import replace
from pathlib import Path

from controlplane.nodeinfo import openvino_version
from controlplane.planner.measured import (
    PROFILE_FORMAT,
    Measurement,
    StaleProfile,
    mismatches,
    profile_dict,
    profile_from,
    profile_record,
    read_profile,
    record_from_dict,
)
from controlplane.planner.profile import ProfileError
from controlplane.planner.shape import ModelShape
from controlplane.records import ProfileRecord
from zctl.weights import default_int8_form, export_int8_form

log = logging.getLogger("zctl.controlplane")
BUDGET_S = 30.0  # what profiling one device may take at most
PROFILES = "profiles"
NOT_PROFILED = "not profiled yet"


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text)


def profile_stem(fingerprint: str, weights: str, device: str,
                 int8_form: str | None = None, exact_experts: bool = False) -> str:
    """What the file names of one shape, format (and INT8 form, named when it is not the
    format's default; exact experts, named when they are) and device's profiles begin
    with, whatever their OpenVINO version."""
    digest = hashlib.sha256(fingerprint.encode()).hexdigest()[:12]
    form = "" if int8_form in (None, default_int8_form(weights)) else f"-{int8_form}"
    experts = "-exact-experts" if exact_experts else ""
    return f"{weights}{form}{experts}-{_safe(device)}-{digest}"


def profile_name(fingerprint: str, weights: str, device: str, openvino: str,
                 int8_form: str | None = None, exact_experts: bool = False) -> str:
    """A profile's file name: readable, and unique to its shape, format, INT8 form, form of
    the experts, device and OpenVINO version."""
    stem = profile_stem(fingerprint, weights, device, int8_form, exact_experts)
    return f"{stem}.ov-{_safe(openvino)}.json"


def share_text(share: float) -> str:
    return f"a CPU quota of {share:g} cores" if share else "no CPU quota"


def quota_change(measured: float, now: float | None) -> str:
    """Why a profile measured under a CPU quota of ``measured`` cores (0: none) does not
    fit a node under ``now`` ("" when it does, or ``now`` is not known)."""
    if now is None or math.isclose(measured, now, rel_tol=1e-6, abs_tol=1e-9):
        return ""
    return f"measured under {share_text(measured)}, now under {share_text(now)}"


class ProfileStore:
    """The profiles of one state directory."""

    def __init__(self, state_dir: Path, openvino: str | None = None) -> None:
        self.dir = state_dir / PROFILES
        self.openvino = openvino or openvino_version()

    def path(self, shape: ModelShape, weights: str, device: str,
             int8_form: str | None = None, exact_experts: bool = False) -> Path:
        return self.dir / profile_name(shape.fingerprint(), weights, device, self.openvino,
                                       int8_form, exact_experts)

    def other_versions(self, shape: ModelShape, weights: str, device: str,
                       int8_form: str | None = None, exact_experts: bool = False) -> list[str]:
        """The OpenVINO versions (as their files name them) other profiles of the same
        shape, format, forms and device were measured with."""
        stem = profile_stem(shape.fingerprint(), weights, device, int8_form,
                            exact_experts) + ".ov-"
        mine = self.path(shape, weights, device, int8_form, exact_experts).name
        return sorted(p.name[len(stem):-len(".json")] for p in self.dir.glob(f"{stem}*.json")
                      if p.name != mine)

    def load(self, shape: ModelShape, weights: str, device: str,
             share: float | None = None, int8_form: str | None = None,
             exact_experts: bool = False) -> tuple[ProfileRecord | None, str]:
        """The profile of ``shape`` in ``weights`` (its INT8 in ``int8_form``, by default
        the format's; its experts exact with ``exact_experts``) on ``device`` measured with
        this node's OpenVINO (and, ``share`` given, under the CPU quota of ``share`` cores
        it is under now: 0, none), or (None, why there is none)."""
        form = export_int8_form(weights, int8_form)
        path = self.path(shape, weights, device, form, exact_experts)
        if not path.is_file():
            others = self.other_versions(shape, weights, device, form, exact_experts)
            if others:
                return None, (f"its profile is stale (measured with OpenVINO "
                              f"{', '.join(repr(v) for v in others)} only, not "
                              f"{self.openvino!r})")
            return None, NOT_PROFILED
        try:
            record = read_profile(path)
        except StaleProfile as exc:
            return None, f"its profile is stale ({exc.why})"
        except ProfileError as exc:
            return None, f"its profile is damaged ({exc})"
        stale = mismatches(record, exact_experts, shape=shape.fingerprint(), weights=weights,
                           device=device, openvino=self.openvino, int8_form=form)
        if stale:
            return None, f"its profile is stale (measured for {'; '.join(stale)})"
        changed = quota_change(record.cpu_share, share)
        if changed:
            return None, f"its profile is stale ({changed})"
        return record, ""

    def save(self, shape: ModelShape, measurement: Measurement) -> tuple[ProfileRecord, Path]:
        """Keep a measurement's profile (written whole, then renamed into place)."""
        key = measurement.key
        source = (f"measured on {socket.gethostname()} ({key.device}: 1 and "
                  f"{1 + measurement.extra_layers} synthetic layers, {measurement.rounds} "
                  f"rounds, {measurement.seconds:.1f} s)")
        record = profile_record(profile_from(measurement, shape, source), time.time(),
                                measurement.seconds)
        path = self.path(shape, key.weights, key.device, key.int8_form, key.exact_experts)
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(profile_dict(record, measurement), indent=1) + "\n")
        os.replace(tmp, path)
        return record, path

    def anchor(self, record: ProfileRecord, reference_s: float) -> ProfileRecord:
        """``record`` with the host's reference workload taking ``reference_s`` (as the
        node's first checks timed it: controlplane/host_speed.py), kept in its file when the
        file still holds ``record`` (not when it was measured again or removed meanwhile,
        nor when it cannot be written: logged, and the node goes on with the time)."""
        anchored = replace(record, reference_s=reference_s)
        path = self.dir / profile_name(record.shape, record.weights, record.device,
                                       record.openvino, record.int8_form, record.exact_experts)
        try:
            raw = json.loads(path.read_text())
            if record_from_dict(raw, str(path)) != record:
                return anchored
            raw["reference_s"], raw["format"] = reference_s, PROFILE_FORMAT
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(raw, indent=1) + "\n")
            os.replace(tmp, path)
        except (OSError, ValueError, ProfileError) as exc:
            log.warning("the profile's reference time could not be kept in %s: %s", path, exc)
        return anchored
