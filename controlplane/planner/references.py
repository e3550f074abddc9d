"""Named reference figures of devices and links, and a model's profile derived from them.

Until ``zctl node profile`` has measured a node, its profile for a model is derived from
a ``DeviceSpeed``: how fast it reads weights, how fast it multiplies, and what a layer, a
row and an inference call cost besides. One decoder layer's decode step of ``r`` rows is

    layer_fixed + r * row_fixed + bytes_read(r) / weight_bps + r * active_macs / macs_per_s

(bytes_read: the layer's weights in its format; of a mixture of experts the experts the
rows route to), the LM head's is its INT8 (or wider) weights read and ``r`` rows
multiplied, and a prompt token costs a layer ``active_macs / macs_per_s`` beyond the
first. The coordinator's own work per decode step (the generation engine and the head's
frames: ``engine_fixed + r * engine_row``) is added to stage 0's node. Every figure below
is a reference value, not a measurement of the user's PC; the first is derived from this
repository's measurements, the others are scaled from public hardware figures.
docs/design.md ("Planning") says how they are calibrated.
"""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.planner.memory import embedding_bytes, layer_weight_bytes, resident_layer_bytes
from controlplane.planner.profile import ROWS, LinkProfile, NodeProfile, ProfileError, ProfileKey
from controlplane.planner.shape import ModelShape

MS = 1e-3
GB = 1e9
MB = 1e6
# The coordinator's step on one vCPU of the Xeon VM below, as ``zctl node profile`` times it
# (controlplane/engine_step.py; 2026-12-06: 0.087, 0.138, 0.179 and 0.259 ms at 1, 2, 4 and
# 8 rows, whether SmolLM2's vocabulary or the tiny model's): the default of a PC's figures.
ENGINE_FIXED_S = 0.062 * MS
ENGINE_ROW_S = 0.025 * MS


@dataclass(frozen=True)
class DeviceSpeed:
    """A device's speed, independent of the model: what a profile is derived from."""

    name: str
    device: str  # the OpenVINO device: CPU, GPU
    weight_bps: float  # bytes of weights a decode step reads per second
    macs_per_s: float  # multiply-accumulates per second (prompt tokens, extra rows)
    layer_fixed_s: float  # per decoder layer and step, whatever the rows
    row_fixed_s: float  # per decoder layer and row (norms, RoPE, attention's small ops)
    call_s: float  # per inference call: dispatch, the runner's Python, a frame in and out
    basis: str  # where the figures come from
    # the coordinator's own work per decode step (the engine and the head's frames), as a
    # fixed part and one per row; by default the Xeon core's (ENGINE_FIXED_S, ENGINE_ROW_S)
    engine_fixed_s: float = ENGINE_FIXED_S
    engine_row_s: float = ENGINE_ROW_S

    def __post_init__(self) -> None:
        for name in ("weight_bps", "macs_per_s"):
            if not getattr(self, name) > 0:
                raise ProfileError(f"reference {self.name}: {name} must be positive")
        for name in ("layer_fixed_s", "row_fixed_s", "call_s", "engine_fixed_s",
                     "engine_row_s"):
            if not getattr(self, name) >= 0:
                raise ProfileError(f"reference {self.name}: {name} must be >= 0")


# One vCPU of the 2-vCPU Intel Xeon VM (AVX-512 VNNI, AMX) the measurements were taken on.
# From docs/measurements: SmolLM2-135M INT4 on a 2-node cluster with a core per node
# (batching.md, 2026-12-01, 662329b) ran 1 stream at 66.5-70.2 tok/s, 2 streams (two row
# groups of one row) at 150-161 and 4 (two groups of two rows) at 243-250: a busy stage
# (15 layers and half the head) takes ~6.5 ms at one row and 1.25x that at two. With the
# LM head at ~6 layers' time (the split's cost model, export-and-static.md) a layer is
# 0.343 ms at one row and each further row adds 0.086 ms. Of the one-row time 39% is fixed
# per layer, as SmolLM2's and the Llama-3.2-1B shape's layers (1.09 and 11.9 ms a layer on
# one AMD EPYC core, 17x the weights) give; the rest is the 1.91 MB of INT4 weights read
# (15.5 GB/s) and one row multiplied. Prompts: openvino_genai prefilled 1,024 tokens of
# SmolLM2 INT8 in 621 ms on both vCPUs (long-prompts.md, ca9c484); one core taken as 1.9x
# that gives 100 G multiply-accumulates a second. The call: a one-MatMul model's dispatch
# after an idle gap, 0.2 ms, and the framework's 0.1 ms per hop (cluster.md).
XEON_CORE = DeviceSpeed(
    "xeon-core", "CPU", weight_bps=15.5 * GB, macs_per_s=100 * GB, layer_fixed_s=0.134 * MS,
    row_fixed_s=0.050 * MS, call_s=0.3 * MS,
    basis="one vCPU of the Intel Xeon VM of docs/measurements (SmolLM2-135M and Llama-3.2-1B "
          "shape runs, 2026-12-01..04)")

# Scaled references: weight bandwidth ~65% of the memory's peak (what CPU decoders reach),
# multiply-accumulates from the cores at the Xeon core's rate per core (AVX2-only cores at
# ~60%), fixed costs (the coordinator's step among them) from the Xeon core's, smaller on
# faster cores, as their call costs.
REFERENCE_SPEEDS: dict[str, DeviceSpeed] = {speed.name: speed for speed in (
    XEON_CORE,
    DeviceSpeed("desktop-ddr5", "CPU", weight_bps=58 * GB, macs_per_s=600 * GB,
                layer_fixed_s=0.05 * MS, row_fixed_s=0.02 * MS, call_s=0.2 * MS,
                engine_fixed_s=0.041 * MS, engine_row_s=0.017 * MS,
                basis="an 8-core desktop, dual-channel DDR5-5600 (89.6 GB/s peak); scaled"),
    DeviceSpeed("desktop-ddr4", "CPU", weight_bps=33 * GB, macs_per_s=400 * GB,
                layer_fixed_s=0.07 * MS, row_fixed_s=0.03 * MS, call_s=0.25 * MS,
                engine_fixed_s=0.052 * MS, engine_row_s=0.021 * MS,
                basis="a 6-core desktop, dual-channel DDR4-3200 (51.2 GB/s peak); scaled"),
    DeviceSpeed("laptop", "CPU", weight_bps=25 * GB, macs_per_s=200 * GB,
                layer_fixed_s=0.10 * MS, row_fixed_s=0.04 * MS, call_s=0.3 * MS,
                basis="a 4-core laptop, dual-channel DDR4-3200 (51.2 GB/s peak), held back "
                      "by its power limit; scaled"),
    DeviceSpeed("mini-pc-old", "CPU", weight_bps=12 * GB, macs_per_s=60 * GB,
                layer_fixed_s=0.20 * MS, row_fixed_s=0.08 * MS, call_s=0.5 * MS,
                engine_fixed_s=0.103 * MS, engine_row_s=0.042 * MS,
                basis="an older 4-core mini PC, single-channel DDR4-2400 (19.2 GB/s peak), "
                      "AVX2 only; scaled"),
)}


def reference_speed(name: str) -> DeviceSpeed:
    try:
        return REFERENCE_SPEEDS[name]
    except KeyError:
        raise ProfileError(f"no reference profile {name!r}; the references are "
                           f"{', '.join(REFERENCE_SPEEDS)}") from None


def derive_profile(speed: DeviceSpeed, shape: ModelShape, weights: str,
                   free_memory: int, exact_experts: bool = False) -> NodeProfile:
    """The profile ``speed`` implies for ``shape`` in ``weights`` (the model of time above);
    ``exact_experts``: a mixture of experts' weights in their exact i8 form, read as such."""
    per_weight = (layer_weight_bytes(shape, weights, exact_experts=exact_experts)
                  / shape.layer_weights())
    active = shape.active_layer_weights()

    def layer_s(rows: int) -> float:
        read = shape.layer_weights_read(rows) * per_weight
        return (speed.layer_fixed_s + rows * speed.row_fixed_s + read / speed.weight_bps
                + rows * active / speed.macs_per_s)

    def head_s(rows: int) -> float:
        return (embedding_bytes(shape, weights) / speed.weight_bps
                + rows * shape.embedding_weights() / speed.macs_per_s)

    return NodeProfile(
        key=ProfileKey(shape.fingerprint(), weights, speed.device, "reference",
                       exact_experts=exact_experts),
        decode_s=tuple(layer_s(r) for r in ROWS), head_decode_s=tuple(head_s(r) for r in ROWS),
        prefill_tokens_per_s=speed.macs_per_s / active, call_s=speed.call_s,
        engine_decode_s=tuple(speed.engine_fixed_s + r * speed.engine_row_s for r in ROWS),
        layer_bytes=resident_layer_bytes(shape, weights, exact_experts),
        free_memory=free_memory,
        source=f"reference {speed.name}: {speed.basis}")


@dataclass(frozen=True)
class AccessLink:
    """How a PC reaches the others: its share of a round trip and its bandwidth each way.
    A link between two PCs adds their shares and takes the narrower bandwidth."""

    name: str
    rtt_share_s: float
    up_bps: float
    down_bps: float
    basis: str

    def to(self, other: AccessLink) -> LinkProfile:
        """The link from this PC to ``other``."""
        return LinkProfile(self.rtt_share_s + other.rtt_share_s,
                           min(self.up_bps, other.down_bps), min(other.up_bps, self.down_bps))


REFERENCE_LINKS: dict[str, AccessLink] = {link.name: link for link in (
    AccessLink("loopback", 0.27 * MS, 2 * GB, 2 * GB,
               basis="two processes on one machine: a frame-sized ZeroMQ round trip took 0.54 "
                     "ms after an idle gap, as a lone stream's hops are (0.26 ms busy; "
                     "docs/measurements/cluster.md)"),
    AccessLink("ethernet", 0.15 * MS, 117 * MB, 117 * MB,
               basis="gigabit Ethernet through a switch: ~0.3 ms round trip, 117 MB/s of payload"),
    AccessLink("ethernet-2.5g", 0.12 * MS, 290 * MB, 290 * MB,
               basis="2.5-gigabit Ethernet: ~0.25 ms round trip, 290 MB/s of payload"),
    AccessLink("wifi", 3.0 * MS, 8 * MB, 12 * MB,
               basis="Wi-Fi 5 across a home: 3 ms of the round trip to the access point, "
                     "~65 Mbit/s up and ~100 Mbit/s down"),
)}


def reference_link(name: str) -> AccessLink:
    try:
        return REFERENCE_LINKS[name]
    except KeyError:
        raise ProfileError(f"no reference link {name!r}; the references are "
                           f"{', '.join(REFERENCE_LINKS)}") from None
