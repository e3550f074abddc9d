"""A model's shape: the geometry the planner needs, and the weights and work it implies.

Pure data. Every decoder layer of a shape is the same (dense, or mixture-of-experts with
``experts`` experts of which ``active_experts`` run per token), so a layer costs the same
time and memory wherever it sits; the embedding is stage 0's, the LM head the last stage's.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from zctl.weights import decoder_layer_weights, pick_group_size


class ShapeError(ValueError):
    """A model shape cannot be read or does not make sense; the text says which field."""


@dataclass(frozen=True)
class ModelShape:
    """Layers and sizes of a decoder-only transformer (Llama-like attention, gated MLP)."""

    name: str
    num_layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool = False
    experts: int = 0  # 0: a dense MLP of ``intermediate``
    active_experts: int = 0
    expert_intermediate: int = 0
    architecture: str = "llama"
    # sliding-window attention (Gemma 3, gpt-oss): ``sliding_layers`` of the layers attend
    # to their latest ``sliding_window`` tokens only, and keep no more KV than that
    sliding_window: int = 0
    sliding_layers: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden", "heads", "kv_heads", "head_dim", "vocab"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ShapeError(f"{self.name}: {name} must be a positive integer, not {value!r}")
        for name in ("intermediate", "experts", "active_experts", "expert_intermediate",
                     "sliding_window", "sliding_layers"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ShapeError(f"{self.name}: {name} must be an integer >= 0, not {value!r}")
        if self.heads % self.kv_heads:
            raise ShapeError(f"{self.name}: {self.heads} attention heads are not a multiple of "
                             f"{self.kv_heads} KV heads")
        if self.experts:
            if not 1 <= self.active_experts <= self.experts:
                raise ShapeError(f"{self.name}: {self.active_experts} active experts of "
                                 f"{self.experts}: need 1 <= active <= experts")
            if self.expert_intermediate < 1:
                raise ShapeError(f"{self.name}: a mixture of experts needs expert_intermediate")
        elif self.intermediate < 1:
            raise ShapeError(f"{self.name}: intermediate must be a positive integer")
        if self.sliding_layers > self.num_layers or (self.sliding_layers > 0) != (
                self.sliding_window > 0):
            raise ShapeError(f"{self.name}: {self.sliding_layers} sliding layers of "
                             f"{self.num_layers} with a window of {self.sliding_window}: need "
                             "both or neither, and no more sliding layers than layers")

    @property
    def moe(self) -> bool:
        return self.experts > 0

    def fingerprint(self) -> str:
        """What profiles are keyed by: every figure that changes a layer's time or memory."""
        mlp = (f"e{self.experts}x{self.active_experts}x{self.expert_intermediate}" if self.moe
               else f"i{self.intermediate}")
        return (f"h{self.hidden}-{mlp}-a{self.heads}/{self.kv_heads}x{self.head_dim}"
                f"-v{self.vocab}")

    # -- weights ------------------------------------------------------------------------
    def attention_weights(self) -> int:
        return decoder_layer_weights(self.hidden, 0, self.heads, self.kv_heads, self.head_dim)

    def expert_weights(self) -> int:
        """One expert's gated MLP (or the dense MLP of a dense model)."""
        return 3 * self.hidden * (self.expert_intermediate if self.moe else self.intermediate)

    def router_weights(self) -> int:
        return self.hidden * self.experts

    def layer_weights(self) -> int:
        """MatMul weights one decoder layer stores (every expert of a MoE layer)."""
        if not self.moe:
            return decoder_layer_weights(self.hidden, self.intermediate, self.heads,
                                         self.kv_heads, self.head_dim)
        return self.attention_weights() + self.router_weights() + self.experts * self.expert_weights()

    def expert_weights_by_inputs(self) -> dict[int, int]:
        """A mixture of experts' weights in one layer (every expert's gate, up and down) by
        the inputs K of their MatMuls: gate and up take ``hidden``, down the expert's width;
        nothing for a dense layer."""
        if not self.moe:
            return {}
        gate_up = self.experts * 2 * self.expert_intermediate * self.hidden
        down = self.experts * self.expert_intermediate * self.hidden
        if self.expert_intermediate == self.hidden:
            return {self.hidden: gate_up + down}
        return {self.hidden: gate_up, self.expert_intermediate: down}

    def layer_weights_by_inputs(self) -> dict[int, int]:
        """``layer_weights`` by the inputs K of the MatMul each belongs to (what an INT8
        weight's scales depend on: exporter/int8_groups.py): Q/K/V, gate/up and the router
        take ``hidden`` inputs, the output projection the heads', down the MLP's."""
        attn = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        mlp = self.expert_intermediate if self.moe else self.intermediate
        copies = self.experts if self.moe else 1
        counts: dict[int, int] = {}
        for k, weights in ((self.hidden, self.hidden * (attn + 2 * kv)),
                           (attn, attn * self.hidden),
                           (self.hidden, self.hidden * self.experts),
                           (self.hidden, copies * 2 * mlp * self.hidden),
                           (mlp, copies * mlp * self.hidden)):
            if weights:
                counts[k] = counts.get(k, 0) + weights
        return counts

    def active_layer_weights(self) -> int:
        """Weights one token multiplies in a layer (multiply-accumulates per token)."""
        if not self.moe:
            return self.layer_weights()
        return (self.attention_weights() + self.router_weights()
                + self.active_experts * self.expert_weights())

    def layer_weights_read(self, tokens: float) -> float:
        """Weights a step of ``tokens`` rows reads from memory in one layer: all of a dense
        layer; of a MoE layer the attention, the router and the experts the rows route to
        (expected distinct experts when each row picks ``active_experts`` at random)."""
        if not self.moe:
            return float(self.layer_weights())
        miss = (1.0 - self.active_experts / self.experts) ** max(1.0, tokens)
        touched = self.experts * (1.0 - miss)
        return self.attention_weights() + self.router_weights() + touched * self.expert_weights()

    def embedding_weights(self) -> int:
        """The token embedding, and as many again in the LM head (tied or not: each stage
        shard keeps its own copy)."""
        return self.vocab * self.hidden

    def parameters(self) -> int:
        head = 0 if self.tied_embeddings else self.embedding_weights()
        return self.num_layers * self.layer_weights() + self.embedding_weights() + head

    def group_size(self) -> int:
        """The INT4 group size an export of this shape uses (the largest that fits)."""
        mlp = self.expert_intermediate if self.moe else self.intermediate
        return pick_group_size([self.hidden, self.heads * self.head_dim, mlp])

    # -- attention and the wire -----------------------------------------------------------
    def attention_macs_per_past(self) -> int:
        """Multiply-accumulates one token spends per earlier token in one layer (scores and
        the weighted sum over the values)."""
        return 2 * self.heads * self.head_dim

    def kv_bytes_per_token(self, bytes_per_value: float) -> float:
        """KV cache one token keeps in one layer (keys and values)."""
        return 2 * self.kv_heads * self.head_dim * bytes_per_value

    def kv_tokens_per_layer(self, context: int, sliding_kept: int) -> float:
        """Tokens of KV a layer keeps of a ``context``-token stream, on average over the
        layers: a global layer every token, a sliding one at most ``sliding_kept`` (its
        window and what the runtime keeps beyond it)."""
        kept = min(context, sliding_kept) if self.sliding_layers else context
        return (context * (self.num_layers - self.sliding_layers)
                + kept * self.sliding_layers) / self.num_layers

    def describe(self) -> str:
        mlp = (f"{self.experts} experts ({self.active_experts} active) of "
               f"{self.expert_intermediate}" if self.moe else f"MLP {self.intermediate}")
        sliding = (f", {self.sliding_layers} sliding over {self.sliding_window} tokens"
                   if self.sliding_layers else "")
        return (f"{self.num_layers} layers{sliding}, hidden {self.hidden}, {mlp}, "
                f"{self.heads} heads ({self.kv_heads} KV) of {self.head_dim}, "
                f"vocabulary {self.vocab}")

    def as_dict(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
