"""The data-plane wire protocol: pack and validate the frames that travel between stages.

No sockets here. A frame is two ZeroMQ parts: a compact binary header (a fixed
``struct`` layout followed by variable arrays: payload shape, token positions,
logits indices, one timing record per stage passed, an optional error text) and the
raw payload bytes (token ids, hidden states, or the last stage's reply), which are
never copied on decode: ``decode_frame`` returns a numpy view of the received buffer.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, NamedTuple

import numpy as np

MAGIC = b"ZCDP"
# 2: a ``rows`` field (several streams batched in one step); 3: ``row_tokens`` (a row
# group's rows step different token counts: ragged rows); 4: ``fed`` and ``guessed`` (a
# pipelined step's token ids, which the last stage checks against the step before);
# 5: top-k records carry log-probabilities, and float16 logits replies (LOGITS16);
# 6: the ONE_QUERY flag (a step's tokens computed each as a query of its own);
# 7: the LONG_ROPE flag (a RESET's new sequence turns with LongRoPE's long set throughout)
PROTOCOL_VERSION = 7
MAX_ROWS = 1024  # rows (streams) in one batched step
MAX_NDIM = 4
MAX_TOKENS = 1 << 17  # positions in one step
MAX_STAGES = 255  # timing records in one frame
MAX_TOP_K = 1024
MAX_PAYLOAD_BYTES = 1 << 31
MAX_ERROR_BYTES = 1 << 16
PREFIX_FIELDS = 5  # a PREFIX payload: op, entry id, length, take, stream id (int64)
CANCEL_FIELDS = 3  # a CANCEL payload: first step, last step, logical tokens kept (int64)


class FrameError(ValueError):
    """A frame is malformed. ``header`` is set when the header itself was valid."""

    def __init__(self, message: str, header: HiddenStateFrame | None = None) -> None:
        super().__init__(message)
        self.header = header


class Kind(IntEnum):
    STEP = 1  # token ids or hidden states flowing toward the last stage
    REPLY = 2  # the last stage's answer, sent to the coordinator
    RESET = 3  # forget a stream's KV; carries the stream's new epoch
    CLOSE = 4  # drop a stream entirely
    ERROR = 5  # a stage could not run a step; forwarded to the coordinator
    # Drop a stream's masked KV slots (in order with its steps). Added in version 1 without
    # a bump: the layout is unchanged and older nodes reject the kind cleanly (a malformed
    # frame) and just keep their masked slots, which is still correct, only larger.
    COMPACT = 6
    # Make stream ``stream_id`` a row group whose rows are the streams listed in the payload
    # (int64 [rows]), in order with its steps: members leave their own KV for a row of the
    # group's; rows not listed any more are dropped (see dataplane.runtime.kv.rows).
    GROUP = 7
    # A prefix (KV) cache op, in order with the steps: payload int64 [PrefixOp, entry id,
    # length, take (0/1), stream id] (dataplane.wire.prefix_ops packs and reads it). A SAVE or
    # LOAD carries the epoch of the stream it names in the header: that stream, or for a
    # SAVE of a row group's row the group (the payload names the row's stream). DROP and
    # DROP_ALL concern no stream: stream id 0, epoch 0, never checked against an epoch (they
    # are idempotent, and the pipe keeps them in order with the SAVEs and LOADs of their
    # entries). Added without a version bump, as COMPACT: an older node rejects the kind as
    # malformed (the control plane admits only nodes of the coordinator's zctl version).
    PREFIX = 8
    # Cancel a stream's newest steps, in order with its steps: payload int64 [first step,
    # last step, keep]: a stage that has not computed steps first..last skips them, and
    # every stage rewinds the stream to its first ``keep`` logical tokens (so a stage that
    # computed some of them and one that skipped them agree). The coordinator sends it as
    # soon as it knows those steps were computed on a wrong speculation (pipelined
    # speculation). Added without a version bump, as COMPACT and PREFIX.
    CANCEL = 9


class ReplyMode(IntEnum):
    TOP1 = 0  # one (token, logit) record per requested position (8 bytes)
    TOPK = 1  # top_k (token, log-probability) records per position, best first
    LOGITS = 2  # full float32 logits [positions, vocab]
    LOGITS16 = 3  # full logits as float16 [positions, vocab]: half the bytes


# One record of a top-1 reply (token, logit) or of a top-k reply (token, log-probability:
# the logit less the log-sum-exp of its row, so that logprobs need no other figure).
TOPK_DTYPE = np.dtype([("token", "<i4"), ("logit", "<f4")])
TOP1 = struct.Struct("<if")

# What each stage stamps into a frame as it passes: wall-clock stamps (time.time_ns) of
# arrival, of when it became ready to take the frame, and of the send; durations in ns.
# On the wire a record is TIMING-packed bytes; TIMING_DTYPE views a run of them.
TIMING = struct.Struct("<Hqqqqqq")
TIMING_DTYPE = np.dtype([
    ("stage", "<u2"),
    ("recv_ns", "<i8"),
    ("ready_ns", "<i8"),
    ("send_ns", "<i8"),
    ("decode_ns", "<i8"),
    ("compute_ns", "<i8"),
    ("encode_ns", "<i8"),
])

# Payload dtype codes on the wire; 0 means "no payload" (control frames).
DTYPES: dict[int, np.dtype] = {
    1: np.dtype("<f4"),
    2: np.dtype("<f2"),
    3: np.dtype("<i4"),
    4: np.dtype("<i8"),
    5: TOPK_DTYPE,
}
DTYPE_CODES: dict[np.dtype, int] = {dt: code for code, dt in DTYPES.items()}

# magic, version, kind, reply mode, dtype code, top_k, ndim, n_timing, source stage,
# stream id, request id, epoch, step, tokens, n_logits_idx, mask_tail, error bytes, rows,
# n_row_rewinds, n_row_tokens, n_fed, flags (GUESSED, ONE_QUERY, LONG_ROPE).
FIXED = struct.Struct("<4sBBBBHBBHIQQIIIIIHHHHB")
GUESSED = 1  # flags: the step's fed tokens are a guess of the previous step's answer
ONE_QUERY = 2  # flags: every token of the step is a query of its own (a verification step)
# flags of a RESET: the stream's new sequence turns with LongRoPE's long set throughout
# (its prompt is longer than the model's original_max_position_embeddings)
LONG_ROPE = 4
FLAGS = GUESSED | ONE_QUERY | LONG_ROPE  # every flag defined
SHAPE_STRUCTS = [struct.Struct(f"<{n}I") for n in range(MAX_NDIM + 1)]
POSITION_ITEM = np.dtype("<i8")
SMALL_COUNT = 16  # up to this many int64s are checked with one struct unpack
INT64S = [struct.Struct(f"<{n}q") for n in range(SMALL_COUNT + 1)]
EMPTY_INDEX = np.zeros(0, dtype=POSITION_ITEM)
NO_PAYLOAD = np.zeros(0, dtype=np.uint8)


@dataclass(slots=True)
class HiddenStateFrame:
    """The header of one data-plane frame.

    ``positions`` are the logical RoPE positions of the step's T tokens (a REPLY repeats
    them only when ``logits_idx`` is set); ``logits_idx`` (empty = the last token) picks
    which of them the last stage answers for; ``rows`` > 1 steps a row group: the payload
    is [rows, T, ...], ``positions`` holds rows x T positions (row-major), ``logits_idx``
    applies to every row and a reply answers rows x (len(logits_idx) or 1) positions;
    ``row_rewinds`` (empty, or one count per row) rewinds each row's last kept slots
    before the step, as ``mask_tail`` does for a single stream;
    ``row_tokens`` (empty, or one count per row) makes the rows ragged: row i steps
    ``row_tokens[i]`` tokens, the payload is [1, sum, ...] (the rows' tokens one after
    the other), ``positions`` holds them in that order, ``logits_idx`` indexes that flat
    list (empty = every row's last token) and a reply answers len(logits_idx) (or rows)
    positions;
    ``fed`` (empty, or a 1-row step's token ids) lets the last stage check a pipelined
    step: with ``guessed`` its tokens were fed on a guess that the stream's previous step
    answers the drafts that step fed, then ``fed[0]``; a last stage that computed that
    step and sees otherwise skips this one (its cancel follows);
    ``one_query``: every stage computes each of the step's tokens as a query of its own, a
    sequence of one token after its row's tokens before it, as that many decode steps
    would (a verification step: the last token and its drafts; StageRuntime's
    ``one_query``); a stage that cannot answers with an ERROR;
    ``long_rope`` (a RESET only): the stream's new sequence turns with LongRoPE's long
    set throughout (dataplane.runtime.rope.LongSequences);
    ``mask_tail`` rewinds that many kept KV slots before the step; ``timings`` holds one
    packed ``TIMING`` record per stage passed (see ``stamp``). ``shape`` and ``dtype``
    describe the payload: ``encode_frame`` takes them from the array it sends. A node
    owns the headers it decodes and may change them in place before passing them on.
    """

    kind: Kind
    stream_id: int
    request_id: int
    epoch: int
    step: int = 0
    positions: np.ndarray = field(default_factory=lambda: EMPTY_INDEX)
    logits_idx: np.ndarray = field(default_factory=lambda: EMPTY_INDEX)
    reply: ReplyMode = ReplyMode.TOP1
    top_k: int = 1
    mask_tail: int = 0
    source_stage: int = 0
    timings: bytes = b""
    error: str = ""
    shape: tuple[int, ...] = ()
    dtype: np.dtype | None = None
    version: int = PROTOCOL_VERSION
    rows: int = 1
    row_rewinds: np.ndarray = field(default_factory=lambda: EMPTY_INDEX)
    row_tokens: np.ndarray = field(default_factory=lambda: EMPTY_INDEX)
    fed: np.ndarray = field(default_factory=lambda: EMPTY_INDEX)
    guessed: bool = False
    one_query: bool = False
    long_rope: bool = False

    @property
    def ragged(self) -> bool:
        return bool(self.row_tokens.shape[0])

    @property
    def tokens(self) -> int:
        """Tokens per row of the step (ragged rows: of the whole step)."""
        if self.row_tokens.shape[0]:
            return int(self.positions.shape[0])
        return int(self.positions.shape[0]) // max(1, self.rows)

    @property
    def answer_rows(self) -> int:
        """How many positions the last stage answers for (logits_idx, or the last token),
        over all rows."""
        if self.row_tokens.shape[0]:
            return int(self.logits_idx.shape[0]) or self.rows
        return (int(self.logits_idx.shape[0]) or 1) * max(1, self.rows)


def stamp(timings: bytes, stage: int, recv_ns: int, ready_ns: int, send_ns: int,
          decode_ns: int, compute_ns: int, encode_ns: int) -> bytes:
    """Return ``timings`` with one more stage record appended."""
    return timings + TIMING.pack(stage, recv_ns, ready_ns, send_ns, decode_ns, compute_ns,
                                 encode_ns)


SEND_AND_ENCODE = struct.Struct("<q")  # send_ns at offset 18, encode_ns at 42 of a record


def restamp_send(parts: list[Any], error_bytes: int, send_ns: int, encode_ns: int) -> None:
    """Fill in the last timing record's send stamp and encode time of encoded ``parts``.

    A sender stamps its record with zeros, encodes, then calls this right before the
    send, so its own encoding counts as its work rather than as time on the wire.
    ``error_bytes`` is the length of the header's UTF-8 error text (0 for steps).
    """
    head = bytearray(parts[0])
    record = len(head) - error_bytes - TIMING.size
    if record < FIXED.size:
        raise FrameError("the frame carries no timing record to stamp")
    SEND_AND_ENCODE.pack_into(head, record + 18, send_ns)
    SEND_AND_ENCODE.pack_into(head, record + 42, encode_ns)
    parts[0] = head


def timing_records(timings: bytes) -> np.ndarray:
    """View packed timing records as a TIMING_DTYPE array (fields by name)."""
    return np.frombuffer(timings, dtype=TIMING_DTYPE)


def encode_frame(header: HiddenStateFrame, payload: np.ndarray | None = None) -> list[Any]:
    """Pack ``header`` and return ``[header_bytes, payload_buffer]`` ready for send_multipart.

    The payload is not copied when it is already C-contiguous (the second part is the
    array itself): keep it alive and unmodified until the send completes.
    """
    if payload is None:
        return [pack_header(header, (), None), b""]
    data = payload if payload.flags.c_contiguous else np.ascontiguousarray(payload)
    return [pack_header(header, data.shape, data.dtype), data if data.nbytes else b""]


def frame_bytes(parts: list[Any]) -> int:
    """Bytes of a frame's parts as sent (each part by its buffer)."""
    return sum(memoryview(p).nbytes for p in parts)


def pack_header(header: HiddenStateFrame, shape: tuple[int, ...], dtype: np.dtype | None
                ) -> bytes:
    """The header part of a frame whose payload has ``shape`` and ``dtype`` (None: none)."""
    if dtype is None:
        dtype_code, shape = 0, ()
    else:
        dtype_code = DTYPE_CODES.get(dtype)
        if dtype_code is None:
            raise FrameError(f"cannot send a {dtype} payload; supported: "
                             f"{sorted(str(d) for d in DTYPE_CODES)}")
    if len(shape) > MAX_NDIM:
        raise FrameError(f"payload has {len(shape)} dimensions; at most {MAX_NDIM} are allowed")
    positions = _int64s(header.positions)
    logits_idx = EMPTY_INDEX if header.logits_idx is EMPTY_INDEX else _int64s(header.logits_idx)
    row_rewinds = (EMPTY_INDEX if header.row_rewinds is EMPTY_INDEX
                   else _int64s(header.row_rewinds))
    row_tokens = (EMPTY_INDEX if header.row_tokens is EMPTY_INDEX
                  else _int64s(header.row_tokens))
    fed = EMPTY_INDEX if header.fed is EMPTY_INDEX else _int64s(header.fed)
    timings = header.timings
    if len(timings) % TIMING.size:
        raise FrameError(f"timings hold {len(timings)} bytes, not whole {TIMING.size}-byte records")
    error = header.error.encode("utf-8")[:MAX_ERROR_BYTES] if header.error else b""
    try:
        fixed = FIXED.pack(
            MAGIC, header.version, int(header.kind), int(header.reply), dtype_code, header.top_k,
            len(shape), len(timings) // TIMING.size, header.source_stage, header.stream_id,
            header.request_id, header.epoch, header.step, positions.shape[0],
            logits_idx.shape[0], header.mask_tail, len(error), header.rows,
            row_rewinds.shape[0], row_tokens.shape[0], fed.shape[0],
            (GUESSED if header.guessed else 0) | (ONE_QUERY if header.one_query else 0)
            | (LONG_ROPE if header.long_rope else 0),
        )
        dims = SHAPE_STRUCTS[len(shape)].pack(*shape)
    except struct.error as exc:
        raise FrameError(f"header field out of range: {exc}") from None
    return b"".join((fixed, dims, positions, logits_idx, row_rewinds, row_tokens, fed, timings,
                     error))


class PreparedFrame(NamedTuple):
    """A frame's header packed before its payload exists (see ``prepare_frame``)."""

    head: bytearray
    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int


SEAL = struct.Struct("<qqqq")  # send, decode, compute, encode ns: offset 18 of a record


def prepare_frame(header: HiddenStateFrame, shape: tuple[int, ...], dtype: np.dtype,
                  stage: int, recv_ns: int, ready_ns: int) -> PreparedFrame:
    """Pack ``header`` for a payload of ``shape``/``dtype`` that a computation is about to
    produce, with one more timing record (``stage``'s) whose durations and send stamp
    ``seal_frame`` fills in. Packing before the computation does it with the caches warm
    from decoding, not cold after an inference, and leaves one small write after it.
    """
    if header.error:
        raise FrameError("a frame with an error text is not prepared; encode it when sent")
    record = TIMING.pack(stage, recv_ns, ready_ns, 0, 0, 0, 0)
    timings, header.timings = header.timings, header.timings + record
    try:
        return PreparedFrame(bytearray(pack_header(header, shape, dtype)), shape, dtype,
                             math.prod(shape) * dtype.itemsize)
    finally:
        header.timings = timings


def seal_frame(prepared: PreparedFrame, payload: np.ndarray | bytes, send_ns: int,
               decode_ns: int, compute_ns: int, encode_ns: int) -> list[Any] | None:
    """The parts of a prepared frame carrying ``payload`` (an array, or its raw bytes), its
    timing record completed; None when the payload is not what the header was prepared
    for (encode it instead)."""
    if type(payload) is bytes:
        if len(payload) != prepared.nbytes:
            return None
    elif (payload.shape != prepared.shape or payload.dtype != prepared.dtype
            or not payload.flags.c_contiguous):
        return None
    head = prepared.head
    SEAL.pack_into(head, len(head) - TIMING.size + 18, send_ns, decode_ns, compute_ns, encode_ns)
    return [head, payload]


def _int64s(values: Any) -> np.ndarray:
    """``values`` as a contiguous little-endian int64 array (no copy when it already is)."""
    if type(values) is np.ndarray and values.dtype is POSITION_ITEM and values.flags.c_contiguous:
        return values
    return np.ascontiguousarray(values, dtype=POSITION_ITEM)


KINDS = {int(k): k for k in Kind}
REPLY_MODES = {int(m): m for m in ReplyMode}
DTYPE_OK = {0, *DTYPES}  # 0: no payload
STEP_CODE, REPLY_CODE, TOP1_CODE = int(Kind.STEP), int(Kind.REPLY), int(ReplyMode.TOP1)
TOPK_CODE = DTYPE_CODES[TOPK_DTYPE]


def _parse_header(raw: bytes | memoryview) -> tuple[HiddenStateFrame, bool]:
    """Parse and validate a header part (positions and logits_idx are views of ``raw``);
    also say whether it is a plain 1-row step or a top-1 reply for the last token, which
    need no cross-field checks beyond these. Every line here runs with caches an inference
    just evicted, so the common case is one combined test; ``_header_problem`` words a
    failure."""
    size = len(raw) if type(raw) is bytes else raw.nbytes
    if size < FIXED.size:
        raise FrameError(f"truncated header: {size} bytes, the fixed part alone is "
                         f"{FIXED.size}")
    (magic, version, kind_code, reply_code, dtype_code, top_k, ndim, n_timing, source_stage,
     stream_id, request_id, epoch, step, tokens, n_idx, mask_tail,
     error_len, rows, n_rewinds, n_row_tokens, n_fed, flags) = fields = FIXED.unpack_from(raw)
    o_pos = FIXED.size + ndim * 4
    o_tim = o_pos + (tokens + n_idx + n_rewinds + n_row_tokens + n_fed) * 8
    o_err = o_tim + n_timing * TIMING.size
    if (magic != MAGIC or version != PROTOCOL_VERSION or kind_code not in KINDS
            or reply_code not in REPLY_MODES or dtype_code not in DTYPE_OK or ndim > MAX_NDIM
            or tokens > MAX_TOKENS or n_timing > MAX_STAGES or top_k > MAX_TOP_K
            or error_len > MAX_ERROR_BYTES or not 1 <= rows <= MAX_ROWS
            or (n_rewinds and n_rewinds != rows) or (n_row_tokens and n_row_tokens != rows)
            or (not n_row_tokens and (tokens % rows or n_idx > tokens // rows))
            or n_idx > tokens or n_fed > tokens or flags & ~FLAGS
            or size != o_err + error_len):
        raise FrameError(_header_problem(fields, size, o_err + error_len))
    if tokens:
        if tokens <= SMALL_COUNT:  # the per-token path: one unpack, no numpy reduction
            low = min(INT64S[tokens].unpack_from(raw, o_pos))
        else:
            low = int(np.frombuffer(raw, POSITION_ITEM, tokens, o_pos).min())
        if low < 0:
            raise FrameError("negative token position")
        positions = np.frombuffer(raw, POSITION_ITEM, tokens, o_pos)
    else:
        positions = EMPTY_INDEX
    row_rewinds = row_tokens = EMPTY_INDEX
    o_rows = o_pos + (tokens + n_idx) * 8
    if n_rewinds:
        row_rewinds = np.frombuffer(raw, POSITION_ITEM, n_rewinds, o_rows)
        if int(row_rewinds.min()) < 0:
            raise FrameError("negative row rewind")
    if n_row_tokens:
        row_tokens = np.frombuffer(raw, POSITION_ITEM, n_row_tokens, o_rows + n_rewinds * 8)
        if int(row_tokens.min()) < 1 or int(row_tokens.sum()) != tokens:
            raise FrameError(f"row tokens {row_tokens.tolist()} are not positive counts that "
                             f"add up to the step's {tokens} positions")
    fed = (np.frombuffer(raw, POSITION_ITEM, n_fed, o_rows + (n_rewinds + n_row_tokens) * 8)
           if n_fed else EMPTY_INDEX)
    shape = SHAPE_STRUCTS[ndim].unpack_from(raw, FIXED.size)
    plain = rows == 1 and not (n_idx or n_rewinds or n_row_tokens or n_fed or flags) and (
        (kind_code == STEP_CODE and ndim > 1 and shape[0] == 1 and shape[1] == tokens) or
        (kind_code == REPLY_CODE and reply_code == TOP1_CODE and dtype_code == TOPK_CODE
         and shape == (1, 1)))
    return HiddenStateFrame(
        KINDS[kind_code], stream_id, request_id, epoch, step, positions,
        np.frombuffer(raw, POSITION_ITEM, n_idx, o_pos + tokens * 8) if n_idx else EMPTY_INDEX,
        REPLY_MODES[reply_code], top_k, mask_tail, source_stage, bytes(raw[o_tim:o_err]),
        bytes(raw[o_err:]).decode("utf-8", errors="replace") if error_len else "",
        shape, DTYPES.get(dtype_code), version, rows, row_rewinds, row_tokens, fed,
        bool(flags & GUESSED), bool(flags & ONE_QUERY), bool(flags & LONG_ROPE)), plain


def _header_problem(fields: tuple[Any, ...], size: int, declared: int) -> str:
    """What is wrong with a header whose FIXED fields failed ``_parse_header``'s test."""
    (magic, version, kind_code, reply_code, dtype_code, top_k, ndim, n_timing, _, _, _, _, _,
     tokens, n_idx, _, error_len, rows, n_rewinds, n_row_tokens, n_fed, flags) = fields
    if magic != MAGIC:
        return f"bad magic {bytes(magic)!r}: not a zctl data-plane frame"
    if version != PROTOCOL_VERSION:
        return (f"protocol version {version} is not supported (this node speaks "
                f"{PROTOCOL_VERSION})")
    if kind_code not in KINDS:
        return f"unknown frame kind {kind_code}"
    if reply_code not in REPLY_MODES:
        return f"unknown reply mode {reply_code}"
    if dtype_code not in DTYPE_OK:
        return f"unknown payload dtype code {dtype_code}"
    if (ndim > MAX_NDIM or tokens > MAX_TOKENS or n_timing > MAX_STAGES or top_k > MAX_TOP_K
            or error_len > MAX_ERROR_BYTES or not 1 <= rows <= MAX_ROWS):
        return (f"absurd header: {ndim} dimensions (limit {MAX_NDIM}), {tokens} tokens (limit "
                f"{MAX_TOKENS}), {n_timing} timing records (limit {MAX_STAGES}), top_k {top_k} "
                f"(limit {MAX_TOP_K}), {error_len} error bytes (limit {MAX_ERROR_BYTES}), "
                f"{rows} rows (1 to {MAX_ROWS})")
    if n_rewinds and n_rewinds != rows:
        return f"{n_rewinds} row rewinds for {rows} rows"
    if n_row_tokens and n_row_tokens != rows:
        return f"{n_row_tokens} row token counts for {rows} rows"
    if n_idx > tokens:
        return f"{n_idx} logits indices for a {tokens}-token step"
    if n_fed > tokens:
        return f"{n_fed} fed tokens for a {tokens}-token step"
    if flags & ~FLAGS:
        return (f"unknown flags {flags & ~FLAGS:#x} (this node knows GUESSED {GUESSED:#x}, "
                f"ONE_QUERY {ONE_QUERY:#x} and LONG_ROPE {LONG_ROPE:#x})")
    if not n_row_tokens and tokens % rows:
        return f"{tokens} positions do not split into {rows} equal rows"
    if not n_row_tokens and n_idx > tokens // rows:
        return f"{n_idx} logits indices for a {tokens // rows}-token step"
    what = "truncated header" if size < declared else "trailing bytes after header"
    return f"{what}: {size} bytes, the header declares {declared}"


def check_semantics(header: HiddenStateFrame) -> None:
    """Cross-field checks a well-packed header must still pass (positions are checked
    non-negative while decoding)."""
    tokens = header.tokens
    if header.logits_idx.size and (int(header.logits_idx.min()) < 0
                                   or int(header.logits_idx.max()) >= tokens):
        raise FrameError(f"logits_idx {header.logits_idx.tolist()} out of range for "
                         f"{tokens} tokens", header)
    if header.rows > 1 and header.mask_tail:
        raise FrameError("a row group's step rewinds per row (row_rewinds), not with "
                         "mask_tail", header)
    if (header.fed.size or header.guessed) and (
            header.kind not in (Kind.STEP, Kind.ERROR) or header.rows != 1 or header.ragged
            or header.fed.size != tokens):
        raise FrameError("only a 1-row step carries its fed tokens (one per position; "
                         "guessed needs them)", header)
    if header.one_query and header.kind not in (Kind.STEP, Kind.ERROR):
        raise FrameError(f"a {header.kind.name} frame is not computed: it cannot be a "
                         "one-query step", header)
    if header.long_rope and header.kind != Kind.RESET:
        raise FrameError(f"a {header.kind.name} frame begins no sequence: only a RESET "
                         "says it turns with LongRoPE's long set", header)
    if header.row_rewinds.size and header.kind not in (Kind.STEP, Kind.ERROR):
        raise FrameError(f"a {header.kind.name} frame carries no row rewinds", header)
    if header.ragged and header.kind not in (Kind.STEP, Kind.REPLY, Kind.ERROR):
        raise FrameError(f"a {header.kind.name} frame has no ragged rows", header)
    if header.kind == Kind.STEP and header.ragged:
        if header.dtype is None or len(header.shape) < 2 or header.shape[:2] != (1, tokens):
            raise FrameError(f"a ragged step's payload must be [1, {tokens}, ...] for its "
                             f"{header.rows} rows of {header.row_tokens.tolist()} tokens, got "
                             f"shape {list(header.shape)}", header)
    elif header.kind == Kind.STEP:
        if (header.dtype is None or len(header.shape) < 2 or header.shape[1] != tokens
                or header.shape[0] != header.rows):
            raise FrameError(f"a step payload must be [{header.rows}, {tokens}, ...] for its "
                             f"{header.rows} row(s) of {tokens} positions, got shape "
                             f"{list(header.shape)}", header)
    elif header.kind == Kind.REPLY:
        check_reply_shape(header)
    elif header.kind == Kind.GROUP:
        if tokens or header.mask_tail or header.rows != 1 or header.dtype is not None and (
                header.dtype != DTYPES[4] or len(header.shape) != 1):
            raise FrameError("a GROUP frame carries only its member stream ids (int64 "
                             "[members]; none: disband)", header)
    elif header.kind == Kind.PREFIX:
        if (tokens or header.mask_tail or header.rows != 1 or header.dtype != DTYPES[4]
                or header.shape != (PREFIX_FIELDS,)):
            raise FrameError(f"a PREFIX frame carries only int64 [{PREFIX_FIELDS}] (op, entry, "
                             "length, take, stream)", header)
    elif header.kind == Kind.CANCEL:
        if (tokens or header.mask_tail or header.rows != 1 or header.dtype != DTYPES[4]
                or header.shape != (CANCEL_FIELDS,)):
            raise FrameError(f"a CANCEL frame carries only int64 [{CANCEL_FIELDS}] (first step, "
                             "last step, tokens kept)", header)
    elif header.dtype is not None:
        raise FrameError(f"a {header.kind.name} frame carries no payload", header)
    elif header.kind == Kind.COMPACT and (tokens or header.mask_tail):
        raise FrameError("a COMPACT frame carries no positions and no mask_tail", header)


def check_reply_shape(header: HiddenStateFrame) -> None:
    rows = header.answer_rows
    if header.reply in (ReplyMode.LOGITS, ReplyMode.LOGITS16):
        dtype = DTYPES[1 if header.reply == ReplyMode.LOGITS else 2]
        ok = header.dtype is dtype and len(header.shape) == 2 and header.shape[0] == rows
        want = f"{dtype.name} [{rows}, vocab]"
    else:
        k = 1 if header.reply == ReplyMode.TOP1 else header.top_k
        ok = header.dtype is TOPK_DTYPE and header.shape == (rows, k)
        value = "logit" if header.reply == ReplyMode.TOP1 else "log-probability"
        want = f"(token, {value}) records [{rows}, {k}]"
    if not ok:
        raise FrameError(f"a {header.reply.name} reply must be {want}, got {header.dtype} "
                         f"{list(header.shape)}", header)


def decode_frame(frames: list[Any]) -> tuple[HiddenStateFrame, np.ndarray | None]:
    """Validate a received multipart message; return its header and a view of its payload."""
    if len(frames) != 2:
        raise FrameError(f"expected 2 parts (header, payload), got {len(frames)}")
    head, body = frames
    header, plain = _parse_header(head if type(head) is bytes else _view(head))
    body = _view(body)
    shape, dtype = header.shape, header.dtype
    if dtype is None:
        if shape or body.nbytes:
            raise FrameError(f"payload of {body.nbytes} bytes, shape {list(shape)} "
                             "without a dtype", header)
        check_semantics(header)
        return header, None
    need = math.prod(shape) * dtype.itemsize  # dimensions are unsigned: 0 if any is 0
    if not need or not shape or need > MAX_PAYLOAD_BYTES or body.nbytes != need:
        raise FrameError(f"absurd payload shape {list(shape)} ({need} bytes)"
                         if not need or not shape or need > MAX_PAYLOAD_BYTES else
                         f"payload is {body.nbytes} bytes but {dtype} {list(shape)} needs "
                         f"{need}", header)
    if not plain:
        check_semantics(header)  # the full checks, off the per-token path
    return header, np.ndarray(shape, dtype, buffer=body)


def _view(part: Any) -> memoryview:
    """A message part's bytes: a zmq.Frame's buffer, or any buffer-protocol object."""
    buffer = getattr(part, "buffer", None)
    return memoryview(part) if buffer is None else buffer
