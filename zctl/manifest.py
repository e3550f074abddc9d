"""The export manifest: what a directory of stage shards holds, and its integrity check.

Pure data and file hashing; written by the exporter, read by every node.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from zctl.weights import INT8_CHANNELS, INT8_FORMS

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "zctl-stage-export/1"


class ManifestError(ValueError):
    """A manifest is missing, malformed, or does not match the files beside it."""


@dataclass(frozen=True)
class ModelSpec:
    """The shape of the model the stages were cut from (what the runtime needs)."""

    name: str
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_inv_freq: tuple[float, ...]
    rope_attention_scaling: float
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Sliding-window layers (Gemma 3): the RoPE frequencies they turn with when not the
    # others' (the stages' rope inputs then hold both tables: dataplane.runtime.rope),
    # how many latest keys a query of theirs sees, and which layers they are.
    rope_local_inv_freq: tuple[float, ...] = ()
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    # True: a sliding layer's graph takes the last columns of the stage's mask, as many as
    # its KV holds, so a stateful stage may trim its state to the window from the front
    # (dataplane.runtime.kv.sliding_states); an export made before keeps every slot.
    sliding_kv_trimmable: bool = False
    # A mixture of experts (Qwen3-MoE, gpt-oss): its experts, how many a token runs, their width.
    experts: int = 0
    active_experts: int = 0
    expert_intermediate: int = 0
    # LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini): rope_inv_freq is then the short factors'
    # set, rope_long_inv_freq the long factors'; a sequence whose prompt is longer than
    # rope_short_context (original_max_position_embeddings) turns long throughout, any
    # other's tokens from that position on (dataplane.runtime.rope.StageRope,
    # zctl.engine.long_rope); both share rope_attention_scaling.
    rope_long_inv_freq: tuple[float, ...] = ()
    rope_short_context: int = 0


SLIDING_FIELDS = ("rope_local_inv_freq", "sliding_window", "sliding_layers",
                  "sliding_kv_trimmable")
MOE_FIELDS = ("experts", "active_experts", "expert_intermediate")
LONGROPE_FIELDS = ("rope_long_inv_freq", "rope_short_context")


@dataclass(frozen=True)
class StageSpec:
    """One stage shard: a contiguous layer range [layer_start, layer_end)."""

    index: int
    layer_start: int
    layer_end: int
    xml: str
    bin: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    state_names: tuple[str, ...]
    first: bool
    last: bool

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start


STATIC_KV_DTYPES = ("f32", "f16")


@dataclass(frozen=True)
class StaticKV:
    """A static, stateless export (the NPU path): past KV goes in and the new tokens' KV
    comes out as plain tensors, the host keeps every stream's KV in ``context`` slots,
    and the runtime compiles two fixed shapes: 1 token (decode) and ``chunk`` tokens
    (prefill chunks, verification). ``kv_dtype``: the host KV's element type, "f32" or
    "f16" (half the memory and bandwidth; what an NPU computes in)."""

    context: int
    chunk: int
    kv_dtype: str = "f32"

    def __post_init__(self) -> None:
        if not (type(self.context) is int and type(self.chunk) is int):
            raise ManifestError("static KV context and chunk must be integers")
        if not 1 <= self.chunk <= self.context:
            raise ManifestError(f"static KV needs 1 <= chunk <= context, got chunk "
                                f"{self.chunk} and context {self.context}")
        if self.kv_dtype not in STATIC_KV_DTYPES:
            raise ManifestError(f"static KV dtype {self.kv_dtype!r} is not one of "
                                f"{STATIC_KV_DTYPES}")


# an export's chat files beside its tokenizer's: the template where the checkpoint states
# none (the exporter's stand-in, exporter.chat_formats), and what ends the model's turn in
# that format besides its EOS, {CHAT_STOPS: [text]}: stop strings of a reply to a chat,
# not of a raw completion
CHAT_TEMPLATE_NAME = "chat_template.jinja"
CHAT_FORMAT_NAME = "chat_format.json"
CHAT_STOPS = "stop"

GENERATION_CONFIG_NAME = "generation_config.json"  # Hugging Face's, in a model directory
# the sampling fields of a generation config an export keeps, and their JSON types
GENERATION_FIELDS: dict[str, type | tuple[type, ...]] = {
    "do_sample": bool, "temperature": (int, float), "top_k": int, "top_p": (int, float),
    "min_p": (int, float), "repetition_penalty": (int, float)}


@dataclass(frozen=True)
class GenerationConfig:
    """The sampling fields of the source model's generation config (Hugging Face's
    ``generation_config.json``) as it gives them; None: it leaves the field out.
    ``do_sample`` False: the model decodes greedily."""

    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None


def generation_config_from_dict(raw: Any, where: str = "generation_config") -> GenerationConfig:
    """The sampling fields of a parsed generation config (other fields are ignored, null
    is a field left out); ManifestError naming ``where`` for a field of the wrong type."""
    if not isinstance(raw, dict):
        raise ManifestError(f"{where} is not a JSON object")
    given: dict[str, Any] = {}
    for name, kind in GENERATION_FIELDS.items():
        value = raw.get(name)
        if value is None:
            continue
        if isinstance(value, bool) is not (kind is bool) or not isinstance(value, kind):
            raise ManifestError(f"{where}.{name} has the wrong type ({type(value).__name__})")
        given[name] = value if kind in (bool, int) else float(value)
    return GenerationConfig(**given)


@dataclass(frozen=True)
class ExportManifest:
    """Everything written by one ``zctl export``."""

    model: ModelSpec
    stages: tuple[StageSpec, ...]
    weight_format: str
    group_size: int | None
    activation_dtype: str
    beam_idx: bool
    versions: dict[str, str]
    files: dict[str, str] = field(default_factory=dict)
    source: str = ""
    created: str = ""
    format: str = MANIFEST_FORMAT
    static_kv: StaticKV | None = None  # None: stateful KV (ReadValue/Assign) with dynamic shapes
    # the source's sampling defaults (None: it had no generation config, as a GGUF file)
    generation_config: GenerationConfig | None = None
    # the form of the INT8 weights (zctl.weights.INT8_FORMS); None: no INT8 weights (fp16,
    # fp32), or an int4/int8 export written before the field (per channel, INT8_CHANNELS)
    int8_form: str | None = None
    # a mixture of experts' MXFP4 weights kept exactly as i8 codes with power-of-two scales
    # per group of 32 (exporter/exact_experts.py), whatever ``weight_format`` the rest took
    exact_experts: bool = False

    def to_json(self) -> str:
        raw = asdict(self)
        if raw["int8_form"] is None:  # written only when set: float exports as before
            del raw["int8_form"]
        if not raw["exact_experts"]:  # written only when set: other exports as before
            del raw["exact_experts"]
        for name in SLIDING_FIELDS + MOE_FIELDS + LONGROPE_FIELDS:  # written only when set: others as before
            if not raw["model"][name]:
                del raw["model"][name]
        return json.dumps(raw, indent=2, sort_keys=False)

    def stage_hash(self, index: int) -> str:
        """A stable identity for one shard: sha256 over its IR files' hashes."""
        spec = self.stages[index]
        digest = hashlib.sha256()
        for name in (spec.xml, spec.bin):
            digest.update(name.encode() + b"\0" + self.files[name].encode() + b"\0")
        return digest.hexdigest()


def sha256_file(path: Path, chunk_size: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk_size):
            digest.update(block)
    return digest.hexdigest()


def _require(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in obj:
        raise ManifestError(f"manifest {where} is missing '{key}'")
    value = obj[key]
    if not isinstance(value, kind):
        raise ManifestError(f"manifest {where}.{key} has the wrong type ({type(value).__name__})")
    return value


def manifest_from_dict(raw: Any) -> ExportManifest:
    """Validate and convert parsed JSON into an ExportManifest."""
    if not isinstance(raw, dict):
        raise ManifestError("manifest is not a JSON object")
    fmt = _require(raw, "format", str, "")
    if fmt != MANIFEST_FORMAT:
        raise ManifestError(f"manifest format '{fmt}' is not '{MANIFEST_FORMAT}'")
    model_raw = _require(raw, "model", dict, "")
    try:
        model = ModelSpec(
            **{
                **model_raw,
                "rope_inv_freq": tuple(float(x) for x in model_raw["rope_inv_freq"]),
                "eos_token_ids": tuple(int(x) for x in model_raw["eos_token_ids"]),
                "rope_local_inv_freq": tuple(
                    float(x) for x in model_raw.get("rope_local_inv_freq", ())),
                "sliding_layers": tuple(int(x) for x in model_raw.get("sliding_layers", ())),
                "rope_long_inv_freq": tuple(
                    float(x) for x in model_raw.get("rope_long_inv_freq", ())),
            }
        )
    except (TypeError, KeyError, ValueError) as exc:
        raise ManifestError(f"manifest model section is malformed: {exc}") from None
    check_rope(model)
    stages_raw = _require(raw, "stages", list, "")
    stages = []
    for i, stage_raw in enumerate(stages_raw):
        if not isinstance(stage_raw, dict):
            raise ManifestError(f"manifest stage {i} is not an object")
        try:
            stages.append(
                StageSpec(
                    **{
                        **stage_raw,
                        "inputs": tuple(stage_raw["inputs"]),
                        "outputs": tuple(stage_raw["outputs"]),
                        "state_names": tuple(stage_raw["state_names"]),
                    }
                )
            )
        except (TypeError, KeyError) as exc:
            raise ManifestError(f"manifest stage {i} is malformed: {exc}") from None
    manifest = ExportManifest(
        model=model,
        stages=tuple(stages),
        weight_format=_require(raw, "weight_format", str, ""),
        group_size=raw.get("group_size"),
        activation_dtype=_require(raw, "activation_dtype", str, ""),
        beam_idx=bool(_require(raw, "beam_idx", bool, "")),
        versions=dict(_require(raw, "versions", dict, "")),
        files=dict(_require(raw, "files", dict, "")),
        source=str(raw.get("source", "")),
        created=str(raw.get("created", "")),
        static_kv=_static_kv(raw.get("static_kv")),
        generation_config=None if raw.get("generation_config") is None else
        generation_config_from_dict(raw["generation_config"], "manifest generation_config"),
        int8_form=_int8_form(raw),
        exact_experts=bool(_require(raw, "exact_experts", bool, "")) if "exact_experts" in raw
        else False,
    )
    check_layer_cover(
        [(s.layer_start, s.layer_end) for s in manifest.stages], manifest.model.num_layers
    )
    if manifest.exact_experts and not manifest.model.experts:
        raise ManifestError("manifest exact_experts is true for a model without experts")
    return manifest


def check_rope(model: ModelSpec) -> None:
    """ManifestError unless the model's RoPE fields agree: a long set as wide as the short
    one, with the context past which it applies (and neither without the other), and a
    rotated width (twice the frequencies) of at most the head's."""
    width = len(model.rope_inv_freq)
    if not 0 < 2 * width <= model.head_dim:
        raise ManifestError(f"manifest model rope_inv_freq has {width} frequencies: RoPE "
                            f"turns 2 x that many of a head's {model.head_dim} dimensions")
    long = len(model.rope_long_inv_freq)
    if long and long != width:
        raise ManifestError(f"manifest model rope_long_inv_freq has {long} frequencies, "
                            f"rope_inv_freq {width}")
    if bool(long) is not (model.rope_short_context > 0):
        raise ManifestError("manifest model rope_long_inv_freq and a positive "
                            "rope_short_context go together (LongRoPE), got "
                            f"{long} frequencies and {model.rope_short_context}")


def _int8_form(raw: dict[str, Any]) -> str | None:
    """The manifest's ``int8_form``: one of INT8_FORMS; an int4/int8 export written before
    the field holds INT8 per channel; a float export none."""
    form = raw.get("int8_form")
    if form is None:
        return INT8_CHANNELS if raw.get("weight_format") in ("int4", "int8") else None
    if form not in INT8_FORMS:
        raise ManifestError(f"manifest int8_form {form!r} is not one of {INT8_FORMS}")
    return form


def _static_kv(raw: Any) -> StaticKV | None:
    if raw is None:
        return None
    if (not isinstance(raw, dict) or not {"context", "chunk"} <= set(raw)
            or not set(raw) <= {"context", "chunk", "kv_dtype"}):
        raise ManifestError("manifest static_kv must be an object with 'context', 'chunk' "
                            "and optionally 'kv_dtype'")
    return StaticKV(**raw)


def check_layer_cover(ranges: list[tuple[int, int]], num_layers: int) -> None:
    """Raise unless the half-open ranges cover [0, num_layers) exactly, in order."""
    if not ranges:
        raise ManifestError("no stages given")
    expected = 0
    for start, end in ranges:
        if start != expected:
            raise ManifestError(
                f"layer ranges must be contiguous from 0: expected a stage starting at "
                f"layer {expected}, got {start}"
            )
        if end <= start:
            raise ManifestError(f"empty or reversed layer range {start}-{end - 1}")
        expected = end
    if expected != num_layers:
        raise ManifestError(
            f"layer ranges cover layers 0-{expected - 1} but the model has {num_layers} layers"
        )


def load_manifest(export_dir: Path | str, verify_files: bool = True) -> ExportManifest:
    """Read ``manifest.json`` from an export directory; optionally check every file hash."""
    export_dir = Path(export_dir)
    path = export_dir / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(f"{path} not found: is {export_dir} a zctl export directory?")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path} is not valid JSON: {exc}") from None
    manifest = manifest_from_dict(raw)
    if verify_files:
        verify_export_files(export_dir, manifest)
    return manifest


def verify_export_files(
    export_dir: Path, manifest: ExportManifest, names: list[str] | None = None
) -> None:
    """Check that the named files (all by default) exist and match their recorded sha256."""
    for name in names if names is not None else sorted(manifest.files):
        expected = manifest.files.get(name)
        if expected is None:
            raise ManifestError(f"{name} is not listed in the manifest")
        file_path = export_dir / name
        if not file_path.is_file():
            raise ManifestError(f"{file_path} is missing")
        actual = sha256_file(file_path)
        if actual != expected:
            raise ManifestError(
                f"{file_path} is corrupted: sha256 {actual[:12]}... does not match the "
                f"manifest's {expected[:12]}..."
            )


def write_manifest(export_dir: Path, manifest: ExportManifest) -> None:
    """Write the manifest atomically (temp file + rename)."""
    tmp = export_dir / (MANIFEST_NAME + ".tmp")
    tmp.write_text(manifest.to_json())
    os.replace(tmp, export_dir / MANIFEST_NAME)


def parse_layer_spec(spec: str) -> list[tuple[int, int]]:
    """Parse '0-9,10-19,20-29' (inclusive) into half-open ranges [(0, 10), ...]."""
    ranges = []
    for part in spec.split(","):
        part = part.strip()
        bounds = part.split("-")
        if len(bounds) != 2 or not all(b.strip().isdigit() for b in bounds):
            raise ManifestError(f"bad layer range '{part}': expected FIRST-LAST, e.g. 0-14")
        first, last = int(bounds[0]), int(bounds[1])
        ranges.append((first, last + 1))
    return ranges


def layer_spec(ranges: Sequence[tuple[int, int]]) -> str:
    """Half-open ranges [(0, 10), ...] as ``zctl export --layers`` takes them: '0-9,...'
    (``parse_layer_spec``'s inverse)."""
    return ",".join(f"{start}-{end - 1}" for start, end in ranges)


def even_split(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Split layers into num_stages contiguous ranges, earlier stages taking the remainder."""
    if num_stages < 1 or num_stages > num_layers:
        raise ManifestError(f"cannot split {num_layers} layers into {num_stages} stages")
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for i in range(num_stages):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges
