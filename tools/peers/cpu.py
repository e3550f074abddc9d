"""What llama.cpp's CPU backend is built for on this CPU: ggml's x86 instruction-set
options chosen from the flags /proc/cpuinfo lists, each with the reason it departs from
upstream's defaults, and whether AMX tiles may be used (a probe).

Upstream builds with ``GGML_NATIVE=ON`` (``-march=native``). On an Intel Xeon VM that
lists AMX, such a build with GCC 12.2 died with SIGILL at its first tile load during prompt
processing: GCC 12's ``_tile_loadconfig`` declares only 8 bytes of its 64-byte operand as
read, so the stores ggml makes to its tile configuration (rows, bytes per row) are dropped
and the tile load meets an unconfigured tile. (clang keeps the stores, but defines
``__AMXINT8__`` where ggml tests ``__AMX_INT8__``, so its builds leave ggml's AMX code out.)
So the build names every AVX/AVX-512 option the CPU has, explicitly, and builds AMX in when
a tile program configured as ggml configures its tiles runs: as compiled, or with
``ggml_tile_config.h`` forced in, whose ``_tile_loadconfig`` declares all 64 bytes read.
On an AMD EPYC the same rules give AVX2 and (Zen 4 on) AVX-512. Pure functions, except
``read_cpu_flags`` and ``probe_amx``.
"""

from __future__ import annotations

import signal
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
    "the kernel grants this process AMX tiles and a tile program configured as ggml's runs")
# Forced into the build when the compiler's own _tile_loadconfig loses the configuration.
TILE_CONFIG_HEADER = Path(__file__).with_name("ggml_tile_config.h")
# The macros ggml's AMX code is compiled under (ggml-cpu/amx): without them it is left out.
GGML_AMX_MACROS = ("__AMX_INT8__", "__AVX512VNNI__")


@dataclass(frozen=True)
class IsaChoice:
    """The CPU options of a build: each ggml option ON/OFF, and why each one that
    departs from upstream's defaults does."""

    options: dict[str, str]
    reasons: dict[str, str]
    include: Path | None = None  # the header CMAKE_C(XX)_FLAGS force into every source


@dataclass(frozen=True)
class AmxProbe:
    """Whether this process may use AMX tiles: the kernel's permission
    (arch_prctl(ARCH_REQ_XCOMP_PERM)) and a tile program run in threads."""

    usable: bool
    detail: str
    include: Path | None = None  # a header the build must force in for tiles to work


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
    if amx_on and amx is not None and amx.include is not None:
        flags = f"-include {amx.include}"
        options["CMAKE_C_FLAGS"] = options["CMAKE_CXX_FLAGS"] = flags
        reasons["CMAKE_CXX_FLAGS"] = reasons["CMAKE_C_FLAGS"] = (
            f"{flags}: the compiler's _tile_loadconfig loses ggml's tile configuration "
            f"({amx.detail})")
    probe = f" (probe: {amx.detail})" if amx is not None else ""
    for option, flag in AMX_OPTIONS:
        if flag in have:
            reasons[option] = (f"ON: /proc/cpuinfo lists {flag}{probe}" if amx_on
                               else f"OFF although /proc/cpuinfo lists {flag}: "
                                    + (f"the probe failed{probe}" if amx is not None
                                       else AMX_OFF_REASON))
    include = amx.include if amx_on and amx is not None else None
    return IsaChoice(options, reasons, include)


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


def _compile(compiler: str, source: Path, binary: Path, include: Path | None) -> str | None:
    """Build the probe; None, or why it could not be built."""
    forced = ["-include", str(include)] if include is not None else []
    try:
        built = subprocess.run([compiler, "-O2", "-std=c++17", "-pthread", "-mamx-tile",
                                "-mamx-int8", *forced, str(source), "-o", str(binary)],
                               capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{compiler} cannot compile the tile program: {exc}"
    if built.returncode != 0:
        return f"{compiler} cannot compile the tile program: {built.stderr[-300:]}"
    return None


def _run_probe(binary: Path, mode: str) -> int | str:
    """The probe's exit code in ``mode``, or why it did not run."""
    try:
        return subprocess.run([str(binary), mode], capture_output=True, timeout=60).returncode
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the tile program did not run: {exc}"


def _missing_macros(compiler: str) -> list[str]:
    """The macros ggml's AMX code needs that ``compiler`` does not define for AMX-INT8 and
    AVX512-VNNI (all of them when it cannot be asked)."""
    try:
        out = subprocess.run([compiler, "-mamx-tile", "-mamx-int8", "-mavx512f",
                              "-mavx512vnni", "-dM", "-E", "-x", "c++", "/dev/null"],
                             capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return list(GGML_AMX_MACROS)
    defined = {line.split()[1] for line in out.splitlines() if line.startswith("#define ")}
    return [macro for macro in GGML_AMX_MACROS if macro not in defined]


def _failure(code: int | str) -> str:
    if isinstance(code, str):
        return code
    if code < 0:
        return f"the tile program died of signal {-code}"
    return PROBE_EXITS.get(code, f"the tile program exited {code}")


def probe_amx(flags: Iterable[str], compiler: str = "c++",
              header: Path = TILE_CONFIG_HEADER) -> AmxProbe:
    """Whether AMX tiles work in llama.cpp built here by ``compiler``: the CPU lists
    amx_tile and amx_int8, the compiler defines the macros ggml's AMX code is built under,
    the kernel grants tile data, and a tile program configured as ggml configures its
    tiles runs to the right answer in threads. When it dies with SIGILL yet runs with a
    configuration from read-only data, the compiler lost the configuration's stores: the
    program is built again with ``header`` forced in, and if that runs, the build needs
    it too (``include``)."""
    have = set(flags)
    if not {"amx_tile", "amx_int8"} <= have:
        return AmxProbe(False, "the CPU lists no amx_tile/amx_int8")
    missing = _missing_macros(compiler)
    if missing:
        return AmxProbe(False, f"{compiler} defines no {' or '.join(missing)} for AMX-INT8 "
                               f"and AVX512-VNNI, which ggml's AMX code is compiled under")
    with tempfile.TemporaryDirectory(prefix="zctl-amx-") as tmp:
        source, binary = Path(tmp) / "probe.cpp", Path(tmp) / "probe"
        source.write_text(AMX_PROBE_CPP)
        problem = _compile(compiler, source, binary, None)
        if problem:
            return AmxProbe(False, problem)
        code = _run_probe(binary, "ggml")
        if code == 0:
            return AmxProbe(True, "the kernel grants tile data and a tile multiply runs in "
                                  "threads")
        if code != -signal.SIGILL or _run_probe(binary, "fixed") != 0:
            return AmxProbe(False, _failure(code))
        lost = (f"{compiler}'s tile program died of SIGILL with its tiles configured as "
                f"ggml configures them, and ran with a configuration from read-only data: "
                f"the compiler dropped the configuration's stores before ldtilecfg")
        problem = _compile(compiler, source, binary, header)
        fixed = problem or _run_probe(binary, "ggml")
        if fixed == 0:
            return AmxProbe(True, f"{lost}; with {header.name} forced in it runs", header)
        return AmxProbe(False, f"{lost}; with {header.name} forced in: {_failure(fixed)}")
