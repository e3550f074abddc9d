"""The GGUF files llama.cpp runs, paired by bits with zctl's weight formats: INT4 with the
Q4_1 GGUF zctl ships SmolLM2 as (zctl's export is made from that same file) or with Q4_0
(llama-quantize from F32) for other models; INT8 with Q8_0 and FP32 with F32, both
converted from the HF directory zctl exports by the pinned source's convert_hf_to_gguf.py
(with that source's gguf-py). Made once into ``$ZCTL_HOME/peers/gguf``."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tools.peers.build import LlamaBinaries, log_tail

OUTTYPES = {"int8": "q8_0", "fp32": "f32", "fp16": "f16"}  # zctl weights -> converter's
# What the converter imports that the benchmark's environment lacks (its requirements'
# bounds), installed with pip into the cache, apart from the environment.
CONVERTER_PACKAGES = ("sentencepiece>=0.1.98,<0.3.0",)


class GgufFailure(RuntimeError):
    """A GGUF file could not be made, or read."""


@dataclass(frozen=True)
class GgufFile:
    """A GGUF for one side of a pairing: its file, its type, how it was made."""

    path: Path
    kind: str
    made_by: str

    def record(self) -> dict[str, str]:
        return {"path": str(self.path), "type": self.kind, "made_by": self.made_by}


def run_logged(argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    """Run ``argv`` with its output in ``log``; GgufFailure with the log's tail if it fails."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT,
                              env={**os.environ, **(env or {})}).returncode
    if code != 0:
        raise GgufFailure(f"{' '.join(argv[:3])} ... exited {code}:\n"
                          f"{log_tail(log.read_text(errors='replace'), 20)}")


def converter_packages(cache: Path) -> Path:
    """A folder with CONVERTER_PACKAGES (pip install --target, once)."""
    target = cache / "converter-packages"
    if not (target / ".installed").is_file():
        run_logged([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(target),
                    *CONVERTER_PACKAGES], cache / "converter-packages.log")
        (target / ".installed").write_text("\n".join(CONVERTER_PACKAGES))
    return target


def convert(tree: Path, hf_dir: Path, outtype: str, out: Path) -> Path:
    """``hf_dir`` as a GGUF of ``outtype`` (f32, f16, q8_0) by the source's converter, with
    the source's gguf-py and the converter's packages on its path."""
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    packages = converter_packages(out.parent.parent)
    partial = out.with_suffix(".part.gguf")
    path = (str(tree / "gguf-py"), str(packages), os.environ.get("PYTHONPATH"))
    run_logged([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(hf_dir),
                "--outfile", str(partial), "--outtype", outtype], out.with_suffix(".log"),
               {"PYTHONPATH": os.pathsep.join(p for p in path if p)})
    partial.replace(out)
    return out


def quantize(binaries: LlamaBinaries, source: Path, kind: str, out: Path) -> Path:
    """``source`` quantized to ``kind`` (e.g. Q4_0) by llama-quantize."""
    if out.is_file():
        return out
    partial = out.with_suffix(".part.gguf")
    run_logged([str(binaries.path("quantize")), str(source), str(partial), kind],
               out.with_suffix(".log"))
    partial.replace(out)
    return out


def paired_gguf(name: str, weights: str, hf_dir: Path, tree: Path, binaries: LlamaBinaries,
                cache: Path, shipped: Path | None = None) -> GgufFile:
    """The GGUF paired with zctl's ``weights`` export of model ``name`` (from ``hf_dir``):
    INT4 the ``shipped`` Q4_1 when there is one, else Q4_0; INT8 Q8_0; FP32 F32."""
    folder = cache / "gguf"
    if weights == "int4":
        if shipped is not None:
            return GgufFile(shipped, "Q4_1", "the GGUF zctl ships (its export's source)")
        f32 = convert(tree, hf_dir, "f32", folder / f"{name}-f32.gguf")
        return GgufFile(quantize(binaries, f32, "Q4_0", folder / f"{name}-q4_0.gguf"), "Q4_0",
                        "llama-quantize Q4_0 from the F32 conversion")
    if weights not in OUTTYPES:
        raise GgufFailure(f"no GGUF pairs with zctl's {weights} weights: use one of "
                          f"int4, {', '.join(OUTTYPES)}")
    outtype = OUTTYPES[weights]
    return GgufFile(convert(tree, hf_dir, outtype, folder / f"{name}-{outtype}.gguf"),
                    outtype.upper(), f"convert_hf_to_gguf.py --outtype {outtype}")


@dataclass(frozen=True)
class GgufLayout:
    """What a placement check needs of a GGUF: its layers and each tensor's bytes."""

    num_layers: int
    tensor_bytes: dict[str, int]


def gguf_layout(path: Path) -> GgufLayout:
    """The block count and tensor sizes of the GGUF at ``path``; GgufFailure if it cannot
    be read (missing, or damaged: gguf-py's reader fails on it with OSError, ValueError or
    IndexError)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        count = next((int(field.parts[-1][0]) for key, field in reader.fields.items()
                      if key.endswith(".block_count")), 0)
        return GgufLayout(count, {t.name: int(t.n_bytes) for t in reader.tensors})
    except (OSError, ValueError, IndexError) as exc:
        raise GgufFailure(f"{path} cannot be read as a GGUF ({type(exc).__name__}: "
                          f"{exc})") from None
