"""A paged stage's one-token graph: its graph compiled a second time with the token
dimension static at 1, which runs the stage's single-token steps (a lone stream's decode
step, with its empty padding sequences), while the dynamic graph runs every other step.

Why: the CPU plugin compiles a graph whose token dimension is dynamic with slower
FullyConnected kernels and leaves the elementwise ops around the attention (Multiply,
Add, Transpose, VariadicSplit, Reshape) unfused; the same graph with one token static
computes the same outputs, faster (docs/measurements/single-node.md). Both compiled
models take the same PagedAttention block caches (the runner binds its arrays to both
requests), so switching between them copies no KV. Sequences and blocks stay dynamic.

What it costs: the plugin keeps the second compiled model's repacked weights apart from
the first's, about another copy of the stage's weights in memory, and a second compile at
load. ``RuntimeSpec.decode_graph`` chooses: ``static`` compiles it, ``dynamic`` does not,
``auto`` compiles it when it pays and fits: the stage's layers are small (at most
``AUTO_MAX_LAYER_BYTES`` of weights each, where a step's fixed per-node costs outweigh its
bytes: SmolLM2-135M's 3 MB layers ran 1.14-1.18x faster on it, the Llama-3.2-1B shape's
48 MB layers 0.998x) and the free memory holds ``AUTO_MEMORY_FACTOR`` more copies of the
stage's weights. A compile that fails leaves the stage on its dynamic graph (logged).

Never for a stage of a mixture of experts, whatever the setting: with the token dimension
static the CPU plugin no longer turns the experts' batched MatMuls into GatherMatmuls
(the routed experts only) but computes every expert, its weights decompressed. A
Qwen3-30B-A3B-shaped stage of 2 layers, INT4, took 10.6 GB where its dynamic graph took
1.3 GB, and 183 ms a decode step against 6.3 (docs/measurements/decode.md).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import openvino as ov
import psutil

from dataplane.runtime.base import StageError
from dataplane.runtime.bound_inputs import BoundInputs

log = logging.getLogger("zctl.dataplane.runtime")
DECODE_GRAPHS = ("auto", "static", "dynamic")
# ``auto`` compiles the one-token graph when the memory free after the dynamic graph's
# compile holds this many copies of the stage's weights: one for the second compiled model,
# the rest for the KV cache, the plugin's per-shape buffers and what else runs there.
AUTO_MEMORY_FACTOR = 3
# ``auto`` compiles it only for stages whose layers average at most this many weight bytes
# (embedding and head counted in): between the sizes measured to gain and not to gain.
AUTO_MAX_LAYER_BYTES = 16 * 2**20


@dataclass
class StageGraph:
    """A compiled graph of a stage, its one infer request and the inputs bound to it."""

    compiled: ov.CompiledModel
    request: ov.InferRequest
    inputs: BoundInputs

    @classmethod
    def of(cls, compiled: ov.CompiledModel) -> StageGraph:
        request = compiled.create_infer_request()
        return cls(compiled, request, BoundInputs(request))


def weights_bytes(model: ov.Model) -> int:
    """Bytes of a model's constants: its weights, as the export's .bin holds them."""
    return sum(op.get_byte_size() for op in model.get_ops() if op.get_type_name() == "Constant")


def wants_one_token_graph(setting: str, weights: int, available: int, layers: int,
                          experts: int = 0) -> bool:
    """Whether a stage compiles its one-token graph: ``setting`` one of DECODE_GRAPHS (else
    StageError), ``weights`` the stage's weight bytes, ``available`` the free memory,
    ``layers`` its decoder layers, ``experts`` its model's experts (0: not a mixture of
    experts, the only kind that may)."""
    if setting not in DECODE_GRAPHS:
        raise StageError(f"decode_graph takes one of {', '.join(DECODE_GRAPHS)}, got "
                         f"{setting!r}")
    if experts:
        return False
    if setting == "auto":
        return (weights <= AUTO_MAX_LAYER_BYTES * max(layers, 1)
                and available >= AUTO_MEMORY_FACTOR * weights)
    return setting == "static"


def one_token_model(model: ov.Model, first: bool, rope_dim: int, last: bool) -> ov.Model:
    """A copy of a paged stage's model whose token dimension is static at 1: the main input
    ([1] ids, or [1, ?] hidden states), the RoPE rows and, on the last stage, logits_idx.

    The hidden states' width stays as dynamic as the dynamic graph has it (an export's
    stage takes ``[?, ?, ?]``): made static, the plugin fuses the stage's first RMSNorm
    into one node, which the dynamic graph computes as separate ops, and the two differ in
    the last bits."""
    shapes = {"rope_cos": [1, 1, rope_dim], "rope_sin": [1, 1, rope_dim]}
    shapes["input_ids" if first else "inputs_embeds"] = [1] if first else [1, -1]
    if last:
        shapes["logits_idx"] = [1]
    one = model.clone()
    one.reshape({name: ov.PartialShape(dims) for name, dims in shapes.items()})
    return one


def compile_one_token_graph(core: ov.Core, model: ov.Model, device: str,
                            properties: dict[str, object], stage: int, first: bool,
                            last: bool, rope_dim: int) -> StageGraph | None:
    """The one-token graph of a paged stage's ``model``, compiled as its dynamic graph was;
    None (logged) if reshaping or compiling it fails: the stage runs on its dynamic graph."""
    start = time.perf_counter()
    try:
        compiled = core.compile_model(
            one_token_model(model, first, rope_dim, last), device, properties)
    except RuntimeError as exc:
        log.warning("stage %d runs every step on its dynamic graph: its one-token graph did "
                    "not compile: %s", stage, str(exc).splitlines()[0] if str(exc) else exc)
        return None
    log.info("stage %d compiled its one-token graph in %.2f s", stage,
             time.perf_counter() - start)
    return StageGraph.of(compiled)


def available_memory() -> int:
    """Bytes of memory free for new allocations here."""
    return int(psutil.virtual_memory().available)
