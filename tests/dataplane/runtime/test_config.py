"""RuntimeSpec: the compile properties a spec gives, per device, and which spec is exact."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, asdict
from typing import ClassVar

import pytest

from dataplane.runtime.config import RuntimeSpec, device_kind


def test_the_device_kind_is_the_plugin() -> None:
    assert [device_kind(RuntimeSpec(device=d)) for d in ("CPU", "GPU.1", "NPU:0", "AUTO")] == [
        "CPU", "GPU", "NPU", "AUTO"]


def test_properties_carry_what_is_set_and_leave_the_rest_to_the_plugin() -> None:
    assert RuntimeSpec(precision=None, device="GPU").properties() == {
        "PERFORMANCE_HINT": "LATENCY"}
    props = RuntimeSpec(num_threads=2, kv_cache_precision="u8").properties()
    assert props == {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32",
                     "INFERENCE_NUM_THREADS": 2, "KV_CACHE_PRECISION": "u8",
                     "KEY_CACHE_QUANT_MODE": "BY_TOKEN", "CPU_RUNTIME_CACHE_CAPACITY": 1000}


def test_a_u8_kv_cache_on_cpu_quantizes_keys_by_token() -> None:
    """The plugin's default cache (u8) and an asked-for u8 one take by-token keys, on the
    CPU only; an f16 or f32 cache has nothing to quantize."""
    for kv in (None, "u8"):
        assert RuntimeSpec(kv_cache_precision=kv).properties()["KEY_CACHE_QUANT_MODE"] == \
            "BY_TOKEN"
    for spec in (RuntimeSpec(kv_cache_precision="f16"), RuntimeSpec(kv_cache_precision="f32"),
                 RuntimeSpec(device="GPU"), RuntimeSpec(device="NPU"), RuntimeSpec(device="AUTO")):
        assert "KEY_CACHE_QUANT_MODE" not in spec.properties(), spec

    class ByChannel(RuntimeSpec):
        key_cache_by_token: ClassVar[bool] = False

    assert "KEY_CACHE_QUANT_MODE" not in ByChannel().properties()
    assert asdict(ByChannel()) == asdict(RuntimeSpec())  # not a field: not on the wire


def test_a_subclass_may_set_what_is_not_a_field() -> None:
    class Pinned(RuntimeSpec):
        cpu_pinning: ClassVar[bool | None] = True
        runtime_cache_capacity: ClassVar[int | None] = None

    props = Pinned().properties()
    assert props["ENABLE_CPU_PINNING"] is True and "CPU_RUNTIME_CACHE_CAPACITY" not in props
    assert "ENABLE_CPU_PINNING" not in Pinned(device="GPU").properties()
    assert asdict(Pinned()) == asdict(RuntimeSpec())  # what the control messages carry


def test_only_f32_activations_and_kv_are_exact() -> None:
    assert RuntimeSpec(kv_cache_precision="f32", dynamic_quantization=False).exact
    assert not RuntimeSpec(kv_cache_precision="f32").exact  # dynamic quantization on
    assert not RuntimeSpec(kv_cache_precision="u8", dynamic_quantization=False).exact
    assert not RuntimeSpec(precision=None, kv_cache_precision="f32",
                           dynamic_quantization=False).exact


def test_a_spec_is_frozen_and_hashable() -> None:
    spec = RuntimeSpec(num_threads=4)
    with pytest.raises(FrozenInstanceError):
        spec.num_threads = 2  # type: ignore[misc]
    assert {spec: 1}[RuntimeSpec(num_threads=4)] == 1  # a key of the compiled stages kept
