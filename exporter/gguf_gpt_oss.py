"""gpt-oss from a GGUF file, read by the exporter itself (not transformers' GGUF loader,
which misreads it): the Hugging Face GptOss config the file's metadata states, and its
tensors by Hugging Face GptOss names, dequantized one at a time by the ``gguf`` package.

llama.cpp's converter (convert_hf_to_gguf.py, GptOssModel) writes gpt-oss's experts apart:
``ffn_gate_exps``, ``ffn_up_exps`` and ``ffn_down_exps`` ``[experts, out, in]``, gate and up
de-interleaved from Hugging Face's ``gate_up_proj`` (its columns alternate gate, up), or
fused as ``ffn_gate_up_exps`` (gate rows first), their biases alike; the attention sinks
as ``attn_sinks.weight``; the router as ``ffn_gate_inp``. This module maps them back:
``gate_up_proj`` [experts, hidden, 2 x width] with gate and up columns interleaved again,
``down_proj`` [experts, width, hidden]. The config: YaRN RoPE (factor and original context
from ``rope.scaling.*``; beta fast and slow where stated, else gpt-oss's 32 and 1, not
truncated, as gpt-oss's own config), the sliding window, every other layer sliding from
the first (llama.cpp's gpt-oss pattern) unless ``attention.sliding_window_pattern`` says
otherwise, the experts' count, active count and width, and the SwiGLU clamp
(``swiglu_clamp_exp``, else gpt-oss's 7).

Every tensor a gpt-oss file of that metadata stores is checked, by name, shape and GGML
type, when the file opens: a missing, misshapen or unknown tensor, or one of a type the
gguf package does not dequantize, is a GgufError naming it, before any weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import torch

from exporter.gguf_metadata import GgufError, check_readable_types, listed, sliding_layer_flags

GPT_OSS_ARCHITECTURE = "gpt-oss"  # llama.cpp's name
# gpt-oss's own values, which llama.cpp's gpt-oss files do not state
SWIGLU_LIMIT, SWIGLU_ALPHA = 7.0, 1.702
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0

# Hugging Face name under model.layers.{i}. -> GGUF name under blk.{i}. (same layout)
LAYER_TENSORS = {
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.sinks": "attn_sinks.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias",
    "mlp.experts.down_proj_bias": "ffn_down_exps.bias",
}
DOWN, GATE_UP, GATE_UP_BIAS = ("mlp.experts.down_proj", "mlp.experts.gate_up_proj",
                               "mlp.experts.gate_up_proj_bias")
MODEL_TENSORS = {"model.embed_tokens.weight": "token_embd.weight",
                 "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


@dataclass(frozen=True)
class StoredTensor:
    """A GGUF tensor's GGML type name and shape (numpy's order, outermost first)."""

    kind: str
    shape: tuple[int, ...]


def _required(metadata: dict[str, Any], key: str, location: str) -> Any:
    if key not in metadata:
        raise GgufError(f"{location}: a {GPT_OSS_ARCHITECTURE} file states no "
                        f"{GPT_OSS_ARCHITECTURE}.{key}")
    return metadata[key]


# YaRN keys of llama.cpp's that gpt-oss's config has no counterpart for
UNREAD_YARN_KEYS = ("rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor",
                    "rope.scaling.yarn_log_multiplier")


def _rope_parameters(metadata: dict[str, Any], location: str) -> dict[str, Any]:
    unread = [key for key in UNREAD_YARN_KEYS if key in metadata]
    if unread:
        raise GgufError(f"{location}: it states {', '.join(unread)}, which the exporter does "
                        "not read (gpt-oss's files state none)")
    theta = float(metadata.get("rope.freq_base", 10000.0))
    scaling = str(metadata.get("rope.scaling.type", "none"))
    if scaling == "none":
        return {"rope_type": "default", "rope_theta": theta}
    if scaling != "yarn":
        raise GgufError(f"{location}: its RoPE scaling is {scaling!r} (a gpt-oss file's is "
                        "yarn or none)")
    return {"rope_type": "yarn", "rope_theta": theta,
            "factor": float(_required(metadata, "rope.scaling.factor", location)),
            "original_max_position_embeddings": int(
                _required(metadata, "rope.scaling.original_context_length", location)),
            "beta_fast": float(metadata.get("rope.scaling.yarn_beta_fast", YARN_BETA_FAST)),
            "beta_slow": float(metadata.get("rope.scaling.yarn_beta_slow", YARN_BETA_SLOW)),
            "truncate": False}


def _swiglu_limit(metadata: dict[str, Any], layers: int, location: str) -> float:
    stated = metadata.get("swiglu_clamp_exp")
    if stated is None:
        return SWIGLU_LIMIT
    limits = {float(x) for x in (stated if isinstance(stated, list) else [stated] * layers)}
    if len(limits) != 1 or (isinstance(stated, list) and len(stated) != layers):
        raise GgufError(f"{location}: its swiglu_clamp_exp {stated} is not one limit for its "
                        f"{layers} layers")
    return limits.pop()


def gpt_oss_config(metadata: dict[str, Any], tokens: dict[str, Any],
                   stored: dict[str, StoredTensor], location: str) -> Any:
    """The Hugging Face GptOssConfig a gpt-oss GGUF file states: ``metadata`` its
    ``gpt-oss.…`` keys (without the prefix), ``tokens`` its ``tokenizer.ggml.…`` keys
    (without the prefix), ``stored`` its tensors."""
    from transformers import GptOssConfig

    layers = int(_required(metadata, "block_count", location))
    hidden = int(_required(metadata, "embedding_length", location))
    heads = int(_required(metadata, "attention.head_count", location))
    width = metadata.get("expert_feed_forward_length", metadata.get("feed_forward_length"))
    if width is None:
        raise GgufError(f"{location}: a {GPT_OSS_ARCHITECTURE} file states no "
                        "expert_feed_forward_length")
    window = int(_required(metadata, "attention.sliding_window", location))
    head_dim = int(metadata.get("attention.key_length", hidden // heads))
    rotated = int(metadata.get("rope.dimension_count", head_dim))
    if rotated != head_dim:
        raise GgufError(f"{location}: its RoPE turns {rotated} of a head's {head_dim} "
                        "dimensions (gpt-oss turns them all)")
    pattern = metadata.get("attention.sliding_window_pattern", 2)
    sliding = sliding_layer_flags(pattern, layers, location)
    vocab = (len(tokens["tokens"]) if "tokens" in tokens
             else stored.get("token_embd.weight", StoredTensor("", (0,))).shape[0])
    eos = [int(tokens[key]) for key in ("eos_token_id", "eot_token_id", "eom_token_id")
           if key in tokens]
    return GptOssConfig(
        architectures=["GptOssForCausalLM"], vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(width), num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=int(metadata.get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(_required(metadata, "attention.layer_norm_rms_epsilon", location)),
        max_position_embeddings=int(_required(metadata, "context_length", location)),
        rope_parameters=_rope_parameters(metadata, location),
        sliding_window=window,
        layer_types=["sliding_attention" if flag else "full_attention" for flag in sliding],
        num_local_experts=int(_required(metadata, "expert_count", location)),
        num_experts_per_tok=int(_required(metadata, "expert_used_count", location)),
        swiglu_limit=_swiglu_limit(metadata, layers, location),
        swiglu_alpha=SWIGLU_ALPHA, attention_bias=True,
        tie_word_embeddings="output.weight" not in stored,
        bos_token_id=tokens.get("bos_token_id"), pad_token_id=tokens.get("padding_token_id"),
        eos_token_id=(eos[0] if len(eos) == 1 else eos) or None)


def fused_experts(stored: dict[str, StoredTensor]) -> bool:
    """The file stores a layer's gate and up experts fused (``ffn_gate_up_exps``)."""
    return "blk.0.ffn_gate_up_exps.weight" in stored


def expected_tensors(config: Any, fused: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor a gpt-oss file of ``config`` stores, by GGUF name, with its shape."""
    hidden, vocab = int(config.hidden_size), int(config.vocab_size)
    heads, kv = int(config.num_attention_heads), int(config.num_key_value_heads)
    q, k = heads * int(config.head_dim), kv * int(config.head_dim)
    experts, width = int(config.num_local_experts), int(config.intermediate_size)
    per_layer = {"attn_q.weight": (q, hidden), "attn_q.bias": (q,),
                 "attn_k.weight": (k, hidden), "attn_k.bias": (k,),
                 "attn_v.weight": (k, hidden), "attn_v.bias": (k,),
                 "attn_output.weight": (hidden, q), "attn_output.bias": (hidden,),
                 "attn_sinks.weight": (heads,), "attn_norm.weight": (hidden,),
                 "post_attention_norm.weight": (hidden,),
                 "ffn_gate_inp.weight": (experts, hidden), "ffn_gate_inp.bias": (experts,),
                 "ffn_down_exps.weight": (experts, hidden, width),
                 "ffn_down_exps.bias": (experts, hidden)}
    if fused:
        per_layer |= {"ffn_gate_up_exps.weight": (experts, 2 * width, hidden),
                      "ffn_gate_up_exps.bias": (experts, 2 * width)}
    else:
        per_layer |= {f"ffn_{part}_exps.{kind}": shape for part in ("gate", "up")
                      for kind, shape in (("weight", (experts, width, hidden)),
                                          ("bias", (experts, width)))}
    expected = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        expected["output.weight"] = (vocab, hidden)
    for layer in range(int(config.num_hidden_layers)):
        expected |= {f"blk.{layer}.{name}": shape for name, shape in per_layer.items()}
    return expected


def check_stored(config: Any, stored: dict[str, StoredTensor], location: str) -> None:
    """GgufError naming the tensors of a gpt-oss file that do not match its metadata
    (missing, of another shape, or unknown to gpt-oss) or are of a GGML type not read."""
    expected = expected_tensors(config, fused_experts(stored))
    complaints = []
    missing = [name for name in expected if name not in stored]
    if missing:
        complaints.append(f"no {listed(missing)}")
    misshapen = [f"{name} is {list(stored[name].shape)}, its metadata makes it "
                 f"{list(shape)}" for name, shape in expected.items()
                 if name in stored and stored[name].shape != shape]
    complaints += misshapen[:4] + ([f"and {len(misshapen) - 4} more misshapen"]
                                   if len(misshapen) > 4 else [])
    unknown = [name for name in stored if name not in expected]
    if unknown:
        complaints.append(f"tensors a gpt-oss file of its metadata has not: {listed(unknown)}")
    if complaints:
        raise GgufError(f"{location}: its tensors do not match its metadata (block_count, "
                        f"embedding_length, head counts, key_length, expert_count, "
                        f"expert_feed_forward_length, vocabulary): {'; '.join(complaints)}")
    check_readable_types({name: t.kind for name, t in stored.items()}, location)


def hf_tensor_names(config: Any) -> list[str]:
    """The Hugging Face GptOss model's tensors, by name."""
    per_layer = list(LAYER_TENSORS) + [DOWN, GATE_UP, GATE_UP_BIAS]
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    return names + [f"model.layers.{layer}.{name}" for layer in range(config.num_hidden_layers)
                    for name in per_layer]


class Layout(Enum):
    """How a Hugging Face GptOss tensor is made of the GGUF tensors it is stored as."""

    AS_STORED = "as stored"
    TRANSPOSED = "an expert weight stored [experts, out, in], held [experts, in, out]"
    APART = "gate and up stored apart, held interleaved"
    FUSED = "gate and up stored as one, gate rows first, held interleaved"


@dataclass(frozen=True)
class GgufParts:
    """The GGUF tensors (``names``) a Hugging Face tensor is made of, and how."""

    layout: Layout
    names: tuple[str, ...]


def gguf_parts(hf_name: str, fused: bool) -> GgufParts | None:
    """How the tensor of Hugging Face name ``hf_name`` is stored in a gpt-oss file (one
    whose gate and up experts are ``fused``, or apart); None for a name gpt-oss has not."""
    if hf_name in MODEL_TENSORS:
        return GgufParts(Layout.AS_STORED, (MODEL_TENSORS[hf_name],))
    parts = hf_name.split(".", 3)
    if len(parts) != 4 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return None
    block, name = f"blk.{parts[2]}", parts[3]
    if name in LAYER_TENSORS:
        return GgufParts(Layout.AS_STORED, (f"{block}.{LAYER_TENSORS[name]}",))
    if name == DOWN:
        return GgufParts(Layout.TRANSPOSED, (f"{block}.ffn_down_exps.weight",))
    if name in (GATE_UP, GATE_UP_BIAS):
        kind = "weight" if name == GATE_UP else "bias"
        if fused:
            return GgufParts(Layout.FUSED, (f"{block}.ffn_gate_up_exps.{kind}",))
        return GgufParts(Layout.APART, (f"{block}.ffn_gate_exps.{kind}",
                                     f"{block}.ffn_up_exps.{kind}"))
    return None


def interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Gate and up ``[experts, width, ...]`` as Hugging Face's gpt-oss holds them together:
    ``[experts, 2 x width, ...]``, rows alternating gate, up."""
    return torch.stack((gate, up), dim=2).flatten(1, 2)


def to_hf(layout: Layout, tensors: list[torch.Tensor]) -> torch.Tensor:
    """The Hugging Face tensor made of GGUF ``tensors`` stored in ``layout``."""
    if layout is Layout.AS_STORED:
        return tensors[0]
    if layout is Layout.TRANSPOSED:
        return tensors[0].transpose(1, 2).contiguous()
    gate, up = tensors if layout is Layout.APART else tensors[0].chunk(2, dim=1)
    together = interleave(gate, up)  # a weight [experts, 2 x width, hidden], or a bias
    return together.transpose(1, 2).contiguous() if together.dim() == 3 else together


class GptOssGguf:
    """A gpt-oss GGUF file: its config, and its tensors by Hugging Face GptOss names, each
    dequantized to float32 when asked for (the file stays mapped, never loaded whole)."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        location = str(self.path)
        try:
            reader = GGUFReader(self.path)
            prefix, tokenizer = f"{GPT_OSS_ARCHITECTURE}.", "tokenizer.ggml."
            metadata = {name[len(prefix):]: field.contents()
                        for name, field in reader.fields.items() if name.startswith(prefix)}
            tokens = {name[len(tokenizer):]: field.contents()
                      for name, field in reader.fields.items()
                      if name.startswith(tokenizer) and name != "tokenizer.ggml.merges"}
        except (KeyError, ValueError, OSError) as exc:
            raise GgufError(f"{location}: cannot read its GGUF metadata: {exc}") from None
        self._tensors = {t.name: t for t in reader.tensors}
        stored = {t.name: StoredTensor(t.tensor_type.name,
                                       tuple(int(d) for d in reversed(t.shape)))
                  for t in reader.tensors}
        try:
            self.config = gpt_oss_config(metadata, tokens, stored, location)
        except GgufError:
            raise
        except (TypeError, ValueError) as exc:  # a value of another type, transformers' checks
            raise GgufError(f"{location}: its metadata makes no gpt-oss config: {exc}") from None
        check_stored(self.config, stored, location)
        self._fused = fused_experts(stored)
        self._stored = stored

    def tensor_names(self) -> list[str]:
        return hf_tensor_names(self.config)

    def tensor(self, name: str) -> torch.Tensor | None:
        """Tensor ``name`` (a Hugging Face GptOss name) as float32; None: gpt-oss has none
        of that name (or the file, tied, stores no lm_head)."""
        parts = gguf_parts(name, self._fused)
        if parts is None or any(part not in self._tensors for part in parts.names):
            return None
        return to_hf(parts.layout, [self._dequantized(part) for part in parts.names])

    def rows(self, name: str) -> int | None:
        """The first dimension of tensor ``name``, from the file's header (no weight read)."""
        parts = gguf_parts(name, self._fused)
        if parts is None or parts.names[0] not in self._stored:
            return None
        return self._stored[parts.names[0]].shape[0]  # experts first, however stored

    def _dequantized(self, name: str) -> torch.Tensor:
        from gguf import dequantize

        stored = self._tensors[name]
        with np.errstate(over="ignore"):  # (refused below)
            values = np.array(dequantize(stored.data, stored.tensor_type), dtype=np.float32)
        values = values.reshape(self._stored[name].shape)
        if not np.isfinite(values).all():
            raise GgufError(f"{self.path}: tensor {name} ({self._stored[name].kind}) holds "
                            "values beyond float32's range (a block scale near the top of "
                            "its type's range, or a non-finite weight)")
        return torch.from_numpy(values)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor of the Hugging Face model, by name (the whole model dequantized)."""
        state = {}
        for name in self.tensor_names():
            value = self.tensor(name)
            if value is None:  # check_stored found every part: a file changed since
                raise GgufError(f"{self.path}: tensor {name} is gone from the file")
            state[name] = value
        return state

    def build_model(self) -> Any:
        """The Hugging Face GptOss model (float32, eval) of the file's config and tensors."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(self.config, dtype=torch.float32)
        state = self.state_dict()
        if self.config.tie_word_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        model.load_state_dict(state, strict=True)
        return model.eval()
