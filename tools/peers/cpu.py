"""What llama.cpp's CPU backend is built for on this CPU: ggml's x86 instruction-set
options chosen from the flags /proc/cpuinfo lists, each with the reason it departs from
upstream's defaults, and whether AMX tiles may be used, and with which compiler (a probe).

Upstream builds with ``GGML_NATIVE=ON`` (``-march=native``). On an Intel Xeon VM that
lists AMX, such a build with GCC 12.2 died with SIGILL at its first tile load during prompt
processing: GCC 12's ``_tile_loadconfig`` names only 8 bytes of its 64-byte operand as
read, so the stores ggml makes to its tile configuration (rows, bytes per row) are
dropped, and the tile load meets an unconfigured tile. clang-14 keeps them, and its build
runs. So the build names every AVX/AVX-512 option the CPU has, explicitly, and builds
AMX in with the first compiler whose tile program, written as ggml writes its
configuration, runs. On an AMD EPYC the same rules give AVX2 and (Zen 4 on) AVX-512. Pure
functions, except ``read_cpu_flags``, ``find_compilers`` and ``probe_amx``.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# ggml's x86 options (ggml/CMakeLists.txt) and the /proc/cpuinfo flags each needs: an
# option is on when the CPU lists every one of them. The AVX-512 extensions also need
# GGML_AVX512 itself (ggml compiles them into its AVX-512 kernels).
X86_OPTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("GGML_SSE42", ("sse4_2",)),
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("GGML_AVX512_VBMI", ("avx512vbmi",)),
    ("GGML_AVX512_VNNI", ("avx512_vnni",)),
    ("GGML_AVX512_BF16", ("avx512_bf16",)),
)
AVX512_EXTENSIONS = ("GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16")
AMX_OPTIONS: tuple[tuple[str, str], ...] = (
    ("GGML_AMX_TILE", "amx_tile"), ("GGML_AMX_INT8", "amx_int8"), ("GGML_AMX_BF16", "amx_bf16"))
AMX_POLICIES = ("off", "probe")

AMX_OFF_REASON = (
    "AMX left out (--amx off): ggml's AMX kernels are built in only with --amx probe, when "
    "the kernel grants this process AMX tiles and a tile program built by the chosen "
    "compiler runs")
# C++ compilers tried for AMX, in order: the default, then the clang versions Debian ships.
CLANG_VERSIONS = tuple(range(19, 13, -1))


@dataclass(frozen=True)
class IsaChoice:
    """The CPU options of a build: each ggml option ON/OFF, and why each one that
    departs from upstream's defaults does."""

    options: dict[str, str]
    reasons: dict[str, str]


@dataclass(frozen=True)
class AmxProbe:
    """Whether this process may use AMX tiles: the kernel's permission
    (arch_prctl(ARCH_REQ_XCOMP_PERM)) and a tile program run in threads."""

    usable: bool
    detail: str
    compiler: str | None = None  # the C++ compiler whose tile program ran (None: the default)


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The first ``flags`` line of a /proc/cpuinfo text (empty when there is none)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def read_cpu_flags(path: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """This machine's CPU flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        return parse_cpu_flags(path.read_text())
    except OSError:
        return frozenset()


def choose_isa(flags: Iterable[str], amx: AmxProbe | None = None) -> IsaChoice:
    """ggml's x86 options for a CPU with ``flags``: every instruction set it has, AMX
    only with a probe that found it usable (``amx``; None: not asked for). Upstream's
    default is GGML_NATIVE=ON with these options off (``-march=native`` picks them); with
    NATIVE off each must be named, so each ON option is a departure, with its flags as
    the reason."""
    have = set(flags)
    options = {"GGML_NATIVE": "OFF"}
    reasons = {"GGML_NATIVE": (
        "OFF: the instruction sets are named below, so the build says what it uses and "
        "does not depend on what -march=native enables (AMX included)")}
    for option, needs in X86_OPTIONS:
        on = all(flag in have for flag in needs)
        if option in AVX512_EXTENSIONS:
            on = on and options.get("GGML_AVX512") == "ON"
        options[option] = "ON" if on else "OFF"
        if on:
            reasons[option] = f"ON: /proc/cpuinfo lists {' '.join(needs)}"
    cpu_amx = [flag for _, flag in AMX_OPTIONS if flag in have]
    amx_on = bool(cpu_amx) and amx is not None and amx.usable and (
        options["GGML_AVX512_VNNI"] == "ON")  # ggml's AMX kernels need AVX512-VNNI too
    for option, flag in AMX_OPTIONS:
        options[option] = "ON" if amx_on and flag in have else "OFF"
    if amx_on and amx is not None and amx.compiler is not None:
        options["CMAKE_CXX_COMPILER"] = amx.compiler
        options["CMAKE_C_COMPILER"] = c_compiler(amx.compiler)
        reasons["CMAKE_CXX_COMPILER"] = f"{amx.compiler}: chosen by the AMX probe ({amx.detail})"
    if cpu_amx:
        probe = f" (probe: {amx.detail})" if amx is not None else ""
        reasons["GGML_AMX"] = (f"ON: /proc/cpuinfo lists {' '.join(cpu_amx)}{probe}" if amx_on
                               else f"OFF although /proc/cpuinfo lists {' '.join(cpu_amx)}: "
                                    + (f"the probe failed{probe}" if amx is not None
                                       else AMX_OFF_REASON))
    return IsaChoice(options, reasons)


# Ask the kernel for AMX tile data (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), then run an
# int8 tile multiply in four threads and the main thread: exit 0 only if all give 16*64*2.
# Mode "ggml" configures the tiles as ggml does (a zeroed struct on the stack, then its
# fields one by one); mode "fixed" loads a configuration from read-only data, which no
# compiler can drop: "fixed" running where "ggml" dies tells a compiler fault from a machine
# that cannot run tiles.
AMX_PROBE_CPP = r"""
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>
struct tile_config_t {
    uint8_t palette_id = 0;
    uint8_t start_row = 0;
    uint8_t reserved_0[14] = {0};
    uint16_t colsb[16] = {0};
    uint8_t rows[16] = {0};
};
static const tile_config_t FIXED = {1, 0, {0}, {64, 64, 64}, {16, 16, 16}};
static bool ggml_mode = true;
__attribute__((noinline)) static void configure(void) {
    if (!ggml_mode) { _tile_loadconfig(&FIXED); return; }
    alignas(64) tile_config_t tc = {};
    tc.palette_id = 1;
    for (int t = 0; t < 3; t++) { tc.rows[t] = 16; tc.colsb[t] = 64; }
    _tile_loadconfig(&tc);
}
static void *tiles(void *out) {
    alignas(64) static thread_local int8_t a[16 * 64], b[16 * 64];
    alignas(64) static thread_local int32_t c[16 * 16];
    memset(a, 1, sizeof a); memset(b, 2, sizeof b);
    configure();
    _tile_zero(0); _tile_loadd(1, a, 64); _tile_loadd(2, b, 64);
    _tile_dpbssd(0, 1, 2); _tile_stored(0, c, 64); _tile_release();
    *(int *)out = c[0] == 128;
    return 0;
}
int main(int argc, char **argv) {
    ggml_mode = argc < 2 || strcmp(argv[1], "fixed") != 0;
    if (syscall(SYS_arch_prctl, 0x1023, 18)) return 2;
    int ok[5] = {0}; pthread_t t[4];
    for (int i = 0; i < 4; i++) pthread_create(&t[i], 0, tiles, &ok[i]);
    for (int i = 0; i < 4; i++) pthread_join(t[i], 0);
    tiles(&ok[4]);
    return ok[0] && ok[1] && ok[2] && ok[3] && ok[4] ? 0 : 3;
}
"""
PROBE_EXITS = {2: "the kernel refused AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM)",
               3: "a tile multiply gave a wrong result"}
SIGILL = 4


def c_compiler(cxx: str) -> str:
    """The C compiler beside a C++ one: clang++-14 -> clang-14, g++-12 -> gcc-12."""
    return cxx.replace("clang++", "clang").replace("g++", "gcc")


def find_compilers() -> list[str]:
    """The C++ compilers to try for AMX, in order: the default (``c++``), then each clang
    on PATH, newest first."""
    names = ["c++", "clang++", *(f"clang++-{v}" for v in CLANG_VERSIONS)]
    return [name for name in names if shutil.which(name)]


def _run_probe(binary: Path, mode: str) -> int | str:
    """The probe's exit code in ``mode``, or why it did not run."""
    try:
        return subprocess.run([str(binary), mode], capture_output=True, timeout=60).returncode
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the tile program did not run: {exc}"


def probe_with(compiler: str, tmp: Path) -> AmxProbe:
    """Whether a tile program configured as ggml configures its tiles, built by
    ``compiler``, runs to the right answer in threads."""
    source, binary = tmp / "probe.cpp", tmp / f"probe-{Path(compiler).name}"
    source.write_text(AMX_PROBE_CPP)
    try:
        built = subprocess.run([compiler, "-O2", "-std=c++17", "-pthread", "-mamx-tile",
                                "-mamx-int8", str(source), "-o", str(binary)],
                               capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return AmxProbe(False, f"{compiler} cannot compile the tile program: {exc}")
    if built.returncode != 0:
        return AmxProbe(False, f"{compiler} cannot compile the tile program: "
                               f"{built.stderr[-300:]}")
    code = _run_probe(binary, "ggml")
    if code == 0:
        return AmxProbe(True, f"{compiler}: the kernel grants tile data and a tile multiply "
                              f"runs in threads", compiler)
    if isinstance(code, str):
        return AmxProbe(False, f"{compiler}: {code}")
    if code == -SIGILL and _run_probe(binary, "fixed") == 0:
        return AmxProbe(False, f"{compiler}: the tile program died of SIGILL with its tiles "
                               f"configured as ggml configures them, and ran with a fixed "
                               f"configuration: this compiler drops the configuration's "
                               f"stores before ldtilecfg (as GCC 12's _tile_loadconfig does)")
    if code < 0:
        return AmxProbe(False, f"{compiler}: the tile program died of signal {-code}")
    return AmxProbe(False, f"{compiler}: " + PROBE_EXITS.get(code, f"the tile program exited "
                                                                   f"{code}"))


def probe_amx(flags: Iterable[str], compilers: Iterable[str] | None = None) -> AmxProbe:
    """Whether AMX tiles work for a process here, and with which compiler: the CPU lists
    amx_tile and amx_int8, the kernel grants tile data, and a tile program built by one of
    ``compilers`` (default: ``find_compilers()``) runs to the right answer in threads. The
    first that works is chosen (``compiler`` None when it is the default ``c++``); when none
    does, each one's failure is said."""
    have = set(flags)
    if not {"amx_tile", "amx_int8"} <= have:
        return AmxProbe(False, "the CPU lists no amx_tile/amx_int8")
    tried = list(compilers) if compilers is not None else find_compilers()
    if not tried:
        return AmxProbe(False, "no C++ compiler on PATH")
    failures = []
    with tempfile.TemporaryDirectory(prefix="zctl-amx-") as tmp:
        for compiler in tried:
            probe = probe_with(compiler, Path(tmp))
            if probe.usable:
                detail = "; ".join([*failures, probe.detail])
                return AmxProbe(True, detail, None if compiler == "c++" else compiler)
            failures.append(probe.detail)
    return AmxProbe(False, "; ".join(failures))
