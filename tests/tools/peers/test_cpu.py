"""llama.cpp's instruction-set options from a /proc/cpuinfo text."""

from __future__ import annotations

import stat
from pathlib import Path

from tools.peers.cpu import AmxProbe, choose_isa, parse_cpu_flags, probe_amx

XEON_AMX = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse4_1 sse4_2 avx f16c fma bmi1 avx2 bmi2 avx512f avx512dq avx512cd avx512bw \
avx512vl avx_vnni avx512_bf16 avx512vbmi avx512_vnni amx_bf16 avx512_fp16 amx_tile amx_int8

processor\t: 1
flags\t\t: fpu
"""
EPYC_ZEN3 = "model name\t: AMD EPYC 7B13\nflags\t\t: sse4_2 avx f16c fma bmi2 avx2\n"
EPYC_ZEN4 = ("model name\t: AMD EPYC 9B14\nflags\t\t: sse4_2 avx f16c fma bmi2 avx2 avx512f "
             "avx512dq avx512cd avx512bw avx512vl avx512vbmi avx512_vnni avx512_bf16\n")


def on(choice) -> set[str]:
    return {k for k, v in choice.options.items() if v == "ON"}


def test_the_first_flags_line_is_read() -> None:
    flags = parse_cpu_flags(XEON_AMX)
    assert "amx_tile" in flags and "fpu" in flags
    assert parse_cpu_flags("processor: 0\n") == frozenset()


def test_a_xeon_with_amx_gets_every_avx_and_avx512_option_and_no_amx_unless_probed() -> None:
    choice = choose_isa(parse_cpu_flags(XEON_AMX))
    assert on(choice) == {"GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C",
                          "GGML_BMI2", "GGML_AVX_VNNI", "GGML_AVX512", "GGML_AVX512_VBMI",
                          "GGML_AVX512_VNNI", "GGML_AVX512_BF16"}
    assert choice.options["GGML_NATIVE"] == "OFF"
    assert {choice.options[k] for k in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")} == {"OFF"}
    assert "--amx probe" in choice.reasons["GGML_AMX_INT8"]
    assert "GGML_AMX" not in choice.reasons  # each reason under its option's own name
    assert "CMAKE_CXX_FLAGS" not in choice.options
    assert "avx512_vnni" in choice.reasons["GGML_AVX512_VNNI"]
    assert all(option in choice.reasons for option in on(choice) | {"GGML_NATIVE"})


def test_amx_goes_in_only_when_the_probe_found_it_usable() -> None:
    flags = parse_cpu_flags(XEON_AMX)
    usable = choose_isa(flags, AmxProbe(True, "tiles run"))
    assert {usable.options[k] for k in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")} == {"ON"}
    assert all("tiles run" in usable.reasons[k]
               for k in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"))
    assert usable.include is None
    refused = choose_isa(flags, AmxProbe(False, "the tile program died of signal 4"))
    assert refused.options["GGML_AMX_INT8"] == "OFF"
    assert "signal 4" in refused.reasons["GGML_AMX_INT8"]
    assert "CMAKE_CXX_FLAGS" not in usable.options  # the tiles ran as compiled


def test_amx_with_the_tile_configuration_header_forced_into_the_build() -> None:
    header = Path("/somewhere/ggml_tile_config.h")
    choice = choose_isa(parse_cpu_flags(XEON_AMX), AmxProbe(True, "stores dropped", header))
    assert choice.options["GGML_AMX_INT8"] == "ON"
    assert choice.options["CMAKE_C_FLAGS"] == choice.options["CMAKE_CXX_FLAGS"] == (
        f"-include {header}")
    assert "stores dropped" in choice.reasons["CMAKE_CXX_FLAGS"]
    assert choice.include == header  # what the build's key hashes


def test_amd_epyc_gets_avx2_and_on_zen4_avx512() -> None:
    zen3, zen4 = choose_isa(parse_cpu_flags(EPYC_ZEN3)), choose_isa(parse_cpu_flags(EPYC_ZEN4))
    assert {"GGML_AVX2", "GGML_FMA", "GGML_F16C"} <= on(zen3)
    assert not {"GGML_AVX512", "GGML_AVX_VNNI"} & on(zen3)
    assert {"GGML_AVX512", "GGML_AVX512_VNNI", "GGML_AVX512_BF16", "GGML_AVX512_VBMI"} <= on(zen4)
    assert not any(k.startswith("GGML_AMX") for k in zen4.reasons)  # no AMX: nothing to say


def test_avx512_extensions_need_the_whole_avx512_foundation() -> None:
    partial = choose_isa({"avx2", "avx512f", "avx512_vnni"})  # no cd/vl/dq/bw
    assert partial.options["GGML_AVX512"] == "OFF"
    assert partial.options["GGML_AVX512_VNNI"] == "OFF"


def test_the_probe_says_no_without_amx_flags() -> None:
    probe = probe_amx({"avx2"})
    assert not probe.usable and "amx" in probe.detail


def fake_compiler(folder: Path, program: str, forced: str = "exit 1",
                  macros: str = "__AMX_INT8__ __AVX512VNNI__") -> str:
    """A "compiler": asked for its macros (-dM) it defines ``macros``; asked to build, it
    writes a shell script (run with the probe's mode as $1) where ``-o`` says: ``program``,
    or ``forced`` when a header is forced in (-include)."""
    path = folder / "fake++"
    defines = "".join(f"echo '#define {m} 1'; " for m in macros.split())
    path.write_text(
        "#!/bin/sh\n"
        f'case " $* " in *" -dM "*) {defines}exit 0;; esac\n'
        f'case " $* " in *" -include "*) body=\'{forced}\';; *) body=\'{program}\';; esac\n'
        'while [ "$1" != -o ]; do shift; done\n'
        'printf \'#!/bin/sh\\n%s\\n\' "$body" > "$2"\n'
        'chmod +x "$2"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


AMX = {"amx_tile", "amx_int8"}
DIES_UNLESS_FIXED = 'if [ "$1" = fixed ]; then exit 0; fi; kill -ILL $$'


def test_a_compiler_that_drops_the_tile_configuration_gets_the_header(tmp_path: Path) -> None:
    compiler = fake_compiler(tmp_path, DIES_UNLESS_FIXED, forced="exit 0")
    probe = probe_amx(AMX, compiler, header=tmp_path / "fix.h")
    assert probe.usable and probe.include == tmp_path / "fix.h"
    assert "dropped the configuration's stores" in probe.detail


def test_tiles_that_die_even_with_the_header_leave_amx_out(tmp_path: Path) -> None:
    compiler = fake_compiler(tmp_path, DIES_UNLESS_FIXED, forced="kill -ILL $$")
    probe = probe_amx(AMX, compiler)
    assert not probe.usable and probe.include is None
    assert "forced in: the tile program died of signal 4" in probe.detail


def test_a_machine_that_cannot_run_tiles_is_not_blamed_on_the_compiler(tmp_path: Path) -> None:
    dead = probe_amx(AMX, fake_compiler(tmp_path, "kill -ILL $$"))
    assert not dead.usable and "signal 4" in dead.detail and "dropped" not in dead.detail
    refused = probe_amx(AMX, fake_compiler(tmp_path, "exit 2"))
    assert not refused.usable and "refused AMX tile data" in refused.detail


def test_a_compiler_without_ggml_s_amx_macros_is_refused(tmp_path: Path) -> None:
    probe = probe_amx(AMX, fake_compiler(tmp_path, "exit 0", macros="__AMXINT8__ __AVX512VNNI__"))
    assert not probe.usable and "__AMX_INT8__" in probe.detail


def test_a_missing_compiler_is_said(tmp_path: Path) -> None:
    probe = probe_amx(AMX, str(tmp_path / "no-such-c++"))
    assert not probe.usable and "__AMX_INT8__" in probe.detail
    assert probe_amx(AMX, fake_compiler(tmp_path, "exit 0")).usable
