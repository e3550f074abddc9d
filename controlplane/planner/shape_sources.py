"""A model's shape without its weights: a preset, a Hugging Face config.json, a GGUF header.

``resolve_shape`` takes what ``zctl export`` takes (its default model, a .gguf file, a
model directory, a hub id: only config.json is fetched) and also a preset name or a
config.json file. A GGUF file is read up to the end of its tensor index (the metadata and
the tensors' names), never its weights: the gguf package's reader maps every tensor and
every element of the tokenizer's arrays (3 s of CPU for SmolLM2-135M's header), where
this reads the few keys a shape needs and steps over the rest.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controlplane.planner.presets import PRESETS
from controlplane.planner.shape import ModelShape, ShapeError

CONFIG_NAME = "config.json"
GGUF_MAGIC = b"GGUF"
# GGUF metadata value types (the GGUF specification, version 2 and 3): fixed-size scalars
# by their struct format; 8 is a string (u64 length, then bytes), 9 an array (u32 type,
# u64 count, then the elements)
GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                10: "<Q", 11: "<q", 12: "<d"}
GGUF_STRING, GGUF_ARRAY = 8, 9
SMALL_ARRAY = 1024  # a scalar array this long or shorter is read; a longer one is counted


def shape_from_config(raw: Mapping[str, Any], name: str, where: str) -> ModelShape:
    """The shape a Hugging Face ``config.json`` describes (a multimodal config's
    ``text_config`` when the top level has no layers); ShapeError naming ``where`` and the
    key for anything missing or of the wrong type."""
    if not isinstance(raw, Mapping):
        raise ShapeError(f"{where}: not a JSON object")
    if "num_hidden_layers" not in raw and isinstance(raw.get("text_config"), Mapping):
        raw = raw["text_config"]

    def integer(key: str, default: int | None = None) -> int:
        value = raw.get(key, default)
        if value is None:
            raise ShapeError(f"{where}: no {key!r}")
        if type(value) is not int:
            raise ShapeError(f"{where}: {key!r} is {value!r}, not an integer")
        return value

    hidden = integer("hidden_size")
    heads = integer("num_attention_heads")
    layers = integer("num_hidden_layers")
    experts = integer("num_experts", raw.get("num_local_experts") or 0)
    head_dim = raw.get("head_dim") or hidden // max(1, heads)
    sliding = config_sliding_layers(raw, layers, where)
    return ModelShape(
        name=name, num_layers=layers, hidden=hidden,
        intermediate=integer("intermediate_size", 0), heads=heads,
        kv_heads=integer("num_key_value_heads", heads), head_dim=int(head_dim),
        vocab=integer("vocab_size"), tied_embeddings=bool(raw.get("tie_word_embeddings", False)),
        experts=experts, active_experts=integer("num_experts_per_tok", 0) if experts else 0,
        expert_intermediate=(integer("moe_intermediate_size", raw.get("intermediate_size"))
                             if experts else 0),
        architecture=str(raw.get("model_type", "llama")),
        sliding_window=integer("sliding_window") if sliding else 0, sliding_layers=sliding)


# architectures whose layers interleave sliding-window and global attention (config.json's
# model types, llama.cpp's names), with the sliding_window_pattern they take unstated: every
# layer slides but each n-th (Gemma 3's 6; gpt-oss's 2, every other from the first)
INTERLEAVED = {"gemma3": 6, "gemma3_text": 6, "gpt_oss": 2, "gpt-oss": 2}
# config.json's model types whose sliding_window applies to every layer: all of them slide
# when it is shorter than the context (exporter.families' window_on_every_layer)
EVERY_LAYER = ("mistral", "phi3")


def config_sliding_layers(raw: Mapping[str, Any], layers: int, where: str) -> int:
    """How many of a config's ``layers`` attend over a sliding window, as the exporter
    exports them (exporter.families: Gemma 3's and gpt-oss's ``layer_types``; a window on
    every layer of Mistral and Phi-3, when it is shorter than the context)."""
    kinds = raw.get("layer_types")
    if isinstance(kinds, list):
        return sum(kind == "sliding_attention" for kind in kinds)
    if not raw.get("sliding_window"):
        return 0
    model_type = str(raw.get("model_type"))
    if model_type in EVERY_LAYER:
        window, context = raw["sliding_window"], raw.get("max_position_embeddings")
        if type(window) is not int or window < 1:
            raise ShapeError(f"{where}: 'sliding_window' is {window!r}, not a positive integer")
        return layers if type(context) is not int or window < context else 0
    if model_type not in INTERLEAVED:
        return 0
    pattern = raw.get("sliding_window_pattern", INTERLEAVED[model_type])
    if pattern is None or isinstance(pattern, list):  # (a config's is an integer)
        raise ShapeError(f"{where}: 'sliding_window_pattern' is {pattern!r}, not a positive "
                         "integer")
    return interleaved_sliding_layers(pattern, model_type, layers, where)


def interleaved_sliding_layers(pattern: Any, architecture: str, layers: int,
                               where: str) -> int:
    """How many of ``layers`` slide by a ``sliding_window_pattern``: a flag a layer (true:
    sliding), or every layer but each n-th (n an integer >= 1; unstated, the
    architecture's, ``INTERLEAVED``); none in an architecture that does not interleave."""
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ShapeError(f"{where}: its sliding_window_pattern has {len(pattern)} layers, "
                             f"its block_count {layers}")
        return sum(bool(flag) for flag in pattern)
    if architecture not in INTERLEAVED:
        return 0
    if pattern is None:
        pattern = INTERLEAVED[architecture]
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ShapeError(f"{where}: 'sliding_window_pattern' is {pattern!r}, not a positive "
                         "integer")
    return layers - layers // pattern


@dataclass(frozen=True)
class GGUFHeader:
    """A GGUF file's metadata (scalars and strings; arrays of up to SMALL_ARRAY scalars as
    lists, others as their element count) and the names of its tensors."""

    metadata: dict[str, Any]
    tensor_names: tuple[str, ...]


class _Cursor:
    def __init__(self, data: mmap.mmap | bytes, where: str) -> None:
        self.data, self.at, self.where = data, 0, where

    def unpack(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.data, self.at)
        except struct.error:
            raise ShapeError(f"{self.where}: the GGUF header ends early") from None
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.unpack("<Q")
        if self.at + size > len(self.data):
            raise ShapeError(f"{self.where}: the GGUF header ends early")
        text = bytes(self.data[self.at:self.at + size]).decode("utf-8", "replace")
        self.at += size
        return text

    def value(self, kind: int) -> Any:
        if kind in GGUF_SCALARS:
            return self.unpack(GGUF_SCALARS[kind])
        if kind == GGUF_STRING:
            return self.string()
        if kind == GGUF_ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item in GGUF_SCALARS and count <= SMALL_ARRAY:  # a flag a layer, say
                return [self.unpack(GGUF_SCALARS[item]) for _ in range(count)]
            if item in GGUF_SCALARS:
                self.at += count * struct.calcsize(GGUF_SCALARS[item])
            else:
                for _ in range(count):
                    self.value(item)
            return count
        raise ShapeError(f"{self.where}: unknown GGUF value type {kind}")


def read_gguf_header(path: Path) -> GGUFHeader:
    """The metadata and tensor names of a GGUF file (version 2 or 3), without its weights."""
    where = str(path)
    try:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            cursor = _Cursor(data, where)
            if bytes(data[:4]) != GGUF_MAGIC:
                raise ShapeError(f"{where}: not a GGUF file (no GGUF magic)")
            cursor.at = 4
            version = cursor.unpack("<I")
            if version not in (2, 3):
                raise ShapeError(f"{where}: GGUF version {version} (this reads 2 and 3)")
            tensors, pairs = cursor.unpack("<Q"), cursor.unpack("<Q")
            metadata: dict[str, Any] = {}
            for _ in range(pairs):
                key = cursor.string()
                metadata[key] = cursor.value(cursor.unpack("<I"))
            names = []
            for _ in range(tensors):
                names.append(cursor.string())
                dims = cursor.unpack("<I")
                cursor.at += 8 * dims + 4 + 8  # dims, type, offset
            return GGUFHeader(metadata, tuple(names))
    except (OSError, ValueError) as exc:
        if isinstance(exc, ShapeError):
            raise
        raise ShapeError(f"{where}: cannot read: {exc}") from None


def shape_from_gguf(path: Path) -> ModelShape:
    """The shape a GGUF file's metadata describes (llama.cpp's keys for its architecture)."""
    header = read_gguf_header(path)
    meta = header.metadata
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ShapeError(f"{path}: no general.architecture in the GGUF metadata")

    def integer(key: str, default: int | None = None) -> int:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ShapeError(f"{path}: no {arch}.{key} in the GGUF metadata")
        if isinstance(value, bool) or not isinstance(value, int):
            raise ShapeError(f"{path}: {arch}.{key} is {value!r}, not an integer")
        return value

    hidden, heads = integer("embedding_length"), integer("attention.head_count")
    vocab = meta.get(f"{arch}.vocab_size") or meta.get("tokenizer.ggml.tokens")
    if not isinstance(vocab, int):
        raise ShapeError(f"{path}: neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    experts = integer("expert_count", 0)
    layers = integer("block_count")
    window = integer("attention.sliding_window", 0)
    sliding = interleaved_sliding_layers(meta.get(f"{arch}.attention.sliding_window_pattern"),
                                         arch, layers, str(path)) if window else 0
    return ModelShape(
        name=str(meta.get("general.name") or path.stem), num_layers=layers,
        hidden=hidden, intermediate=integer("feed_forward_length", 0), heads=heads,
        kv_heads=integer("attention.head_count_kv", heads),
        head_dim=integer("attention.key_length", hidden // heads), vocab=vocab,
        tied_embeddings="output.weight" not in header.tensor_names,
        experts=experts, active_experts=integer("expert_used_count", 0) if experts else 0,
        expert_intermediate=integer("expert_feed_forward_length", 0) if experts else 0,
        architecture=arch, sliding_window=window if sliding else 0, sliding_layers=sliding)


def _config_file(path: Path, name: str) -> ModelShape:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ShapeError(f"{path}: cannot read it as JSON: {exc}") from None
    return shape_from_config(raw, name, str(path))


def _hub_config(model: str) -> ModelShape:
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise ShapeError(f"{model}: reading a hub model's config.json needs huggingface_hub "
                         "(pip install 'zctl[export]'), or give a preset, a config.json or a "
                         "GGUF file") from None
    try:
        local = hf_hub_download(model, CONFIG_NAME)
    except Exception as exc:  # network errors, a missing or gated repository
        raise ShapeError(f"{model}: cannot fetch its config.json from the hub: {exc}") from None
    return _config_file(Path(local), model)


def resolve_shape(model: str) -> ModelShape:
    """The shape of ``model``: a preset (``PRESETS``; zctl's default model is one), a .gguf
    file, a config.json file, a model directory holding one, or a hub id (its config.json
    only). ShapeError saying what was tried otherwise."""
    if model in PRESETS:
        return PRESETS[model]
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ShapeError(f"{model}: no such GGUF file")
        return shape_from_gguf(path)
    if path.is_file() and path.suffix == ".json":
        return _config_file(path, path.parent.name or path.stem)
    if path.is_dir():
        if (path / CONFIG_NAME).is_file():
            return _config_file(path / CONFIG_NAME, path.name)
        if (path / "manifest.json").is_file():
            raise ShapeError(f"{model}: an export directory; plan with the model it was "
                             "exported from (a preset, its config.json or its GGUF file)")
        raise ShapeError(f"{model}: no {CONFIG_NAME} in this directory")
    if path.exists():
        raise ShapeError(f"{model}: not a .gguf file, a config.json or a model directory")
    if model.count("/") == 1 and not model.startswith((".", "/")):
        return _hub_config(model)
    raise ShapeError(f"{model}: not a preset ({', '.join(PRESETS)}), a file or a directory")
