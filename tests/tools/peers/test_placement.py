"""llama.cpp's placement arguments from zctl's split, and the load log's check."""

from __future__ import annotations

import pytest

from tools.peers.placement import (
    LlamaPlacement,
    PlacementError,
    describe,
    expected_device_bytes,
    layer_devices,
    llama_placement,
    node_of_layers,
    parse_load_log,
    verify_loaded,
)


@pytest.mark.parametrize("ranges, layers", [
    ([(0, 30)], 30),
    ([(0, 16), (16, 30)], 30),
    ([(0, 11), (11, 21), (21, 30)], 30),
    ([(0, 9), (9, 16)], 16),
    ([(0, 6), (6, 11), (11, 16)], 16),
    ([(0, 1), (1, 2), (2, 30)], 30),
])
def test_the_arguments_put_each_stage_on_its_node_and_the_head_on_the_last(ranges, layers) -> None:
    placement = llama_placement(ranges, layers)
    devices = layer_devices(placement, layers)
    # -1 is llama-server's host (node 0); device d is the RPC server of node d + 1
    assert [d + 1 for d in devices] == node_of_layers(ranges)


def test_the_arguments_of_a_two_node_split() -> None:
    placement = llama_placement([(0, 16), (16, 30)], 30)
    assert placement.args() == ["-ngl", "15", "--tensor-split", "15"]
    three = llama_placement([(0, 11), (11, 21), (21, 30)], 30)
    assert three.args() == ["-ngl", "20", "--tensor-split", "10,10"]
    assert llama_placement([(0, 30)], 30).args() == ["-ngl", "0"]


def test_a_split_that_does_not_cover_the_layers_is_refused() -> None:
    with pytest.raises(PlacementError):
        llama_placement([(0, 10), (12, 30)], 30)
    with pytest.raises(PlacementError):
        llama_placement([(0, 10)], 30)


def test_expected_bytes_follow_the_layers_and_a_tied_head() -> None:
    tensors = {"token_embd.weight": 100, "blk.0.attn_q.weight": 10, "blk.1.attn_q.weight": 10,
               "blk.2.attn_q.weight": 10, "output_norm.weight": 1}
    devices = layer_devices(llama_placement([(0, 1), (1, 3)], 3), 3)
    assert expected_device_bytes(tensors, devices, 3) == {-1: 110, 0: 10 + 10 + 1 + 100}


LOG = """llama_model_load: ...
load_tensors: offloading output layer to GPU
load_tensors: offloaded 15/31 layers to GPU
load_tensors:   CPU_Mapped model buffer size =    60.10 MiB
load_tensors: RPC0[127.0.0.2:40001] model buffer size =    45.00 MiB
"""


def test_the_load_log_is_checked_against_the_split() -> None:
    placement = LlamaPlacement(15, (15,))
    loaded = parse_load_log(LOG)
    assert loaded.offloaded == 15 and loaded.buffers["RPC0[127.0.0.2:40001]"] == 45.0
    lines = verify_loaded(loaded, placement, ["127.0.0.2:40001"], {0: 45 * 2**20, -1: 60 * 2**20})
    assert "RPC0[127.0.0.2:40001]: 45.00 MiB" in lines[0]
    with pytest.raises(PlacementError, match="its layers are 30.00"):
        verify_loaded(loaded, placement, ["127.0.0.2:40001"], {0: 30 * 2**20})
    with pytest.raises(PlacementError, match="offloaded 15"):
        verify_loaded(loaded, LlamaPlacement(20, (10, 10)), ["127.0.0.2:40001"], {})
    with pytest.raises(PlacementError, match="no model buffer on 127.0.0.3"):
        verify_loaded(loaded, placement, ["127.0.0.3:1"], {0: 0})


def test_each_nodes_share_is_named() -> None:
    assert describe([(0, 16), (16, 30)]) == ["layers 0-15 + embedding", "layers 16-29 + LM head"]
