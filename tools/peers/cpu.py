"""What llama.cpp's CPU backend is built for on this CPU: ggml's x86 instruction-set
options chosen from the flags /proc/cpuinfo lists, each with the reason it departs from
upstream's defaults, and whether AMX tiles may be used (a probe).

Upstream builds with ``GGML_NATIVE=ON`` (``-march=native``). On an Intel Xeon VM that
lists AMX, such a build died with SIGILL in an AMX tile kernel during prompt processing,
and a build without AVX-512 decoded at half speed; so the build names every AVX/AVX-512
option the CPU has, explicitly, and leaves AMX out unless asked for and proven usable.
On an AMD EPYC the same rules give AVX2 and (Zen 4 on) AVX-512. Pure functions, except
``read_cpu_flags`` and ``probe_amx``.
"""

from __future__ import annotations

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
    "AMX left out: at this pin llama.cpp's AMX tile kernels died with SIGILL during prompt "
    "processing on an Intel Xeon VM that lists AMX (a -march=native build); one-token decode "
    "runs ggml's AVX-512-VNNI kernels with or without AMX. --amx probe builds them in when "
    "the kernel grants this process AMX tiles and a tile program runs")


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
    if cpu_amx:
        probe = f" (probe: {amx.detail})" if amx is not None else ""
        reasons["GGML_AMX"] = (f"ON: /proc/cpuinfo lists {' '.join(cpu_amx)}{probe}" if amx_on
                               else f"OFF although /proc/cpuinfo lists {' '.join(cpu_amx)}: "
                                    + (f"the probe failed{probe}" if amx is not None
                                       else AMX_OFF_REASON))
    return IsaChoice(options, reasons)


# Ask the kernel for AMX tile data (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), then run an
# int8 tile multiply in four threads and the main thread: exit 0 only if all give 16*64*2.
AMX_PROBE_C = r"""
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg_t;
static void *tiles(void *out) {
    static __thread int8_t a[16 * 64], b[16 * 64];
    static __thread int32_t c[16 * 16];
    memset(a, 1, sizeof a); memset(b, 2, sizeof b);
    cfg_t cfg; memset(&cfg, 0, sizeof cfg); cfg.palette = 1;
    for (int t = 0; t < 3; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
    _tile_zero(0); _tile_loadd(1, a, 64); _tile_loadd(2, b, 64);
    _tile_dpbssd(0, 1, 2); _tile_stored(0, c, 64); _tile_release();
    *(int *)out = c[0] == 128;
    return 0;
}
int main(void) {
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


def probe_amx(flags: Iterable[str], compiler: str = "cc") -> AmxProbe:
    """Whether AMX tiles work for a process here: the CPU lists amx_tile and amx_int8,
    the kernel grants tile data, and a tile program compiled with ``compiler`` runs to
    the right answer in threads (a SIGILL, a refusal or no compiler: not usable)."""
    have = set(flags)
    if not {"amx_tile", "amx_int8"} <= have:
        return AmxProbe(False, "the CPU lists no amx_tile/amx_int8")
    with tempfile.TemporaryDirectory(prefix="zctl-amx-") as tmp:
        source, binary = Path(tmp) / "probe.c", Path(tmp) / "probe"
        source.write_text(AMX_PROBE_C)
        try:
            built = subprocess.run([compiler, "-O1", "-pthread", "-mamx-tile", "-mamx-int8",
                                    str(source), "-o", str(binary)], capture_output=True,
                                   text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return AmxProbe(False, f"cannot compile the tile program: {exc}")
        if built.returncode != 0:
            return AmxProbe(False, f"cannot compile the tile program: {built.stderr[-300:]}")
        try:
            ran = subprocess.run([str(binary)], capture_output=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return AmxProbe(False, f"the tile program did not run: {exc}")
    if ran.returncode == 0:
        return AmxProbe(True, "the kernel grants tile data and a tile multiply runs in threads")
    if ran.returncode < 0:
        return AmxProbe(False, f"the tile program died of signal {-ran.returncode}")
    return AmxProbe(False, PROBE_EXITS.get(ran.returncode, f"the tile program exited "
                                                           f"{ran.returncode}"))
