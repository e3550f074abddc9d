"""The same layers on the same nodes for both systems: llama.cpp's placement arguments from
zctl's split, and the check, from llama-server's load log, that they landed there.

zctl's export cuts layers into stages (the manifest's half-open ranges); stage 0 runs on
the coordinator (127.0.0.1) with the token embedding, the last stage on the last node
with the LM head. llama.cpp keeps the input layer on its host (llama-server) and lays the
repeating layers, then the output layer, out in order: the first ``n_layer + 1 - ngl`` on
the host's CPU, the rest over the devices (the RPC servers, in ``--rpc`` order) in the
proportions of ``--tensor-split`` (llama-model.cpp, ``load_tensors``). So ``-ngl`` is every
layer past stage 0 plus the output layer, and the split is each other stage's layer count,
the output layer counted with the last. Pure functions.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

Ranges = Sequence[tuple[int, int]]  # per node, half-open [start, end), node 0 the host

BUFFER_LINE = re.compile(r"load_tensors:\s+(\S+) model buffer size =\s+([0-9.]+) MiB")
OFFLOADED_LINE = re.compile(r"load_tensors: offloaded (\d+)/(\d+) layers")
LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.")
OUTPUT_TENSORS = ("output.weight", "output_norm.weight")
TOLERANCE_MIB = 0.25  # alignment padding of a device's buffer, per device
TOLERANCE = 0.01


class PlacementError(ValueError):
    """A split llama.cpp cannot express, or a load log that shows another placement."""


@dataclass(frozen=True)
class LlamaPlacement:
    """llama.cpp's arguments for a split: ``-ngl`` and ``--tensor-split``."""

    gpu_layers: int
    tensor_split: tuple[int, ...]

    def args(self) -> list[str]:
        if not self.tensor_split:
            return ["-ngl", "0"]
        return ["-ngl", str(self.gpu_layers),
                "--tensor-split", ",".join(str(n) for n in self.tensor_split)]


def check_ranges(ranges: Ranges, num_layers: int) -> None:
    expected = 0
    for start, end in ranges:
        if start != expected or end <= start:
            raise PlacementError(f"layer ranges {list(ranges)} do not cover 0..{num_layers - 1} "
                                 "in order")
        expected = end
    if expected != num_layers:
        raise PlacementError(f"layer ranges {list(ranges)} cover {expected} of {num_layers} layers")


def llama_placement(ranges: Ranges, num_layers: int) -> LlamaPlacement:
    """The arguments that put node i's layers on node i (0: llama-server's host CPU; i >= 1:
    the i-th RPC server) and the output layer on the last node."""
    check_ranges(ranges, num_layers)
    if len(ranges) == 1:
        return LlamaPlacement(0, ())
    counts = [end - start for start, end in ranges[1:]]
    counts[-1] += 1  # the output layer, with the last stage
    return LlamaPlacement(sum(counts), tuple(counts))


def layer_devices(placement: LlamaPlacement, num_layers: int) -> list[int]:
    """Where llama.cpp puts layer 0..num_layers (the last: the output layer): -1 for the
    host's CPU, else the device's index, by llama-model.cpp's rule in float32."""
    splits = np.cumsum(np.asarray(placement.tensor_split, dtype=np.float32), dtype=np.float32)
    if len(splits):
        splits = splits / splits[-1]
    total = num_layers + 1
    first_gpu = max(total - placement.gpu_layers, 0)
    active = min(placement.gpu_layers, total) if len(splits) else 0
    out = []
    for layer in range(total):
        if layer < first_gpu or layer - first_gpu >= active:
            out.append(-1)
        else:
            fraction = np.float32(layer - first_gpu) / np.float32(active)
            out.append(bisect.bisect_right(list(splits), fraction))
    return out


def node_of_layers(ranges: Ranges) -> list[int]:
    """zctl's node of each layer, then of the output layer (the LM head: the last node)."""
    nodes = [node for node, (start, end) in enumerate(ranges) for _ in range(start, end)]
    return nodes + [len(ranges) - 1]


def describe(ranges: Ranges) -> list[str]:
    """Each node's share, as the output prints it."""
    last = len(ranges) - 1
    return [f"layers {start}-{end - 1}" + (" + embedding" if node == 0 else "")
            + (" + LM head" if node == last else "")
            for node, (start, end) in enumerate(ranges)]


def expected_device_bytes(tensor_bytes: Mapping[str, int], devices: Sequence[int],
                          num_layers: int) -> dict[int, int]:
    """The weight bytes each device (-1: the host) holds for layer placement ``devices``
    (from layer_devices): each block's tensors with its layer, the output norm and head
    with the output layer, the token embedding on the host (and as the head too when the
    model ties them: no output.weight)."""
    out: dict[int, int] = {}

    def add(device: int, size: int) -> None:
        out[device] = out.get(device, 0) + size

    for name, size in tensor_bytes.items():
        if match := LAYER_TENSOR.match(name):
            add(devices[int(match.group(1))], size)
        elif name in OUTPUT_TENSORS:
            add(devices[num_layers], size)
        else:
            add(-1, size)
    if "output.weight" not in tensor_bytes and "token_embd.weight" in tensor_bytes:
        add(devices[num_layers], tensor_bytes["token_embd.weight"])
    return out


@dataclass(frozen=True)
class LoadedPlacement:
    """What llama-server's load log says: layers offloaded and each buffer's MiB."""

    offloaded: int | None
    buffers: dict[str, float]


def parse_load_log(text: str) -> LoadedPlacement:
    offloaded = OFFLOADED_LINE.search(text)
    return LoadedPlacement(int(offloaded.group(1)) if offloaded else None,
                           {m.group(1): float(m.group(2)) for m in BUFFER_LINE.finditer(text)})


def verify_loaded(loaded: LoadedPlacement, placement: LlamaPlacement, endpoints: Sequence[str],
                  expected: Mapping[int, int]) -> list[str]:
    """Lines saying where the weights landed, each device's buffer against the bytes its
    layers hold; PlacementError when the log shows other layers offloaded, a device
    without its buffer, or one whose size is off by more than alignment padding."""
    lines = []
    if placement.tensor_split and loaded.offloaded != placement.gpu_layers:
        raise PlacementError(f"llama-server offloaded {loaded.offloaded} layers, the split "
                             f"asks for {placement.gpu_layers}")
    for device, endpoint in enumerate(endpoints):
        name = next((n for n in loaded.buffers if n.endswith(f"[{endpoint}]")), None)
        want = expected.get(device, 0) / 2**20
        if name is None:
            raise PlacementError(f"the load log shows no model buffer on {endpoint}")
        got = loaded.buffers[name]
        if abs(got - want) > TOLERANCE_MIB + TOLERANCE * want:
            raise PlacementError(f"{name} holds {got:.2f} MiB; its layers are {want:.2f} MiB")
        lines.append(f"{name}: {got:.2f} MiB (its layers: {want:.2f} MiB)")
    host = {n: v for n, v in loaded.buffers.items() if not n.startswith("RPC")}
    lines.append("host: " + ", ".join(f"{n} {v:.2f} MiB" for n, v in host.items())
                 + f" (its layers: {expected.get(-1, 0) / 2**20:.2f} MiB)")
    return lines
