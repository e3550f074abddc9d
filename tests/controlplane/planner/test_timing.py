"""The model of time and memory: profiles, reference figures, frames, tok/s, TTFT."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from controlplane.placement import RUNTIME_OVERHEAD
from controlplane.planner.memory import (
    layer_weight_bytes,
    max_layers,
    resident_layer_bytes,
    stage_cost,
    stage_need,
)
from controlplane.planner.presets import PRESETS
from controlplane.planner.profile import (
    LinkProfile,
    Links,
    NodeProfile,
    ProfileError,
    ProfileKey,
    at_rows,
)
from controlplane.planner.references import (
    REFERENCE_LINKS,
    REFERENCE_SPEEDS,
    XEON_CORE,
    derive_profile,
    reference_link,
    reference_speed,
)
from controlplane.planner.timing import (
    Pipeline,
    Stage,
    group_options,
    reply_frame_bytes,
    step_frame_bytes,
    step_times,
    stream_tok_s,
    throughput,
    ttft,
)
from dataplane.wire.frames import HiddenStateFrame, Kind, ReplyMode, encode_frame, frame_bytes, stamp

SMOL = PRESETS["smollm2-135m"]
GiB = 1 << 30
LOOP = REFERENCE_LINKS["loopback"].to(REFERENCE_LINKS["loopback"])


def smol_pipe(weights: str = "int4", split: int = 17, link: LinkProfile = LOOP) -> Pipeline:
    profile = derive_profile(XEON_CORE, SMOL, weights, 8 * GiB)
    return Pipeline(SMOL, (Stage("a", profile, 0, split), Stage("b", profile, split, 30)),
                    (link,), link)


def test_int4_bytes_per_layer_match_a_real_export() -> None:
    # the middle stage of a 3-stage SmolLM2 INT4 export (group 64): 11 layers in 21,035,816 bytes
    assert layer_weight_bytes(SMOL, "int4") == pytest.approx(21_035_816 / 11, rel=0.005)
    # INT8 in i8 groups: a scale per 64 inputs of Q/K/V, O and gate/up, per 128 of down
    down = SMOL.intermediate * SMOL.hidden
    assert layer_weight_bytes(SMOL, "int8") == pytest.approx(
        (SMOL.layer_weights() - down) * (1 + 2 / 64) + down * (1 + 2 / 128))
    assert layer_weight_bytes(SMOL, "int8", "u8-channel") == pytest.approx(
        (SMOL.layer_weights() - down) * (1 + 3 / 576) + down * (1 + 3 / 1536))
    assert resident_layer_bytes(SMOL, "fp16") == int(2 * SMOL.layer_weights() * RUNTIME_OVERHEAD)


def test_a_stage_holds_the_embedding_first_and_the_head_last() -> None:
    cost = stage_cost(SMOL, "int8", context=1024, streams=2)
    middle, first, last = (stage_need(cost, 3, f, la) for f, la in
                           ((False, False), (True, False), (False, True)))
    assert first == last == middle + cost.first_extra
    assert stage_need(cost, 3, True, True) == middle + 2 * cost.first_extra
    assert cost.kv_bytes_per_layer == 2 * 3 * 64 * 2 * 1024 * 2
    usable = stage_need(cost, 5, True, False)
    assert max_layers(cost, usable, 30, True, False) == 5
    assert max_layers(cost, usable - 1, 30, True, False) == 4
    assert max_layers(cost, usable, 30, False, False) > 5
    assert max_layers(cost, 0, 30, False, False) == 0
    assert max_layers(cost, 10**15, 30, False, False) == 30


def test_figures_between_and_beyond_the_profiled_rows() -> None:
    values = (1.0, 1.5, 2.5, 4.5)
    assert [at_rows(values, r) for r in (0.5, 1, 2, 3, 4, 8)] == [1.0, 1.0, 1.5, 2.0, 2.5, 4.5]
    assert at_rows(values, 16) == pytest.approx(8.5)


def profile(**change) -> NodeProfile:
    base = derive_profile(XEON_CORE, SMOL, "int4", GiB)
    return dataclasses.replace(base, **change)


@pytest.mark.parametrize("change, message", [
    ({"decode_s": (1.0, 2.0, 3.0)}, "needs 4 figures"),
    ({"decode_s": (1.0, 0.5, 3.0, 4.0)}, "must not fall"),
    ({"head_decode_s": (0.0, 1.0, 1.0, 1.0)}, "positive seconds"),
    ({"prefill_tokens_per_s": 0.0}, "prefill_tokens_per_s"),
    ({"layer_bytes": 0}, "layer_bytes"),
    ({"frame_decode_s": (1e-4, 1e-4)}, "frame_decode_s needs 4 figures"),
    ({"frame_decode_s": (2e-4, 1e-4, 1e-4, 1e-4)}, "frame_decode_s must not fall"),
])
def test_a_bad_profile_is_refused(change: dict, message: str) -> None:
    with pytest.raises(ProfileError, match=message):
        profile(**change)


def test_a_profile_of_another_shape_format_or_version_is_stale() -> None:
    measured = profile(key=ProfileKey(SMOL.fingerprint(), "int4", "CPU", "2026.4.1"))
    want = ProfileKey(SMOL.fingerprint(), "int4", "CPU", "2026.4.1")
    measured.check_for(want, "pc")
    with pytest.raises(ProfileError, match=r"node pc: .*weights 'int4', not 'int8'.*profile it again"):
        measured.check_for(dataclasses.replace(want, weights="int8"), "pc")
    with pytest.raises(ProfileError, match="OpenVINO 2026.4.1, not 2027.0"):
        measured.check_for(dataclasses.replace(want, openvino="2027.0"), "pc")
    with pytest.raises(ProfileError, match="shape"):
        measured.check_for(dataclasses.replace(want, shape="other"), "pc")
    profile().check_for(dataclasses.replace(want, openvino="2027.0"), "pc")  # derived: any version


def test_a_profile_timed_on_another_int8_form_is_stale() -> None:
    measured = profile(key=ProfileKey(SMOL.fingerprint(), "int8", "CPU", "2026.4.1", 5,
                                      "u8-channel"))
    want = ProfileKey(SMOL.fingerprint(), "int8", "CPU", "2026.4.1", 5, "u8-channel")
    measured.check_for(want, "pc")
    measured.check_for(dataclasses.replace(want, int8_form=None), "pc")  # any form asked
    with pytest.raises(ProfileError, match="INT8 form 'u8-channel', not 'i8-groups'"):
        measured.check_for(dataclasses.replace(want, int8_form="i8-groups"), "pc")
    default = profile(key=dataclasses.replace(want, int8_form=None))  # int8's: i8 groups
    default.check_for(dataclasses.replace(want, int8_form="i8-groups"), "pc")
    with pytest.raises(ProfileError, match="INT8 form 'i8-groups', not 'u8-channel'"):
        default.check_for(want, "pc")
    profile().check_for(dataclasses.replace(want, weights="int4", int8_form="i8-groups"),
                        "pc")  # a derived profile timed no INT8 form


def test_links_are_found_either_way_and_missing_ones_are_named() -> None:
    wifi, wire = REFERENCE_LINKS["wifi"], REFERENCE_LINKS["ethernet"]
    links = Links({("laptop", "desktop"): wifi.to(wire)})
    there, back = links.link("laptop", "desktop"), links.link("desktop", "laptop")
    assert there.forward_bps == wifi.up_bps and back.forward_bps == wifi.down_bps
    assert there.rtt_s == back.rtt_s == wifi.rtt_share_s + wire.rtt_share_s
    with pytest.raises(ProfileError, match="no link figures between laptop and mini"):
        links.check_nodes(["laptop", "desktop", "mini"])
    with pytest.raises(ProfileError, match="given twice"):
        Links({("a", "b"): there, ("b", "a"): there})
    with pytest.raises(ProfileError, match="bandwidth"):
        LinkProfile(0.001, 0, 1)
    with pytest.raises(ProfileError, match="no reference profile 'gpu'"):
        reference_speed("gpu")
    with pytest.raises(ProfileError, match="no reference link"):
        reference_link("carrier pigeon")


def test_the_xeon_reference_reproduces_the_measurements_it_came_from() -> None:
    """SmolLM2 INT4, a core per node (docs/measurements/batching.md, 662329b): 1 stream
    66.5-70.2 tok/s, 2 streams 150-161, 4 streams 243-250. Reference values: within 15%."""
    pipe = smol_pipe()
    assert stream_tok_s(pipe) == pytest.approx(68.3, rel=0.15)
    assert throughput(pipe, 2).tok_s == pytest.approx(155, rel=0.15)
    assert throughput(pipe, 4).tok_s == pytest.approx(246, rel=0.15)
    assert derive_profile(XEON_CORE, SMOL, "int4", GiB).layer_s(1) == pytest.approx(0.343e-3,
                                                                                     rel=0.01)


def test_formats_rank_as_measured() -> None:
    """docs/quality.md: INT8 0.82-0.90x, FP16 0.43-0.56x, FP32 0.32-0.45x INT4's tok/s."""
    one = {w: stream_tok_s(Pipeline(SMOL, (Stage("a", derive_profile(XEON_CORE, SMOL, w, GiB),
                                                 0, 30),), (), None))
           for w in ("int4", "int8", "fp16", "fp32")}
    assert 0.72 < one["int8"] / one["int4"] < 0.95
    assert 0.40 < one["fp16"] / one["int4"] < 0.65
    assert 0.25 < one["fp32"] / one["int4"] < 0.50


def test_every_reference_is_slower_the_bigger_the_model() -> None:
    for speed in REFERENCE_SPEEDS.values():
        times = [derive_profile(speed, PRESETS[m], "int4", GiB).layer_s(1)
                 for m in ("smollm2-135m", "llama-3.2-1b", "llama-3.1-8b", "llama-3.1-70b")]
        assert times == sorted(times), speed.name


def test_frame_sizes_are_what_the_wire_sends() -> None:
    for rows, tokens, stage in ((1, 1, 0), (4, 1, 2), (1, 16, 1)):
        header = HiddenStateFrame(Kind.STEP, 1, 2, 3, positions=np.arange(rows * tokens),
                                  rows=rows, timings=b"".join(stamp(b"", s, 0, 0, 0, 0, 0, 0)
                                                              for s in range(stage + 1)))
        hidden = np.zeros((rows, tokens, SMOL.hidden), dtype=np.float32)
        assert frame_bytes(encode_frame(header, hidden)) == step_frame_bytes(SMOL, rows, tokens,
                                                                            stage)
    reply = HiddenStateFrame(Kind.REPLY, 1, 2, 3, reply=ReplyMode.TOP1,
                             timings=b"".join(stamp(b"", s, 0, 0, 0, 0, 0, 0) for s in range(2)))
    records = np.zeros((4, 1), dtype=[("token", "<i4"), ("logit", "<f4")])
    assert frame_bytes(encode_frame(reply, records)) <= reply_frame_bytes(4, 2)


def test_one_stream_pays_every_stage_hop_and_the_reply() -> None:
    slow = LinkProfile(0.050, 1e6, 1e6)
    pipe = smol_pipe(link=slow)
    times = step_times(pipe, 1)
    assert times.cycle_s == pytest.approx(sum(times.stage_s) + times.hop_s[0] + times.reply_s)
    assert times.hop_s[0] == pytest.approx(0.025 + step_frame_bytes(SMOL, 1, 1, 0) / 1e6)
    assert stream_tok_s(pipe) == pytest.approx(1 / times.cycle_s)
    # behind 50 ms hops, row groups pipelined: G groups per cycle until a stage is full
    eight = throughput(pipe, 8)
    assert eight.groups == 8 and eight.rows == 1
    assert eight.tok_s == pytest.approx(8 / times.cycle_s)


def test_streams_are_bounded_by_the_bottleneck() -> None:
    pipe = smol_pipe()
    for streams in (2, 3, 5, 8, 16):
        result = throughput(pipe, streams)
        times = step_times(pipe, result.rows)
        assert result.tok_s <= streams / (result.groups * times.bottleneck_s) * (1 + 1e-12)
        assert result.tok_s <= streams / times.cycle_s * (1 + 1e-12)
        assert result.tok_s >= throughput(pipe, 1).tok_s
    assert group_options(8) == [(1, 8), (2, 4), (3, 3), (4, 2), (8, 1)]
    with pytest.raises(ValueError):
        group_options(0)


def test_ttft_chunks_a_long_prompt_over_several_stages() -> None:
    pipe = smol_pipe("int8")
    first = ttft(pipe, 1024)
    assert first.chunk < 1024  # pipelined chunks beat one step on two stages
    # SmolLM2 INT8, a core per stage: 909 ms measured (long-prompts.md, ca9c484)
    assert first.seconds == pytest.approx(0.909, rel=0.3)
    one = Pipeline(SMOL, (Stage("a", pipe.stages[0].profile, 0, 30),), (), None)
    alone = ttft(one, 1024)
    assert alone.chunk == 1024 and alone.seconds > first.seconds
    assert ttft(one, 2048).seconds > 2 * alone.seconds  # attention grows with the prompt
    wifi = LinkProfile(0.006, 8e6, 12e6)
    assert ttft(smol_pipe("int8", link=wifi), 1024).seconds > first.seconds


def test_a_pipeline_needs_its_hops() -> None:
    p = derive_profile(XEON_CORE, SMOL, "int4", GiB)
    with pytest.raises(ValueError, match="need 1 hops"):
        Pipeline(SMOL, (Stage("a", p, 0, 10), Stage("b", p, 10, 30)), (), LOOP)
    with pytest.raises(ValueError, match="reply"):
        Pipeline(SMOL, (Stage("a", p, 0, 30),), (), LOOP)


def test_the_coordinators_engine_step_counts_on_the_first_stage_alone() -> None:
    pipe = smol_pipe()
    busy = dataclasses.replace(pipe.stages[0].profile,
                               engine_decode_s=tuple(v + 1e-3 for v in
                                                     pipe.stages[0].profile.engine_decode_s))
    slower = dataclasses.replace(pipe, stages=(dataclasses.replace(pipe.stages[0], profile=busy),
                                               dataclasses.replace(pipe.stages[1], profile=busy)))
    before, after = step_times(pipe, 4), step_times(slower, 4)
    assert after.stage_s[0] == pytest.approx(before.stage_s[0] + 1e-3)
    assert after.stage_s[1] == pytest.approx(before.stage_s[1])  # not a node's own work
    assert after.cycle_s == pytest.approx(before.cycle_s + 1e-3)
    assert ttft(slower).seconds > ttft(pipe).seconds
    # the reference's: a fixed part and one a row
    engine = pipe.stages[0].profile.engine_decode_s
    assert engine[0] == pytest.approx(XEON_CORE.engine_fixed_s + XEON_CORE.engine_row_s)
    assert engine[3] == pytest.approx(XEON_CORE.engine_fixed_s + 8 * XEON_CORE.engine_row_s)


def test_a_node_s_frames_count_on_every_stage_but_the_coordinator_s() -> None:
    pipe = smol_pipe()
    base = pipe.stages[0].profile
    assert base.frame_decode_s == () and base.frame_s(4) == 0.0  # a reference's: in its call
    framed = dataclasses.replace(base, frame_decode_s=(1e-4, 2e-4, 4e-4, 8e-4))
    assert framed.frame_s(3) == pytest.approx(3e-4)
    three = Pipeline(SMOL, tuple(Stage(n, framed, a, b) for n, a, b in
                                 (("a", 0, 10), ("b", 10, 20), ("c", 20, 30))), (LOOP, LOOP), LOOP)
    plain = dataclasses.replace(three, stages=tuple(dataclasses.replace(s, profile=base)
                                                    for s in three.stages))
    before, after = step_times(plain, 4), step_times(three, 4)
    # the first stage's frames are the coordinator's (in its engine figure), the others' added
    assert after.stage_s[0] == pytest.approx(before.stage_s[0])
    assert after.stage_s[1] == pytest.approx(before.stage_s[1] + 4e-4)
    assert after.stage_s[2] == pytest.approx(before.stage_s[2] + 4e-4)
    assert after.cycle_s == pytest.approx(before.cycle_s + 8e-4)
    assert ttft(three).seconds > ttft(plain).seconds
