"""The decoder families the exporter handles, and what sets each apart from Llama.

Every family runs through the one stage module (exporter.stage_module), which reads
tensors by Hugging Face Llama names. A family says how its checkpoint maps onto those
names (Phi-3 stores Q/K/V and gate/up fused), which extra tensors its layers carry
(Qwen3's per-head RMSNorm on queries and keys), how long a context the export reproduces
exactly (a sliding window over every layer caps it), how its layers differ (Gemma 3's
norms, GeGLU MLP, scaled embedding, and sliding-window layers turning with RoPE
frequencies of their own, Qwen3-MoE's sparse mixture-of-experts layers, gpt-oss's
attention sinks, alternating sliding windows and clamped-SwiGLU experts), and which
options of its config the stage module does not implement: a model using one is refused,
naming the option, never exported wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from exporter.gpt_oss_moe_block import ClampedSwiGLU
from exporter.multimodal import TEXT_MODELS

ATTENTION, MLP = "self_attn.", "mlp."


class FamilyError(ValueError):
    """The model is of no supported family, or uses an option its family's export lacks."""


@dataclass(frozen=True)
class FusedPart:
    """Rows [start, stop) of the checkpoint tensor ``name`` of ``rows`` rows (a part of a
    fused projection)."""

    name: str
    start: int
    stop: int
    rows: int


@dataclass(frozen=True)
class Family:
    architecture: str  # the Hugging Face class, as in config.json's "architectures"
    model_type: str
    qk_norm: bool = False  # an RMSNorm over each query and key head, before RoPE (Qwen3)
    fused_checkpoint: bool = False  # qkv_proj and gate_up_proj stored fused (Phi-3)
    # True: sliding_window, when set, applies to every layer (Mistral, Phi-3): every layer
    # is a sliding layer, when the window is shorter than the context. False:
    # use_sliding_window turns a window on for some layers (Qwen2, Qwen3), which the stage
    # module does not implement.
    window_on_every_layer: bool = False
    # Gemma 3: RMSNorm weights applied as (1 + weight), norms after attention and the MLP
    # as well as before them, the embedding scaled by sqrt(hidden_size), a GeGLU MLP, an
    # attention scale of query_pre_attn_scalar ** -0.5, and layer_types interleaving
    # sliding-window layers (their own RoPE base) with global ones.
    gemma: bool = False
    # Qwen3-MoE: the MLP of the layers decoder_sparse_step and mlp_only_layers choose is a
    # sparse mixture of SwiGLU experts (a router, softmax, top-k, optionally renormalised)
    moe: bool = False
    # Phi-3: RoPE may turn only the first head_dim * partial_rotary_factor dimensions of
    # each head (Phi-4-mini), and may be LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini)
    phi3_rope: bool = False
    # gpt-oss: attention sinks (a learned logit per head in every softmax), biases on the
    # attention's projections, layer_types alternating sliding-window and full layers (one
    # RoPE table), and every layer's MLP a mixture of experts: a biased router, a softmax
    # over the top-k logits, clamped-SwiGLU experts with biases (exporter.gpt_oss_moe_block)
    gpt_oss: bool = False

    @property
    def has_experts(self) -> bool:
        """Its layers may hold a mixture of experts (whose weights the checkpoint stacks)."""
        return self.moe or self.gpt_oss

    @property
    def layer_tensors(self) -> tuple[str, ...]:
        """Tensors every layer must store beyond Llama's (names under ``model.layers.{i}.``),
        biases among them: a checkpoint lacking one is refused before a stage is written."""
        if not self.gpt_oss:
            return ()
        return (ATTENTION + "sinks", MLP + "router.weight", MLP + "router.bias",
                MLP + "experts.gate_up_proj", MLP + "experts.gate_up_proj_bias",
                MLP + "experts.down_proj", MLP + "experts.down_proj_bias")

    def fused_part(self, name: str, q_rows: int, kv_rows: int, mlp_rows: int
                   ) -> FusedPart | None:
        """Where the Llama-named tensor ``name`` (``...self_attn.k_proj.weight``) lies in
        this family's checkpoint when it is part of a fused one; None when it is stored
        under its own name. Rows: a query, key and MLP projection's output sizes."""
        if not self.fused_checkpoint:
            return None
        prefix, _, leaf = name.rpartition(".")  # leaf: weight or bias
        layer, _, projection = prefix.rpartition(".")
        qkv, gate_up = ("qkv_proj", q_rows + 2 * kv_rows), ("gate_up_proj", 2 * mlp_rows)
        parts = {  # Llama's projection: its fused tensor, and its rows there
            "q_proj": (qkv, 0, q_rows),
            "k_proj": (qkv, q_rows, q_rows + kv_rows),
            "v_proj": (qkv, q_rows + kv_rows, q_rows + 2 * kv_rows),
            "gate_proj": (gate_up, 0, mlp_rows),
            "up_proj": (gate_up, mlp_rows, 2 * mlp_rows),
        }
        if projection not in parts:
            return None
        (fused, rows), start, stop = parts[projection]
        return FusedPart(f"{layer}.{fused}.{leaf}", start, stop, rows)

    def shape_options(self, config: Any) -> dict[str, Any]:
        """The fields of the stage module's DecoderShape by which this family's layers
        differ from Llama's (the sizes are every family's)."""
        options: dict[str, Any] = {"qk_norm": self.qk_norm}
        window = self.every_layer_window(config)
        if window:
            options.update(sliding_window=window,
                           sliding_layers=tuple(range(int(config.num_hidden_layers))))
        if self.phi3_rope:
            return {**options, "rotary_dim": rotary_dim(config)}
        if self.moe:
            return {**options, **_moe_options(config)}
        if self.gpt_oss:
            return {**options, **_gpt_oss_options(config)}
        if not self.gemma:
            return options
        sliding = tuple(i for i, kind in enumerate(config.layer_types)
                        if kind == "sliding_attention")
        return {**options, "norm_plus_one": True, "sandwich_norms": True,
                "activation": "gelu_tanh", "embed_scale": float(config.hidden_size) ** 0.5,
                "attention_scale": float(config.query_pre_attn_scalar) ** -0.5,
                "sliding_window": int(config.sliding_window) if sliding else 0,
                "sliding_layers": sliding, "local_rope": bool(sliding)}

    def every_layer_window(self, config: Any) -> int:
        """The window of a family whose ``sliding_window`` applies to every layer, when it
        is shorter than the context (0: none, or one that never slides)."""
        window = int(getattr(config, "sliding_window", 0) or 0) if self.window_on_every_layer else 0
        context = int(getattr(config, "max_position_embeddings", 0) or 0)
        return window if window and (not context or window < context) else 0

    def context_length(self, config: Any) -> int:
        """How many tokens of context the export reproduces exactly (0: not stated): every
        position the model has, its sliding layers' windows sliding beyond their length."""
        context = int(getattr(config, "max_position_embeddings", 0) or 0)
        return context or self.every_layer_window(config)


FAMILIES = (
    Family("LlamaForCausalLM", "llama"),
    Family("MistralForCausalLM", "mistral", window_on_every_layer=True),
    Family("Qwen2ForCausalLM", "qwen2"),
    Family("Qwen3ForCausalLM", "qwen3", qk_norm=True),
    Family("Phi3ForCausalLM", "phi3", fused_checkpoint=True, window_on_every_layer=True,
           phi3_rope=True),
    Family("Gemma3ForCausalLM", "gemma3_text", qk_norm=True, gemma=True),
    Family("Qwen3MoeForCausalLM", "qwen3_moe", qk_norm=True, moe=True),
    Family("GptOssForCausalLM", "gpt_oss", gpt_oss=True),
)
SUPPORTED_ARCHITECTURES = {family.architecture: family.model_type for family in FAMILIES}


def family_of(config: Any, location: str) -> Family:
    """The family of a transformers config (by its architectures, else its model_type)."""
    arches = getattr(config, "architectures", None) or []
    model_type = getattr(config, "model_type", None)
    for family in FAMILIES:
        if family.architecture in arches:
            return family
    for family in FAMILIES:
        if family.model_type == model_type:
            return family
    raise FamilyError(
        f"{location}: model type {model_type or '?'!r} "
        f"({', '.join(arches) or 'no architectures'}) is not supported; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)} (and the text model of "
        f"{', '.join(TEXT_MODELS)})"
    )


def sparse_layers(config: Any) -> tuple[int, ...]:
    """The layers (global indices) whose MLP is a mixture of experts, as Hugging Face's
    Qwen3-MoE chooses them: every decoder_sparse_step-th layer but mlp_only_layers."""
    experts = int(getattr(config, "num_experts", 0) or 0)
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    if experts < 1:
        return ()
    return tuple(i for i in range(int(config.num_hidden_layers))
                 if i not in dense and (i + 1) % step == 0)


def _moe_options(config: Any) -> dict[str, Any]:
    sparse = sparse_layers(config)
    if not sparse:
        return {}
    return {"experts": int(config.num_experts), "active_experts": int(config.num_experts_per_tok),
            "expert_intermediate": int(config.moe_intermediate_size),
            "norm_topk_prob": bool(getattr(config, "norm_topk_prob", False)),
            "sparse_layers": sparse}


def _gpt_oss_options(config: Any) -> dict[str, Any]:
    sliding = tuple(i for i, kind in enumerate(config.layer_types) if kind == "sliding_attention")
    return {"attention_sinks": True,
            "sliding_window": int(config.sliding_window) if sliding else 0,
            "sliding_layers": sliding,
            "experts": int(config.num_local_experts),
            "active_experts": int(config.num_experts_per_tok),
            "expert_intermediate": int(config.intermediate_size),
            "sparse_layers": tuple(range(int(config.num_hidden_layers))),
            "clamped_swiglu": ClampedSwiGLU(float(config.swiglu_alpha),
                                            float(config.swiglu_limit))}


def stored_experts(names: Iterable[str], layer: int) -> set[int]:
    """The experts of ``layer`` stored one by one (``...mlp.experts.{e}.gate_proj.weight``)."""
    prefix = f"model.layers.{layer}.mlp.experts."
    found = set()
    for name in names:
        if name.startswith(prefix):
            head = name[len(prefix):].split(".", 1)[0]
            if head.isdigit():
                found.add(int(head))
    return found


def _rope_parameters(config: Any) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    return params if isinstance(params, dict) else {}


def rotary_dim(config: Any) -> int:
    """How many dimensions of each head Hugging Face's Phi-3 turns: head_dim times
    partial_rotary_factor (0: the whole head)."""
    factor = float(_rope_parameters(config).get("partial_rotary_factor", 1.0) or 1.0)
    if factor == 1.0:
        return 0
    head_dim = int(getattr(config, "head_dim", None)
                   or config.hidden_size // config.num_attention_heads)
    return int(head_dim * factor)


def _sliding_layers(config: Any) -> list[str]:
    """use_sliding_window's complaint, if it turns a window on for some layer."""
    layer_types = getattr(config, "layer_types", None) or []
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in layer_types:
        return ["use_sliding_window is true (a sliding window on some layers)"]
    return []


def _activation(config: Any) -> list[str]:
    act = getattr(config, "hidden_act", "silu")
    return [] if act == "silu" else [f"hidden_act is {act!r} (the MLP is SiLU-gated)"]


def _rope_type(config: Any) -> list[str]:
    params = _rope_parameters(config)
    rope_type = params.get("rope_type", "default")
    if rope_type == "dynamic":
        return ["rope_type 'dynamic' (its frequencies depend on the sequence length)"]
    if rope_type == "longrope":
        return ["rope_type 'longrope' (the export implements it as Hugging Face's Phi-3 "
                "does, for Phi-3 models)"]
    factor = float(params.get("partial_rotary_factor", 1.0) or 1.0)
    if factor != 1.0:
        return [f"partial_rotary_factor {factor} (RoPE turns the whole of each head)"]
    return []


PHI3_ROPE_TYPES = ("default", "longrope")


def _phi3_rope(config: Any) -> list[str]:
    """Phi-3's RoPE: default or LongRoPE, over the whole head or its first rotary_dim
    dimensions (an even number of them, at least 2)."""
    params = _rope_parameters(config)
    complaints = []
    rope_type = params.get("rope_type", "default")
    if rope_type not in PHI3_ROPE_TYPES:
        complaints.append(f"rope_type {rope_type!r} (it may be "
                          f"{' or '.join(map(repr, PHI3_ROPE_TYPES))})")
    rotated = rotary_dim(config)
    if rotated and (rotated < 2 or rotated % 2):
        factor = params.get("partial_rotary_factor")
        complaints.append(f"partial_rotary_factor {factor} (head_dim x factor = {rotated}: "
                          "RoPE turns pairs of dimensions, at least one)")
    return complaints


GEMMA_LAYER_TYPES = ("sliding_attention", "full_attention")
GEMMA_ROPE_TYPES = {"sliding_attention": ("default",), "full_attention": ("default", "linear")}


def _gemma_activation(config: Any) -> list[str]:
    act = getattr(config, "hidden_activation", None)
    return [] if act == "gelu_pytorch_tanh" else [
        f"hidden_activation {act!r} (the MLP is GeGLU with gelu_pytorch_tanh)"]


def _gemma_layers(config: Any) -> list[str]:
    complaints = [f"layer type {kind!r} (layers are {' or '.join(GEMMA_LAYER_TYPES)})"
                  for kind in sorted(set(getattr(config, "layer_types", None) or []))
                  if kind not in GEMMA_LAYER_TYPES]
    if getattr(config, "use_bidirectional_attention", False):
        complaints.append("use_bidirectional_attention (attention is causal)")
    for option in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, option, None) is not None:
            complaints.append(f"{option} {getattr(config, option)} (no softcapping)")
    return complaints


def _gemma_rope(config: Any) -> list[str]:
    params = _rope_parameters(config)
    complaints = []
    for layer_type, allowed in GEMMA_ROPE_TYPES.items():
        layer = params.get(layer_type) or {}
        rope_type = layer.get("rope_type", "default")
        if rope_type not in allowed:
            complaints.append(f"{layer_type} rope_type {rope_type!r} (it may be "
                              f"{' or '.join(map(repr, allowed))})")
        factor = float(layer.get("partial_rotary_factor", 1.0) or 1.0)
        if factor != 1.0:
            complaints.append(f"{layer_type} partial_rotary_factor {factor} "
                              "(RoPE turns the whole of each head)")
    return complaints


def _moe_routing(config: Any) -> list[str]:
    experts = int(getattr(config, "num_experts", 0) or 0)
    active = int(getattr(config, "num_experts_per_tok", 0) or 0)
    step = getattr(config, "decoder_sparse_step", 1)
    complaints = []
    if experts < 0:
        complaints.append(f"num_experts {experts}")
    if experts > 0 and not 1 <= active <= experts:
        complaints.append(f"num_experts_per_tok {active} (a token routes to 1 to num_experts "
                          f"= {experts} experts)")
    if step is None or int(step) < 1:
        complaints.append(f"decoder_sparse_step {step} (every n-th layer, n >= 1)")
    return complaints


def _gpt_oss_layers(config: Any) -> list[str]:
    kinds = list(getattr(config, "layer_types", None) or [])
    complaints = [f"layer type {kind!r} (layers are {' or '.join(GEMMA_LAYER_TYPES)})"
                  for kind in sorted(set(kinds)) if kind not in GEMMA_LAYER_TYPES]
    if len(kinds) != int(config.num_hidden_layers):
        complaints.append(f"{len(kinds)} layer_types for {config.num_hidden_layers} layers")
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" in kinds and (window is None or int(window) < 1):
        complaints.append(f"sliding layers with sliding_window {window}")
    return complaints


def _gpt_oss_experts(config: Any) -> list[str]:
    experts = int(getattr(config, "num_local_experts", 0) or 0)
    active = int(getattr(config, "num_experts_per_tok", 0) or 0)
    limit = getattr(config, "swiglu_limit", None)
    complaints = []
    if experts < 1:
        complaints.append(f"num_local_experts {experts} (every layer is a mixture of experts)")
    elif not 1 <= active <= experts:
        complaints.append(f"num_experts_per_tok {active} (a token routes to 1 to "
                          f"num_local_experts = {experts} experts)")
    if limit is None or float(limit) <= 0:
        complaints.append(f"swiglu_limit {limit} (the experts clamp to a positive limit)")
    return complaints


LLAMA_CHECKS: tuple[Callable[[Any], list[str]], ...] = (_activation, _rope_type)
FAMILY_CHECKS: dict[str, tuple[Callable[[Any], list[str]], ...]] = {
    "qwen2": LLAMA_CHECKS + (_sliding_layers,),
    "qwen3": LLAMA_CHECKS + (_sliding_layers,),
    "qwen3_moe": LLAMA_CHECKS + (_sliding_layers, _moe_routing),
    "gemma3_text": (_gemma_activation, _gemma_layers, _gemma_rope),
    "gpt_oss": (_rope_type, _gpt_oss_layers, _gpt_oss_experts),
    "phi3": (_activation, _phi3_rope),
}


def refuse_unsupported(family: Family, config: Any, location: str) -> None:
    """FamilyError naming every option of ``config`` the export does not implement."""
    complaints = [c for check in FAMILY_CHECKS.get(family.model_type, LLAMA_CHECKS)
                  for c in check(config)]
    if complaints:
        raise FamilyError(f"{location}: {family.model_type} with {'; '.join(complaints)} "
                          "is not supported by the exporter")
