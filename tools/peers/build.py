"""llama.cpp's binaries for the benchmark: built from the pinned source into a cache keyed
by the pin and the build's options (``$ZCTL_HOME/peers/llama.cpp/<version>-<key>``), or
taken from a directory given with ``--llama-cpp DIR``. llama.cpp is a dependency of this
benchmark only, never of the product.

The build's options are upstream's defaults except where named, each with its reason
(``BuildPlan.reasons``): the CPU's instruction sets (tools.peers.cpu), the RPC backend,
and what the benchmark does not need. The toolchain's versions (compilers, CMake, Ninja)
and the contents of any file the options name are recorded and keyed with them: another
compiler is another build.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.peers.cpu import IsaChoice
from tools.peers.source import PIN, SourcePin, pinned_tree

# The binaries the benchmark runs, by role.
BINARIES = {"server": "llama-server", "rpc": "ggml-rpc-server", "bench": "llama-bench",
            "quantize": "llama-quantize"}
# Options beyond the CPU's, with why each differs from upstream's default (or is named).
BUILD_OPTIONS: dict[str, tuple[str, str]] = {
    "CMAKE_BUILD_TYPE": ("Release", "Release: upstream's default, named"),
    "GGML_RPC": ("ON", "ON: the RPC backend (ggml-rpc-server, llama-server --rpc); off by "
                       "default"),
    "LLAMA_BUILD_TESTS": ("OFF", "OFF: the tests are not needed (on by default)"),
    "LLAMA_BUILD_EXAMPLES": ("OFF", "OFF: the examples are not needed (on by default)"),
    "LLAMA_OPENSSL": ("OFF", "OFF: loopback HTTP only, no OpenSSL (on by default)"),
}
LOG_TAIL_LINES = 30


class BuildFailure(RuntimeError):
    """llama.cpp could not be built; ``log_tail`` holds the end of its log."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail


class BinariesError(ValueError):
    """A directory that does not hold working llama.cpp binaries."""


@dataclass(frozen=True)
class BuildPlan:
    """What to build: the pin and the CMake options, with the reason for each that differs
    from upstream's defaults."""

    pin: SourcePin
    options: dict[str, str]
    reasons: dict[str, str] = field(default_factory=dict)
    toolchain: dict[str, str] = field(default_factory=dict)  # tool: its --version's first line
    inputs: dict[str, str] = field(default_factory=dict)  # a file the flags name: its sha256

    @property
    def key(self) -> str:
        """The cache's name for this build: the pin's version and a hash of the pin's
        sha256, every option, the toolchain's versions and the files the options name."""
        text = json.dumps({"sha256": self.pin.sha256, "options": self.options,
                           "toolchain": self.toolchain, "inputs": self.inputs},
                          sort_keys=True)
        return f"{self.pin.version}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"

    def cmake_args(self) -> list[str]:
        return [f"-D{name}={value}" for name, value in sorted(self.options.items())]

    def record(self) -> dict[str, Any]:
        """The build as the benchmark's output names it."""
        return {"pin": {"project": self.pin.project, "version": self.pin.version,
                        "sha256": self.pin.sha256},
                "options": self.options, "reasons": self.reasons,
                "toolchain": self.toolchain, "inputs": self.inputs, "key": self.key}


def plan_build(isa: IsaChoice, pin: SourcePin = PIN,
               toolchain: dict[str, str] | None = None) -> BuildPlan:
    """The build for a CPU's instruction-set choice, at ``pin``, with ``toolchain`` (the
    tools' versions, ``toolchain_versions``; None: not recorded)."""
    options = {**isa.options, **{k: v for k, (v, _) in BUILD_OPTIONS.items()}}
    reasons = {**isa.reasons, **{k: why for k, (_, why) in BUILD_OPTIONS.items()}}
    inputs = {}
    if isa.include is not None:  # its path is in the flags; what it holds is the build's too
        inputs[str(isa.include)] = hashlib.sha256(isa.include.read_bytes()).hexdigest()
    return BuildPlan(pin, options, reasons, dict(toolchain or {}), inputs)


def toolchain_versions(cmake: str = "cmake") -> dict[str, str]:
    """The first line of ``--version`` of what builds llama.cpp: the C and C++ compilers
    CMake picks (``$CC``/``$CXX``, else ``cc``/``c++``), CMake and Ninja; a tool that is
    missing or fails is recorded as such."""
    tools = {"cc": os.environ.get("CC") or "cc", "c++": os.environ.get("CXX") or "c++",
             "cmake": cmake, "ninja": "ninja"}
    versions = {}
    for role, tool in tools.items():
        try:
            answer = subprocess.run([tool, "--version"], capture_output=True, text=True,
                                    timeout=30)
            line = (answer.stdout or answer.stderr).strip().splitlines()[:1]
            versions[role] = (f"{tool}: {line[0]}" if answer.returncode == 0 and line
                              else f"{tool}: --version exited {answer.returncode}")
        except (OSError, subprocess.TimeoutExpired) as exc:
            versions[role] = f"{tool}: not run ({type(exc).__name__})"
    return versions


@dataclass(frozen=True)
class LlamaBinaries:
    """llama.cpp's binaries in one directory, and the version llama-server reports."""

    directory: Path
    version: str

    def path(self, role: str) -> Path:
        return self.directory / BINARIES[role]


def log_tail(text: str, lines: int = LOG_TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-lines:])


def find_binaries(directory: Path) -> LlamaBinaries:
    """The binaries in ``directory``, checked: each one present and executable, and
    llama-server answering ``--version``. BinariesError names what is wrong."""
    if not directory.is_dir():
        raise BinariesError(f"--llama-cpp {directory}: no such directory")
    missing = [name for name in BINARIES.values()
               if not os.access(directory / name, os.X_OK) or not (directory / name).is_file()]
    if missing:
        raise BinariesError(f"--llama-cpp {directory}: no executable {', '.join(missing)} "
                            f"there (it needs {', '.join(BINARIES.values())})")
    try:
        answer = subprocess.run([str(directory / BINARIES["server"]), "--version"],
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BinariesError(f"--llama-cpp {directory}: llama-server --version failed: "
                            f"{exc}") from None
    if answer.returncode != 0:
        raise BinariesError(f"--llama-cpp {directory}: llama-server --version exited "
                            f"{answer.returncode}: {log_tail(answer.stderr, 5)}")
    version = next((line.strip() for line in (answer.stdout + answer.stderr).splitlines()
                    if line.startswith("version")), "unknown")
    return LlamaBinaries(directory, version)


def build_dir(plan: BuildPlan, cache: Path) -> Path:
    return cache / "llama.cpp" / plan.key


def build(plan: BuildPlan, cache: Path, *, sdist: Path | None = None, jobs: int | None = None,
          cmake: str = "cmake") -> LlamaBinaries:
    """The binaries of ``plan``, built under ``cache`` on first use (the source fetched
    and unpacked there too): configure and build only the benchmark's targets, the log in
    ``build.log`` beside them. BuildFailure (with the log's tail) if any step fails."""
    root = build_dir(plan, cache)
    binaries = root / "build" / "bin"
    if (root / "build.json").is_file():
        try:
            return find_binaries(binaries)
        except BinariesError:
            pass
    tree = pinned_tree(cache / "src", plan.pin, sdist)
    root.mkdir(parents=True, exist_ok=True)
    log = root / "build.log"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    steps = [
        [cmake, "-S", str(tree), "-B", str(root / "build"), *generator, *plan.cmake_args()],
        [cmake, "--build", str(root / "build"), "--target", *BINARIES.values(),
         "-j", str(jobs or os.cpu_count() or 1)],
    ]
    with open(log, "w") as out:
        out.write(json.dumps(plan.record(), indent=1) + "\n")
        for step in steps:
            out.write("$ " + " ".join(step) + "\n")
            out.flush()
            try:
                code = subprocess.run(step, stdout=out, stderr=subprocess.STDOUT).returncode
            except OSError as exc:
                raise BuildFailure(f"cannot run {step[0]}: {exc}") from None
            if code != 0:
                raise BuildFailure(f"llama.cpp's build failed ({step[0]} {step[1]} exited "
                                   f"{code}); log: {log}", log_tail(log.read_text()))
    try:
        found = find_binaries(binaries)
    except BinariesError as exc:
        raise BuildFailure(f"the build finished without its binaries: {exc}",
                           log_tail(log.read_text())) from None
    (root / "build.json").write_text(json.dumps(plan.record(), indent=1))
    return found
