"""PagedStageRunner: a stateful export's stage run on PagedAttention, its KV in blocks.

At load, OpenVINO's SDPA-to-PagedAttention pass turns the stage's stateful attention into
PagedAttention over one block cache per layer, which this runner allocates and binds
once (``dataplane.runtime.kv.blocks`` keeps the tables). Every stream, and every row of a row group,
is a sequence of its own: one inference steps any mix of them, each with its own past
length, so a row group is only a list of members (no KV is copied to form one), a
rewind only shortens a sequence, and a cached prefix shares its blocks. A one-query step
(``one_query``: a verification step's last token and drafts, a replay's emitted tokens)
makes each token a sequence of its own, of one token, sharing its stream's block table
with the past up to it: the plugin writes every token's KV before it computes any
attention, so token i attends to the ones before it as if decode steps had fed them one
at a time, and computes bit for bit what they would (with by-token keys:
``RuntimeSpec.key_cache_by_token``; docs/measurements/repeatability.md). The CPU plugin's
PagedAttention computes a multi-token step over a past with matrix kernels, where the
stateful graph's fused attention takes its one-query-at-a-time path: a 256-token chunk
over a 1,792-token past measured 4-8x faster (SmolLM2, 2 cores); decode costs the same.

Steps of one token (a lone stream's decode steps) run on a second compiled graph whose
token dimension is static, over the same block caches, where ``RuntimeSpec.decode_graph``
asks for it (dataplane.runtime.one_token): the same outputs, faster.

A sliding-window layer (Gemma 3's) keeps only the blocks of its window and a margin:
its layers' caches are a second block pool, each sequence a second block table
(``dataplane.runtime.kv.blocks``: ``SlidingWindow``), bound to those layers' own
``block_indices.N`` inputs (the pass's per-layer block tables); the blocks before the
window and margin go back to that pool after every step.

The pass's model cannot be saved as IR (its op is an extension), so it runs at every load
(~0.3-0.5 s on SmolLM2). The attention is causal over each sequence's slots: there are
no masked slots, so nothing is ever compacted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import numpy as np
import openvino as ov
from openvino import opset13 as ops

from dataplane.runtime import rewind
from dataplane.runtime.base import (
    StageError,
    check_ragged_step,
    check_row_rewinds,
    check_rows_step,
    check_step_input,
)
from dataplane.runtime.bound_inputs import BoundInputs
from dataplane.runtime.config import RuntimeSpec, device_kind
from dataplane.runtime.hugepages import HugePageScope
from dataplane.runtime.kv.blocks import (
    BlockPool,
    KvLayout,
    PagedSequence,
    PrefixBlocks,
    SlidingWindow,
    blocks_for,
    window_table,
)
from dataplane.runtime.kv.rows import find_row
from dataplane.runtime.one_token import (
    StageGraph,
    available_memory,
    compile_one_token_graph,
    wants_one_token_graph,
    weights_bytes,
)
from dataplane.runtime.ov_core import shared_core
from dataplane.runtime.rope import LongSequences, StageRopeRows, stage_rope
from dataplane.runtime.startup import int4_group, open_stage, warm_up_steps, zero_input
from dataplane.runtime.step_shapes import (
    LARGE,
    SMALL,
    ShapeKeeper,
    bucket_pad,
    measure_padding_limit,
)
from zctl.manifest import ExportManifest, verify_export_files

log = logging.getLogger("zctl.dataplane.runtime")
INITIAL_BLOCKS = 256  # the cache doubles when it runs out
WINDOW_STREAMS = 4  # streams whose sliding layers' blocks the initial pool holds
CACHE_TYPES = {ov.Type.u8: np.uint8, ov.Type.i8: np.int8, ov.Type.f32: np.float32,
               ov.Type.f16: np.float16, ov.Type.bf16: np.uint16}


# PagedAttentionExtension's inputs: q, k, v, key cache, value cache, past_lens,
# subsequence_begins, block_indices, ..., sliding_window
KEY_CACHE_INPUT, VALUE_CACHE_INPUT, BLOCK_INDICES_INPUT, SLIDING_WINDOW_INPUT = 3, 4, 7, 10


def _slide_windows(model: ov.Model, windows: list[int]) -> None:
    """Give each sliding layer's PagedAttention its window (``windows``: the stage's layers'
    in order, 0 for a global layer): the pass drops the stage's mask, where the window
    was, and leaves every PagedAttention attending to the whole sequence."""
    attention = [op for op in model.get_ordered_ops()
                 if op.get_type_name() == "PagedAttentionExtension"]
    if len(attention) != len(windows):
        raise StageError(f"PagedAttention made {len(attention)} attentions of "
                         f"{len(windows)} layers")
    for op, window in zip(attention, windows, strict=True):  # in layer order: each feeds the next
        if window:
            op.input(SLIDING_WINDOW_INPUT).replace_source_output(
                ops.constant(np.array(window, dtype=np.int32)).output(0))


def paged_model(model: ov.Model, first: bool, last: bool, hidden_size: int,
                windows: list[int] | None = None) -> ov.Model:
    """The stage's model with PagedAttention in place of its stateful attention
    (``windows``: each layer's sliding window, 0 for none; None: no layer slides)."""
    from openvino._offline_transformations import paged_attention_transformation

    main = "input_ids" if first else "inputs_embeds"
    model.inputs[0].get_tensor().set_names({main})  # the pass looks for these names
    model.inputs[0].get_node().set_friendly_name(main)
    # sliding layers: a block table input per layer (block_indices.N), the sliding layers'
    # tables lacking the blocks before their window
    paged_attention_transformation(model, use_block_indices_inputs=bool(windows and any(windows)))
    for param in model.get_parameters():  # RoPE comes in as cos/sin: positions are unused
        if param.get_friendly_name() == "position_ids" and not param.output(0).get_target_inputs():
            model.remove_parameter(param)
    if windows is not None and any(windows):
        _slide_windows(model, windows)
    if last:  # tokens are the batch axis now: let logits_idx index the flat token list
        for op in model.get_ordered_ops():
            if op.get_type_name() == "Gather" and "logits_idx" in op.input_value(1).get_names():
                flat = ops.reshape(op.input_value(0),
                                   ops.constant(np.array([1, -1, hidden_size], np.int64)), False)
                op.input(0).replace_source_output(flat.output(0))
                break
        else:
            raise StageError("the last stage has no logits_idx Gather to index the tokens by")
    model.validate_nodes_and_infer_types()
    if any(op.get_type_name() in ("ReadValue", "Assign") for op in model.get_ordered_ops()):
        raise StageError("PagedAttention did not replace every KV state of the stage")
    return model


class PagedLayer(NamedTuple):
    """One layer's PagedAttention inputs: its caches, its block table, its window (0: none)."""

    key_cache: str
    value_cache: str
    table: str
    window: int


def paged_layers(model: ov.Model) -> list[PagedLayer]:
    """The layers of a paged model, in order, by the inputs their PagedAttention reads."""
    layers = []
    for op in model.get_ordered_ops():
        if op.get_type_name() == "PagedAttentionExtension":
            window = op.input_value(SLIDING_WINDOW_INPUT).get_node()
            layers.append(PagedLayer(
                *(op.input_value(i).get_node().get_friendly_name()
                  for i in (KEY_CACHE_INPUT, VALUE_CACHE_INPUT, BLOCK_INDICES_INPUT)),
                int(window.get_data()) if window.get_type_name() == "Constant" else 0))
    return layers


@dataclass
class LayerCaches:
    """The block caches of the layers one block pool serves (the global layers', or the
    sliding ones'): each cache holds the pool's blocks, then the padding's scratch block
    (id ``capacity``) and a block never written (id ``capacity + 1``), which the freed
    entries of a sliding layer's table point to."""

    pool: BlockPool
    ports: list[Any]  # the layers' key and value cache inputs
    tables: list[str]  # the layers' block table inputs
    arrays: list[np.ndarray] = field(default_factory=list)

    @property
    def scratch(self) -> int:
        return self.pool.capacity

    @property
    def unwritten(self) -> int:
        return self.pool.capacity + 1

    @property
    def block_bytes(self) -> int:
        return sum(a[0].nbytes for a in self.arrays)

    @property
    def bytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


@dataclass
class PagedGroup:
    """A row group: its members' sequences, stepped as the sequences of one inference."""

    members: list[int]
    seqs: list[PagedSequence]

    @property
    def keep(self) -> np.ndarray:  # its rows' slots one after another (they are ragged)
        return np.ones(sum(s.physical for s in self.seqs), dtype=bool)

    @property
    def held(self) -> int:
        """KV slots its rows hold, averaged over the stage's layers (PagedSequence.held)."""
        return sum(s.held for s in self.seqs)


class AttentionSequences(NamedTuple):
    """A step's sequences as PagedAttention computes them: past lengths, token counts and
    block tables."""

    pasts: list[int]
    counts: list[int]
    tables: list[list[int]]
    window_tables: list[list[int]]  # the sliding layers' (empty lists: no sliding layer)


@dataclass(frozen=True)
class PagedStep:
    """One step's bound inputs but x: the sequences it steps, how many tokens each, and
    the output's leading shape (rows and answers per row, or 1 and all of a ragged step's)."""

    seqs: list[PagedSequence]
    counts: list[int]  # tokens per sequence
    out_shape: tuple[int, int]
    graph: StageGraph  # the graph it runs on: the one-token graph for a step of one token
    pad: int = 0  # padding tokens after the real ones (dataplane.runtime.step_shapes)


class PagedStageRunner:
    """Stage ``index`` of a stateful export on PagedAttention (a ``StageRuntime``)."""

    row_groups_supported: ClassVar[bool] = True
    prefix_cache_supported: ClassVar[bool] = True
    paged_attention: ClassVar[bool] = True
    one_query_supported: ClassVar[bool] = True

    def __init__(self, export_dir: Path | str, index: int, config: RuntimeSpec | None = None,
                 manifest: ExportManifest | None = None, core: ov.Core | None = None,
                 verify: bool = True, blocks: int = INITIAL_BLOCKS,
                 graph: ov.Model | None = None) -> None:
        """``graph``: the stage's stateful model in memory, in place of the export's xml
        (a node's profile runs a synthetic stage so: dataplane.runtime.synthetic)."""
        self.export_dir = Path(export_dir)
        self.manifest, self.spec, self.config = open_stage(self.export_dir, index, config,
                                                           manifest, static=False)
        if device_kind(self.config) != "CPU":
            raise StageError("paged attention runs on the CPU plugin only")
        if verify and graph is None:
            verify_export_files(self.export_dir, self.manifest, [self.spec.xml, self.spec.bin])
        model = self.manifest.model
        self.hidden_size = model.hidden_size
        self.rope = stage_rope(model)
        self._rope_rows = StageRopeRows(self.rope)
        self.long_sequences = LongSequences(self.rope, index)  # LongRoPE's long streams
        core = core or shared_core()
        properties = self.config.properties(int4_group(self.manifest))
        try:
            stateful = graph or core.read_model(str(self.export_dir / self.spec.xml))
            paged = paged_model(
                stateful, self.spec.first, self.spec.last, self.hidden_size,
                [model.sliding_window if i in model.sliding_layers else 0
                 for i in range(self.spec.layer_start, self.spec.layer_end)])
            with HugePageScope() as pages:  # the weights the plugin repacks: huge pages
                self.compiled = core.compile_model(paged, self.config.device, properties)
        except RuntimeError as exc:
            raise StageError(f"cannot compile stage {index} with paged attention: {exc}") from None
        self.huge_page_bytes = pages.collapsed
        self.dynamic = StageGraph.of(self.compiled)
        # single-token steps run on this one when it is compiled (dataplane.runtime.one_token)
        self.one_token: StageGraph | None = None
        layers = sum(1 for port in paged.inputs if port.get_any_name().startswith("key_cache."))
        if wants_one_token_graph(self.config.decode_graph, weights_bytes(paged),
                                 available_memory(), layers, model.experts):
            with HugePageScope() as pages:
                self.one_token = compile_one_token_graph(
                    core, paged, self.config.device, properties, index, self.spec.first,
                    self.spec.last, self.rope.width)
            self.huge_page_bytes += pages.collapsed
        self.request = self.dynamic.request  # the request of the last step run
        self.threads = int(self.compiled.get_property("INFERENCE_NUM_THREADS"))
        self.input_name = self.compiled.inputs[0].get_any_name()
        ports = {p.get_any_name(): p for p in self.compiled.inputs}
        layers = paged_layers(paged)
        value = ports[layers[0].value_cache]
        self.layout = KvLayout(int(value.get_partial_shape()[2].get_length()), len(layers),
                               sum(1 for layer in layers if layer.window))
        self.pool = BlockPool(blocks)  # the global layers' blocks
        self.full = LayerCaches(self.pool, [ports[n] for layer in layers if not layer.window
                                            for n in layer[:2]],
                                sorted({layer.table for layer in layers if not layer.window}))
        # the sliding layers' blocks (a stage's sliding layers share one window)
        windows = {layer.window for layer in layers if layer.window}
        if len(windows) > 1:
            raise StageError(f"stage {index}'s sliding layers have windows {sorted(windows)}: "
                             f"one window a stage is supported")
        self.window: SlidingWindow | None = None
        self.window_caches: LayerCaches | None = None
        if windows:
            self.window = SlidingWindow(windows.pop(), self.config.sliding_margin,
                                        self.block_size)
            # what a few streams' windows hold: the pool doubles when it runs out
            window_blocks = min(blocks, WINDOW_STREAMS * self.window.blocks_bound(LARGE))
            self.window_caches = LayerCaches(
                BlockPool(window_blocks), [ports[n] for layer in layers if layer.window
                                           for n in layer[:2]],
                [layer.table for layer in layers if layer.window])
        self.shapes = ShapeKeeper()  # no padding until warm_up measures what a change costs
        for caches in self._layer_caches:
            self._bind_caches(caches, caches.pool.capacity)
        self.streams: dict[int, PagedSequence] = {}
        self.groups: dict[int, PagedGroup] = {}
        self._members: dict[int, PagedSequence] = {}  # row group members' sequences
        self.prefixes: dict[int, PrefixBlocks] = {}

    # -- the block cache ---------------------------------------------------------------
    @property
    def block_size(self) -> int:
        """Slots of a KV block (``layout``'s)."""
        return self.layout.block_size

    @property
    def _layer_caches(self) -> list[LayerCaches]:
        """The global layers' caches, and the sliding layers' if the stage has any."""
        return [self.full] if self.window_caches is None else [self.full, self.window_caches]

    def _bind_caches(self, caches: LayerCaches, blocks: int) -> None:
        """(Re)allocate the caches of ``caches``' layers for ``blocks`` blocks, the
        padding's scratch block and the never-written block after them, keeping what the
        pool's blocks hold."""
        arrays = []
        for i, port in enumerate(caches.ports):
            dims = [d.get_length() for d in list(port.get_partial_shape())[1:]]
            array = np.zeros([blocks + 2, *dims], dtype=CACHE_TYPES[port.get_element_type()])
            if i < len(caches.arrays):
                old = caches.pool.capacity  # the old scratch and unwritten blocks are not kept
                array[:old] = caches.arrays[i][:old]
            tensor = ov.Tensor(array, shared_memory=True)
            for graph in self._graphs:  # one cache, written and read by both graphs
                graph.request.set_tensor(port.get_any_name(), tensor)
            arrays.append(array)
        caches.arrays = arrays

    @property
    def _graphs(self) -> list[StageGraph]:
        """The compiled graphs: the dynamic one, and the one-token one if compiled."""
        return [self.dynamic] if self.one_token is None else [self.dynamic, self.one_token]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of every layer (a global layer's and a sliding one's)."""
        return sum(c.block_bytes for c in self._layer_caches)

    @property
    def kv_bytes_per_token(self) -> int:
        return -(-self.block_bytes // self.block_size)

    @property
    def cache_bytes(self) -> int:
        """Bytes of every layer's block cache as allocated now."""
        return sum(c.bytes for c in self._layer_caches)

    def _alloc(self, caches: LayerCaches) -> int:
        block = caches.pool.alloc()
        if block is None:
            self._bind_caches(caches, 2 * caches.pool.capacity)
            caches.pool.grow(2 * caches.pool.capacity)
            block = caches.pool.alloc()
            assert block is not None
        return block

    def _reserve(self, seq: PagedSequence, tokens: int) -> None:
        """Blocks for ``tokens`` more slots; a shared block about to be written is copied."""
        size = self.block_size
        first = seq.length // size
        self._own_block(self.full, seq.blocks, first)
        while len(seq.blocks) < blocks_for(seq.length + tokens, size):
            seq.blocks.append(self._alloc(self.full))
        if self.window_caches is not None:
            self._own_block(self.window_caches, seq.window_blocks, first - seq.window_first)
            while seq.window_first + len(seq.window_blocks) < len(seq.blocks):
                seq.window_blocks.append(self._alloc(self.window_caches))

    def _own_block(self, caches: LayerCaches, blocks: list[int], i: int) -> None:
        """Copy block ``blocks[i]`` (if there is one) when it is shared: it is written next."""
        if 0 <= i < len(blocks) and caches.pool.shared(blocks[i]):
            old, new = blocks[i], self._alloc(caches)
            for array in caches.arrays:
                array[new] = array[old]
            blocks[i] = new
            caches.pool.release([old])

    def _slide(self, seq: PagedSequence) -> None:
        """Free the sliding layers' blocks before the window and margin of ``seq``."""
        if self.window is None or self.window_caches is None:
            return
        drop = self.window.kept_from(seq.length) - seq.window_first
        if drop > 0:
            self.window_caches.pool.release(seq.window_blocks[:drop])
            del seq.window_blocks[:drop]
            seq.window_first += drop

    def _release(self, seq: PagedSequence | None) -> None:
        if seq is not None:
            self.pool.release(seq.blocks)
            if self.window_caches is not None:
                self.window_caches.pool.release(seq.window_blocks)
            seq.blocks, seq.length, seq.window_blocks, seq.window_first = [], 0, [], 0

    # -- streams -----------------------------------------------------------------------
    def warm_up(self, stream_id: int = -1) -> None:
        """A prefill-shaped and a decode-shaped step on a scratch stream, then the padding
        limit (what a change of the step's token count costs here, in tokens)."""
        warm_up_steps(self, stream_id)
        self.open_stream(stream_id)
        try:
            def step(tokens: int) -> None:
                start = self.streams[stream_id].length
                self.step(stream_id, zero_input(self, tokens), np.arange(start, start + tokens))
            self.shapes.limit = 0
            # Twice, keeping the larger: a second stage warming up on these cores can hide a
            # change's cost from one measurement, never add one to both.
            # One-token steps run on the one-token graph, where compiled: what a change
            # costs the dynamic graph shows between steps of 2 and 8 tokens.
            small = SMALL if self.one_token is None else SMALL + 1
            self.shapes.limit = max(measure_padding_limit(step, cap=min(self.block_size, LARGE),
                                                          small=small)
                                    for _ in range(2))
        finally:
            self.close_stream(stream_id)
        log.info("stage %d pads a step by up to %d tokens to keep its shape", self.spec.index,
                 self.shapes.limit)

    def open_stream(self, stream_id: int) -> PagedSequence:
        if stream_id not in self.streams:
            self.streams[stream_id] = PagedSequence(self.layout)
        return self.streams[stream_id]

    def reset_stream(self, stream_id: int, long_rope: bool = False) -> None:
        self.long_sequences.begin(stream_id, long_rope)
        self._release(self.open_stream(stream_id))

    def close_stream(self, stream_id: int) -> None:
        self.long_sequences.forget(stream_id)
        self._release(self.streams.pop(stream_id, None))
        group = self.groups.pop(stream_id, None)
        for member in group.members if group is not None else ():
            self._release(self._members.pop(member, None))

    def stream(self, stream_id: int) -> PagedSequence:
        """The stream\'s KV bookkeeping; StageError unless it is open here (stepped alone)."""
        seq = self.streams.get(stream_id)
        if seq is None:
            raise StageError(f"stream {stream_id} is not open on stage {self.spec.index}")
        return seq

    def check_input(self, x: np.ndarray, positions: np.ndarray) -> None:
        check_step_input(self.spec, self.hidden_size, x, positions)

    # -- rewinds: a shorter sequence (nothing is masked) --------------------------------
    mask_step_tail = rewind.mask_step_tail
    truncate = rewind.truncate
    compaction_due = rewind.compaction_due  # (nothing is ever masked here)

    def mask_tail(self, stream_id: int, count: int) -> None:
        self._shorten(self.stream(stream_id), count)

    trim_tail = mask_tail

    def kept_tokens(self, stream_id: int) -> int:
        return int(self.stream(stream_id).length)

    def _check_shorten(self, seq: PagedSequence, count: int) -> None:
        """StageError unless ``seq`` can be rewound by ``count`` tokens: at most its length,
        and no deeper than its sliding layers' margin keeps the window of."""
        if not 0 <= count <= seq.length:
            raise StageError(f"cannot rewind {count} tokens of a {seq.length}-token stream")
        if self.window is not None and self.window.needed_from(seq.length - count) < \
                seq.window_first:
            raise StageError(
                f"cannot rewind {count} tokens of a {seq.length}-token stream on stage "
                f"{self.spec.index}: its sliding layers keep the last {self.window.window} "
                f"keys and a margin of {self.window.margin} tokens, not the keys before")

    def _shorten(self, seq: PagedSequence, count: int) -> None:
        self._check_shorten(seq, count)
        seq.length -= count
        keep = blocks_for(seq.length, self.block_size)
        self.pool.release(seq.blocks[keep:])
        del seq.blocks[keep:]
        if self.window_caches is not None:
            kept = max(0, keep - seq.window_first)
            self.window_caches.pool.release(seq.window_blocks[kept:])
            del seq.window_blocks[kept:]

    def mask_rows_tail(self, group_id: int, counts: np.ndarray) -> None:
        group = self._group(group_id)
        counts = check_row_rewinds(group_id, counts, [s.length for s in group.seqs])
        for count, seq in zip(counts, group.seqs, strict=True):  # every row checked first
            self._check_shorten(seq, int(count))
        for count, seq in zip(counts, group.seqs, strict=True):
            self._shorten(seq, int(count))

    def masked_slots(self, stream_id: int) -> int:
        return 0

    def compact(self, stream_id: int) -> int:
        return 0

    def prefetch(self, stream_id: int) -> bool:
        return False

    # -- row groups ----------------------------------------------------------------------
    def _group(self, group_id: int) -> PagedGroup:
        group = self.groups.get(group_id)
        if group is None:
            raise StageError(f"row group {group_id} does not exist on stage {self.spec.index}")
        return group

    def regroup(self, group_id: int, members: list[int]) -> None:
        """Make ``group_id`` the row group of ``members`` (open streams, or rows it has);
        rows not listed any more are dropped, no members disbands it. Nothing is copied.
        On error nothing changes."""
        if group_id in self.streams:
            raise StageError(f"{group_id} is a stream, not a row group")
        if len(set(members)) != len(members):
            raise StageError(f"a row group lists a stream twice: {members}")
        old = self.groups.get(group_id)
        had = set(old.members) if old is not None else set()
        for sid in members:
            if sid not in had and sid not in self.streams:
                raise StageError(f"stream {sid} is not open on stage {self.spec.index}: it "
                                 f"cannot join row group {group_id}")
        for sid in had - set(members):
            self._release(self._members.pop(sid, None))
        for sid in members:
            if sid not in had:
                self._members[sid] = self.streams.pop(sid)
        if members:
            self.groups[group_id] = PagedGroup(list(members), [self._members[m] for m in members])
        else:
            self.groups.pop(group_id, None)

    # -- stepping ------------------------------------------------------------------------
    def step(self, stream_id: int, x: np.ndarray, positions: np.ndarray,
             logits_idx: np.ndarray | None = None, one_query: bool = False) -> np.ndarray:
        """One step of a stream: hidden states [1, T, H] or logits [1, K, V] (a view,
        valid until the next step); ``one_query``: each token a sequence of its own."""
        positions = np.asarray(positions, dtype=np.int64)
        self.check_input(x, positions)
        step = self.prepare(stream_id, positions[None], logits_idx, one_query=one_query)
        return self._output(self.run(stream_id, x, step), step)

    def step_rows(self, group_id: int, x: np.ndarray, positions: np.ndarray,
                  logits_idx: np.ndarray | None = None, one_query: bool = False
                  ) -> np.ndarray:
        """One step of every row of a group: x [rows, T] ids or [rows, T, H] hidden states,
        ``positions`` [rows, T]; returns [rows, T, H] or logits [rows, K, V] (a view)."""
        rows = len(self._group(group_id).members)
        positions = np.asarray(positions, dtype=np.int64)
        check_rows_step(group_id, rows, x, positions)
        step = self.prepare(group_id, positions, logits_idx, one_query=one_query)
        return self._output(self.run(group_id, x, step), step)

    def step_ragged(self, group_id: int, x: np.ndarray, positions: np.ndarray,
                    row_tokens: np.ndarray, logits_idx: np.ndarray | None = None,
                    one_query: bool = False) -> np.ndarray:
        """One step of every row of a group, row i stepping ``row_tokens[i]`` tokens (a
        decoding row's one beside a prompt's chunk): x [1, N] ids or [1, N, H] hidden
        states, the rows' tokens one after the other, ``positions`` [N] in that order;
        ``logits_idx`` indexes those N tokens (None: every row's last). Returns [1, N, H]
        or logits [1, K, V] (a view)."""
        rows = len(self._group(group_id).members)
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        counts = check_ragged_step(group_id, rows, x, positions, row_tokens)
        step = self.prepare(group_id, positions, logits_idx, row_tokens=counts,
                            one_query=one_query)
        return self._output(self.run(group_id, x, step), step)

    def prepare(self, stream_id: int, positions: np.ndarray,
                logits_idx: np.ndarray | None = None, inputs: Any = None,
                row_tokens: np.ndarray | None = None, one_query: bool = False) -> PagedStep:
        """Bind every input of a stream's (or row group's) next step but x: RoPE rows,
        each sequence's past length and block table. ``positions`` is [rows, T], or with
        ``row_tokens`` (ragged rows) the rows' positions one after the other (``inputs``,
        from another stage, is not reused: every stage has its own blocks). ``one_query``:
        every token is a sequence of one token of its own (see the module's docstring);
        the tokens and the answers keep their order."""
        group = self.groups.get(stream_id)
        seqs = group.seqs if group is not None else [self.stream(stream_id)]
        long_rows = self.long_sequences.rows(group.members if group is not None else [stream_id])
        if row_tokens is None:
            rows, tokens = positions.shape
            counts = [tokens] * rows
        else:
            counts = [int(c) for c in row_tokens]
        if len(counts) != len(seqs):
            raise StageError(f"{len(counts)} rows of positions for {len(seqs)} sequences")
        total = sum(counts)
        out_shape = (len(seqs), counts[0]) if row_tokens is None else (1, total)
        flat = None
        if self.spec.last:  # (checked before any block is reserved)
            flat = self._answer_index(counts, logits_idx, ragged=row_tokens is not None)
            out_shape = (len(seqs), flat.size // len(seqs)) if row_tokens is None else (1, flat.size)
        for seq, count in zip(seqs, counts, strict=True):
            self._reserve(seq, count)
        attention = self._attention_sequences(seqs, counts, one_query)
        pads = self._padding(len(attention.pasts), total)
        pad = sum(pads)
        one_token = total + pad == 1 and (flat is None or flat.size == 1)
        graph = self.one_token if one_token and self.one_token is not None else self.dynamic
        bound = graph.inputs
        if flat is not None:
            bound.put("logits_idx", flat)
        flat_positions = positions.reshape(-1)
        if pad:  # more tokens, each padding sequence's from position 0 in the scratch block
            flat_positions = np.concatenate([flat_positions, *map(np.arange, pads)])
        if flat_positions.size == 1:
            cos, sin = self._rope_rows.one(int(flat_positions[0]),
                                           long_rows is not None and bool(long_rows[0]))
        else:  # each row's RoPE set
            cos, sin = self.rope.tables(flat_positions[None], counts, long_rows)
        bound.put("rope_cos", cos.reshape(total + pad, 1, -1))
        bound.put("rope_sin", sin.reshape(total + pad, 1, -1))
        self._bind_tables(bound, attention, pads)
        return PagedStep(list(seqs), counts, out_shape, graph, pad)

    def _attention_sequences(self, seqs: list[PagedSequence], counts: list[int],
                             one_query: bool) -> AttentionSequences:
        """The step's sequences as PagedAttention takes them: each stepped sequence with
        its tokens, or (``one_query``) each token alone, its past the sequence's tokens
        before it and its block table the blocks holding them and it."""
        size = self.block_size
        if not one_query:
            pasts, tokens = [s.length for s in seqs], list(counts)
            ends = [(s, blocks_for(s.length + c, size)) for s, c in zip(seqs, counts,
                                                                       strict=True)]
        else:
            pasts = [s.length + i for s, c in zip(seqs, counts, strict=True) for i in range(c)]
            tokens = [1] * len(pasts)
            ends = [(s, blocks_for(s.length + i + 1, size))
                    for s, c in zip(seqs, counts, strict=True) for i in range(c)]
        caches = self.window_caches
        return AttentionSequences(
            pasts, tokens, [s.blocks[:n] for s, n in ends],
            [] if caches is None else [window_table(s, n, caches.unwritten) for s, n in ends])

    def _padding(self, sequences: int, tokens: int) -> list[int]:
        """The padding sequences' token counts for a step of ``tokens`` over ``sequences``:
        up to a recent step's count (``shapes``) and the bucket's, in one sequence; and a
        step whose every sequence feeds one token (decode steps, a one-query step) of
        fewer sequences than the stage's threads gets empty sequences (no token, no past)
        up to that many (``RuntimeSpec.pad_decode_steps``): the plugin
        then computes its attention on its mixed path, as a row group's, not split along
        the past, and no matmul gets a row more."""
        # A one-token step on the one-token graph leaves the dynamic graph's shape as it
        # was: it is neither padded nor noted.
        pad = 0 if tokens == 1 and self.one_token is not None else self.shapes.pad(tokens)
        pad += bucket_pad(tokens + pad, most=self.block_size)
        if pad > self.block_size:  # the scratch block holds no more: the bucket's alone
            pad = bucket_pad(tokens, most=self.block_size)
        pads = [pad] if pad else []
        if (self.config.pad_decode_steps and tokens == sequences
                and sequences + len(pads) < self.threads):
            pads += [0] * (self.threads - sequences - len(pads))
        return pads

    def _bind_tables(self, bound: BoundInputs, attention: AttentionSequences,
                     pads: list[int]) -> None:
        """Each sequence's past length, where its tokens begin and its block table, the
        padding sequences' (in the scratch block) last."""
        pasts, counts, tables, window_tables = attention
        if pads:
            pasts = [*pasts, *[0] * len(pads)]
            counts = [*counts, *pads]
        bound.put("past_lens", np.array(pasts, dtype=np.int32))
        bound.put("subsequence_begins", np.cumsum([0, *counts]).astype(np.int32))
        for caches, layer_tables in ((self.full, tables), (self.window_caches, window_tables)):
            if caches is None:
                continue
            flat = np.array([b for t in [*layer_tables, *[[caches.scratch]] * len(pads)]
                             for b in t], dtype=np.int32)
            for name in caches.tables:
                bound.put(name, flat)
        bound.put("block_indices_begins", np.cumsum(
            [0, *map(len, tables), *[1] * len(pads)]).astype(np.int32))
        bound.put("max_context_len", np.array(max(p + c for p, c in zip(
            pasts, counts, strict=True)), dtype=np.int32))

    @staticmethod
    def _answer_index(counts: list[int], logits_idx: np.ndarray | None, ragged: bool
                      ) -> np.ndarray:
        """The flat token indices the last stage answers for: ``logits_idx`` in every row
        (uniform rows) or of the whole step (ragged rows); None: every row's last token."""
        total = sum(counts)
        if logits_idx is None:
            return (np.cumsum(counts) - 1).astype(np.int64)
        idx = np.asarray(logits_idx, dtype=np.int64).reshape(-1)
        span = total if ragged else counts[0]
        if idx.size == 0 or idx.min() < 0 or idx.max() >= span:
            raise StageError(f"logits_idx {idx.tolist()} out of range for {span} tokens")
        if ragged:
            return idx
        return (np.arange(len(counts))[:, None] * span + idx[None]).reshape(-1)

    def run(self, stream_id: int, x: np.ndarray | ov.Tensor, step: PagedStep) -> ov.Tensor:
        """Run the step ``prepare`` bound on x (token ids [rows, T], hidden states
        [rows, T, H], or the previous stage's output tensor); the sequences grow by T."""
        n = sum(step.counts)
        data = x.data if isinstance(x, ov.Tensor) else np.asarray(x)
        if isinstance(x, ov.Tensor) and data.size > n * self.hidden_size:
            data = data.reshape(-1, self.hidden_size)[:n]  # a padded step's output
        if self.spec.first:
            flat = data.astype(np.int64, copy=False).reshape(n)
        else:
            if data.size != n * self.hidden_size:
                raise StageError(f"x {list(data.shape)} does not hold {n} hidden states")
            flat = data.astype(np.float32, copy=False).reshape(n, self.hidden_size)
        if step.pad:
            flat = np.concatenate([flat, np.zeros((step.pad, *flat.shape[1:]), flat.dtype)])
        request = self.request = step.graph.request
        step.graph.inputs.put(self.input_name, flat)
        if self.config.async_infer:
            request.start_async()
            request.wait()
        else:
            request.infer()
        for seq, count in zip(step.seqs, step.counts, strict=True):
            seq.length += count
            self._slide(seq)
        return request.get_output_tensor(0)

    def _output(self, tensor: ov.Tensor, step: PagedStep) -> np.ndarray:
        data = tensor.data
        if step.pad and not self.spec.last:  # the last stage answers for real tokens only
            data = data.reshape(-1, self.hidden_size)[:sum(step.counts)]
        return data.reshape(*step.out_shape, -1)

    # -- prefixes (the prefix cache's entries) ---------------------------------------------
    def row_of(self, stream_id: int) -> tuple[int, int] | None:
        """(row group, row) of a stream that is a row of a group, else None."""
        return find_row(self.groups, stream_id)

    def _any_seq(self, stream_id: int) -> PagedSequence:
        seq = self.streams.get(stream_id) or self._members.get(stream_id)
        if seq is None:
            raise StageError(f"stream {stream_id} is not open on stage {self.spec.index}")
        return seq

    def save_prefix(self, stream_id: int, entry_id: int, length: int, take: bool = False) -> None:
        """Keep the stream's (or a row's) first ``length`` tokens as prefix ``entry_id``,
        sharing its blocks; ``take`` closes the stream (a stream stepped alone) after."""
        seq = self._any_seq(stream_id)
        if not 0 < length <= seq.length:
            raise StageError(f"cannot keep {length} tokens of a {seq.length}-token stream")
        entries = blocks_for(length, self.block_size)
        blocks = seq.blocks[:entries]
        first = min(seq.window_first, entries)
        window_blocks = seq.window_blocks[:entries - first]
        self.pool.retain(blocks)
        if self.window_caches is not None:
            self.window_caches.pool.retain(window_blocks)
        self.drop_prefix(entry_id)
        self.prefixes[entry_id] = PrefixBlocks(list(blocks), length, list(window_blocks), first)
        if take and stream_id in self.streams:
            self.close_stream(stream_id)

    def load_prefix(self, stream_id: int, entry_id: int, length: int, take: bool = False) -> None:
        """Start a just-reset stream with prefix ``entry_id``'s first ``length`` tokens;
        ``take`` removes the entry (its blocks pass to the stream)."""
        seq = self.stream(stream_id)
        entry = self.prefixes.get(entry_id)
        if entry is None:
            raise StageError(f"prefix {entry_id} is not held on stage {self.spec.index}")
        if seq.length or not 0 < length <= entry.length:
            raise StageError(f"cannot load {length} tokens of prefix {entry_id} ({entry.length} "
                             f"tokens) into stream {stream_id} holding {seq.length}")
        if self.window is not None and self.window.needed_from(length) < entry.window_first:
            raise StageError(
                f"cannot load {length} tokens of prefix {entry_id} on stage {self.spec.index}: "
                f"its sliding layers kept the keys from position "
                f"{entry.window_first * self.block_size} on, and the window before token "
                f"{length} begins earlier")
        self._release(seq)
        entries = blocks_for(length, self.block_size)
        seq.blocks = list(entry.blocks[:entries])
        seq.length = length
        self.pool.retain(seq.blocks)
        if self.window_caches is not None:
            seq.window_first = entry.window_first
            seq.window_blocks = list(entry.window_blocks[:entries - entry.window_first])
            self.window_caches.pool.retain(seq.window_blocks)
            self._slide(seq)
        if take:
            self.drop_prefix(entry_id)

    def drop_prefix(self, entry_id: int) -> None:
        entry = self.prefixes.pop(entry_id, None)
        if entry is not None:
            self.pool.release(entry.blocks)
            if self.window_caches is not None:
                self.window_caches.pool.release(entry.window_blocks)

    def drop_all_prefixes(self) -> None:
        for entry_id in list(self.prefixes):
            self.drop_prefix(entry_id)

    def prefix_bytes(self) -> int:
        """Bytes of the blocks prefixes hold (streams that started with them share some)."""
        held = {b for e in self.prefixes.values() for b in e.blocks}
        total = len(held) * self.full.block_bytes
        if self.window_caches is not None:
            window = {b for e in self.prefixes.values() for b in e.window_blocks}
            total += len(window) * self.window_caches.block_bytes
        return total
