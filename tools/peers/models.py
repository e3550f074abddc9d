"""The models compared, each in its two forms: zctl's cached export (tools.harness.models,
cost-balanced split) and llama.cpp's GGUF of the same bits (tools.peers.gguf).

SmolLM2-135M-Instruct is the GGUF zctl ships (Q4_1, its export's source) and its
dequantised HF directory. The Llama-3.2-1B-shaped random model is written with SmolLM2's
tokenizer (llama.cpp's converter recognises its pre-tokenizer; token ids are all that
matter for timing), under a name of its own so it never mixes with random-1b's exports
that carry a trained toy tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tools.harness.models import BenchModel
from tools.harness.report import err

SMOLLM2 = "smollm2-135m"
RANDOM_1B = "random-1b"
MODELS = (SMOLLM2, RANDOM_1B)
RANDOM_1B_EXPORT_NAME = "random-1b-smollm2-tokenizer"


def bench_model(name: str, cache: Path) -> BenchModel:
    """The model ``name`` (smollm2-135m or random-1b) for zctl's exports under ``cache``."""
    from exporter.sources import default_model_hf_dir

    smol_dir = default_model_hf_dir(cache / "sources")
    if name == SMOLLM2:
        return BenchModel(SMOLLM2, smol_dir, cache)
    if name == RANDOM_1B:
        from tools.harness.random_llama import write_random_llama

        hf_dir = cache / "sources" / RANDOM_1B_EXPORT_NAME
        if not (hf_dir / "config.json").is_file():
            err.print("writing a random Llama-3.2-1B-shaped checkpoint (SmolLM2's tokenizer) ...")
            write_random_llama(hf_dir, "llama-3.2-1b", tokenizer_from=smol_dir)
        return BenchModel(RANDOM_1B_EXPORT_NAME, hf_dir, cache)
    raise ValueError(f"unknown model {name!r}: use {', '.join(MODELS)}")


def shipped_gguf(name: str) -> Path | None:
    """The GGUF zctl ships for ``name`` (SmolLM2's Q4_1), else None."""
    if name != SMOLLM2:
        return None
    from exporter.sources import smollm2_gguf_path

    return smollm2_gguf_path()


def export_ranges(export_dir: Path) -> list[tuple[int, int]]:
    """The export's stages' half-open layer ranges, as its manifest gives them."""
    from zctl.manifest import load_manifest

    return [(s.layer_start, s.layer_end) for s in load_manifest(export_dir).stages]


def token_encoder(export_dir: Path) -> Callable[[str], list[int]]:
    """Text -> token ids by the export's tokenizer, without special tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(export_dir))
    return lambda text: list(tokenizer.encode(text, add_special_tokens=False))
