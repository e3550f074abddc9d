"""RuntimeSpec: the settings every stage of a cluster compiles with (no OpenVINO here).

One definition for the runners (which turn it into compile properties), the control
plane (whose messages carry it to every node: its fields are part of the wire schema)
and the launcher and command line (which build it from their options).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

DEVICES = ("CPU", "GPU", "NPU", "AUTO")


@dataclass(frozen=True)
class RuntimeSpec:
    """Explicit compile properties, so benchmarks compare like with like."""

    device: str = "CPU"
    precision: str | None = "f32"  # INFERENCE_PRECISION_HINT; None keeps the plugin default
    num_threads: int | None = None
    performance_hint: str = "LATENCY"
    kv_cache_precision: str | None = None  # e.g. "f32", "u8"; None keeps the plugin default
    # False: no dynamic quantization of activations (DYNAMIC_QUANTIZATION_GROUP_SIZE 0 on
    # CPU). The CPU plugin quantizes the inputs of INT4/INT8-compressed matmuls to int8 on
    # AVX-512-VNNI/AMX machines, in ways that depend on where a graph is cut: there an INT4
    # 3-stage chain diverged from the 1-stage export within 48 tokens with it on and
    # matched with it off. Off costs ~30% of decode speed; exact comparisons turn it off.
    # On an INT4 export the activations are quantized in groups of the weights' group size
    # (``properties(int4_group=...)``), not the plugin's 32: 5-10% faster decode steps, the
    # same teacher-forced quality (docs/measurements/single-node.md); INT8 exports keep
    # 32 (64 raised their KL to fp32 by 28% on SmolLM2).
    dynamic_quantization: bool = True
    # True: run a stateful export's stages on PagedAttention (dataplane.runtime.paged):
    # KV in blocks, every stream its own sequence of one batched inference (CPU only).
    paged_attention: bool = False

    # Not dataclass fields (the control messages carry the fields only); a subclass may
    # override them, e.g. to benchmark other settings (tools/bench_parity does).
    # ENABLE_CPU_PINNING on CPU devices; None keeps the plugin default (YES on Linux), the
    # same as openvino_genai. With synchronous infer() pinning cost 2-10% per decode step on
    # 2 busy shared cores; with start_async()+wait() pinned and unpinned were within noise.
    cpu_pinning: ClassVar[bool | None] = None
    # Step with start_async() + wait(), so the plugin runs the graph on its own stream thread
    # (as openvino_genai's decode loop does), not a synchronous infer() on the calling
    # thread: 6% (1 stage) and 11% (2 stages) faster per decode step here, step-by-step
    # interleaved A/B on the same export, faster in every paired run.
    async_infer: ClassVar[bool] = True
    # CPU_RUNTIME_CACHE_CAPACITY on CPU devices: the plugin keeps a compiled primitive per
    # operation and input shape, 5,000 by default, and a paged stage's ragged steps change
    # shape with their rows' token and block counts, so a serving stage's memory grows with
    # every new prompt length until the cap (both stages in one process: +1,035 MB after
    # 320 token counts, +740 MB with 1,000 entries). 1,000 served 8 and 16 clients as fast
    # as the default (docs/measurements.md, "Soak"). None keeps the plugin's default.
    runtime_cache_capacity: ClassVar[int | None] = 1000
    # A paged stage's decode step (every sequence feeding one token) with fewer sequences
    # than the stage has threads gets empty padding sequences (no token, no past) up to
    # that many. The CPU plugin's PagedAttention computes such a step on its own path (it
    # splits each sequence's attention along the past over the threads) and every other
    # step on its mixed path; the two differ in the last bits past one KV block, and int8
    # activations make other tokens of that, so a stream's tokens depended on how many
    # others shared its steps. Padded, every step takes the mixed path: a row computes
    # alike alone or in any row group, at no measurable cost (an empty sequence adds no
    # row to any matmul; docs/measurements/repeatability.md).
    pad_decode_steps: ClassVar[bool] = True
    # KEY_CACHE_QUANT_MODE BY_TOKEN on CPU devices whose KV cache is u8 (the plugin's
    # default, kv_cache_precision None, or "u8"): each key is quantized with a scale and
    # zero point of its own, as values are. The plugin's paged cache otherwise quantizes
    # keys per channel over the tokens written into a 32-token block at once, so a block
    # written in two steps held other keys than one written in one: a prompt's tokens
    # depended on where its prefill was cut, and a verification step's (several tokens
    # written at once) on the step. By token, every cut of pieces of two tokens or more
    # computes the same KV and logits, and a one-query verification step the same as
    # single decode steps (the stateful runner's cache is by token already). On SmolLM2
    # it holds 5% less KV a token and decodes as fast; its quality against an f32 cache
    # is per-channel keys' within a point of top-1 agreement
    # (docs/measurements/repeatability.md).
    key_cache_by_token: ClassVar[bool] = True
    # Which graph runs a paged stage's single-token steps (dataplane.runtime.one_token):
    # "static" compiles the stage a second time with its token dimension static at 1 and
    # runs them on it (the same outputs, faster: the plugin's dynamic-shape pipeline leaves
    # ops unfused and its matmul kernels slower), "dynamic" runs every step on the one
    # dynamic graph, "auto" compiles the second graph when the free memory holds three more
    # copies of the stage's weights (the plugin keeps each compiled model's repacked
    # weights apart). Both graphs share the block caches; stateful stages (KV as state
    # inside each request) run the dynamic graph only.
    decode_graph: ClassVar[str] = "auto"
    # Tokens a paged stage's sliding-window layers keep beyond their window
    # (dataplane.runtime.kv.blocks.SlidingWindow): the deepest rewind the engine asks for,
    # pipelined speculation's runs in flight of the most drafts each (zctl.engine's
    # DEPTH_MAX x (MAX_DRAFT_TOKENS + 1), 16 x 33: a test holds them equal, this module
    # importing neither the engine nor openvino). A deeper rewind is refused (the keys
    # before it are gone).
    sliding_margin: ClassVar[int] = 528
    # Slots a stateful stage's sliding-window layers let their states grow by beyond their
    # window and margin before they are trimmed from the front, a copy of what they keep
    # (dataplane.runtime.kv.sliding_states): the copy is paid once every so many tokens.
    sliding_slack: ClassVar[int] = 256

    @property
    def exact(self) -> bool:
        """f32 activations and an f32 KV cache: speculative output equals greedy."""
        return (self.precision == "f32" and self.kv_cache_precision == "f32"
                and not self.dynamic_quantization)

    @property
    def u8_kv_cache(self) -> bool:
        """Whether the KV cache is u8: the CPU plugin's default, or asked for."""
        return self.kv_cache_precision in (None, "u8")

    def properties(self, int4_group: int | None = None) -> dict[str, Any]:
        """The OpenVINO compile properties these settings give; ``int4_group``: the INT4
        group size of the stage compiled (None for other weight formats), the group size of
        its dynamic quantization on CPU (when on, and a multiple of the plugin's 16)."""
        props: dict[str, Any] = {"PERFORMANCE_HINT": self.performance_hint}
        if self.precision:
            props["INFERENCE_PRECISION_HINT"] = self.precision
        if self.num_threads:
            props["INFERENCE_NUM_THREADS"] = int(self.num_threads)
        if self.kv_cache_precision:
            props["KV_CACHE_PRECISION"] = self.kv_cache_precision
        if self.key_cache_by_token and self.u8_kv_cache and device_kind(self) == "CPU":
            props["KEY_CACHE_QUANT_MODE"] = "BY_TOKEN"
        if not self.dynamic_quantization and device_kind(self) == "CPU":
            props["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = 0
        elif int4_group and int4_group % 16 == 0 and device_kind(self) == "CPU":
            props["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = int(int4_group)
        if self.cpu_pinning is not None and device_kind(self) == "CPU":
            props["ENABLE_CPU_PINNING"] = bool(self.cpu_pinning)
        if self.runtime_cache_capacity is not None and device_kind(self) == "CPU":
            props["CPU_RUNTIME_CACHE_CAPACITY"] = int(self.runtime_cache_capacity)
        return props


def device_kind(spec: RuntimeSpec) -> str:
    """The plugin of ``spec.device``: "GPU" for "GPU.1", "NPU" for "NPU:0"."""
    return spec.device.split(":")[0].split(".")[0]
