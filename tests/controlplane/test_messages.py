"""Control-plane message schemas: round trips, and clear errors for every kind of bad input."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, replace

import pytest

from controlplane import messages as m
from controlplane import records as r
from controlplane.planner.presets import PRESETS
from controlplane.schema import build
from zctl.engine.decode_rates import DecodeRate
from zctl.engine.requests import ChatMessage, GenerationChunk, GenerationDone, GenerationRequest
from zctl.service import messages as sm

HASH = "ab" * 32
KEY = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"  # a Z85 CURVE public key
SMOL = PRESETS["smollm2-135m"]


def sample(cls: type) -> object:
    status = r.ClusterStatus(
        coordinator_id="coord", session="s1", endpoint="tcp://127.0.0.1:5550", protocol=1,
        openvino="2026.4.1", zctl="0.1.0", export_dir="/x", model="tiny", pipeline="serving",
        epoch=3, uptime_s=1.5, plan_error="",
        nodes=[r.NodeStatus("n1", "h", "serving", 1, "tcp://h:1", 0.1,
                            [r.DeviceInfo("CPU", "cpu", 1 << 30)], 5, 10, "2026.4.1", "0.1.0", 1,
                            profile=r.ProfileRecord(SMOL.fingerprint(), "int4", "CPU",
                                                    "2026.4.1", [1e-4] * 4, [1e-3] * 4, 2e4,
                                                    1e-4, 2 << 20, 8 << 30, graph=2,
                                                    engine_decode_s=[1e-4] * 4),
                            profile_state="measured")],
        stages=[r.StageStatus(0, 0, 2, HASH, 100, "coord", "serving")],
        refused=[r.RefusalInfo("bad", "h2", "why", 2.0)], counters={"malformed": 1},
        shape=SMOL, links=[r.LinkStatus("coord", "n1", 4e-4, 1e9, 9e8, [2316], 1.0),
                           r.LinkStatus("n1", "coord", error="node n1 did not report")],
        prediction=r.PredictionStatus(70.5, [r.StreamsPrediction(1, 70.5, 1, 1),
                                             r.StreamsPrediction(2, 130.0, 2, 1)],
                                      ["coord", "n1"], [7.1, 6.0], [0.3, 0.2], 2))
    profile = r.ProfileRecord(SMOL.fingerprint(), "int4", "CPU", "2026.4.1",
                              [1e-4, 2e-4, 3e-4, 4e-4], [1e-3] * 4, 2e4, 1e-4, 2 << 20, 8 << 30,
                              graph=2, engine_decode_s=[1e-4, 1.2e-4, 1.5e-4, 2e-4])
    samples: dict[type, object] = {
        m.Enrol: m.Enrol("node-1", "host", "tcp://10.0.0.2:6000",
                         [r.DeviceInfo("CPU", "Intel", 16 << 30), r.DeviceInfo("GPU.0")],
                         16 << 30, 8 << 30, "2026.4.1", "0.1.0", [HASH], 12.5, 42, KEY),
        m.Welcome: m.Welcome("node-1", "coord", "s1", 1.0, 3),
        m.Refuse: m.Refuse("openvino-version", "because", "node-1"),
        m.Heartbeat: m.Heartbeat("serving", 17),
        m.Leave: m.Leave("bye"),
        m.ShardOffer: m.ShardOffer(HASH, 1, [r.FileSpec("stage1.bin", 10, HASH)], 4),
        m.ShardRequest: m.ShardRequest(HASH, "stage1.bin", 2, 8, 2),
        m.ShardChunk: m.ShardChunk(HASH, "stage1.bin", 2, 8, 2, HASH),
        m.ShardDone: m.ShardDone(HASH, True, cached=True),
        m.AssignStage: m.AssignStage(4, r.StageInfo(1, 2, 4, "s.xml", "s.bin", False, True), 2,
                                     "tiny", HASH, "tcp://a:1", "tcp://b:2",
                                     r.RuntimeSpec("GPU", None, 2), KEY, [KEY]),
        m.Release: m.Release("spare"),
        m.StageReady: m.StageReady(4, 1, False, "compile failed"),
        m.Error: m.Error("malformed", "bad", "enrol"),
        m.StatusRequest: m.StatusRequest(),
        m.ProfileRequest: m.ProfileRequest(PRESETS["gpt-oss-20b"], "int8", "CPU", 20.0,
                                           "u8-channel", exact_experts=True),
        m.ProfileReport: m.ProfileReport("measured", profile),
        m.LinkProbe: m.LinkProbe(7, "n2", "tcp://10.0.0.3:7000", [2316, 18468], 3, 2.0),
        m.LinkReport: m.LinkReport(7, "n2", True, 4e-4, 1.1e8, 1.2e8),
        m.StatusReply: m.StatusReply(status),
        GenerationRequest: GenerationRequest("r1", "hello", 16, True, False),
        GenerationChunk: GenerationChunk("r1", [5, 6], "hi", 2, 12.5, 30.0,
                                           {"stage0.compute": {"p50": 1.5, "p95": 2.0}},
                                           note="paused: stage 1 is down"),
        GenerationDone: GenerationDone("r1", [5, 6, 2], "hi", 7, 12.5, 30.0, {}, "eos", ""),
        sm.GenerateCancel: sm.GenerateCancel("r1"),
        sm.ServiceStatsRequest: sm.ServiceStatsRequest(),
        sm.ServiceStats: sm.ServiceStats(
            1, 2, {"requests": 3, "spec_drafted": 8}, [sm.StageStats(
                0, "coordinator", True, 12, sm.HistogramSnapshot([0.5, 1.0], [1, 0, 2], 7.5))],
            [sm.HopStats("0-1", 4096, sm.HistogramSnapshot([1.0], [3, 0], 0.9))],
            {"coordinator": True, "n1": False}, "stage 1 is down", "tiny", 2048, 2,
            replace(status, prediction=r.PredictionStatus(
                error="node n1 has no profile: measuring")),
            [DecodeRate(1, 40, 1.25), DecodeRate(3, 200, 2.0)]),
        sm.TokenizeRequest: sm.TokenizeRequest(GenerationRequest(
            "t1", messages=[ChatMessage("user", "hi")])),
        sm.DetokenizeRequest: sm.DetokenizeRequest("t2", [1, 2, 3]),
        sm.TokensReply: sm.TokensReply("t1", [1, 2], ["<s>", "hi"], "", ""),
    }
    return samples[cls]


@pytest.mark.parametrize("cls", list(m.REGISTRY.values()), ids=list(m.REGISTRY))
def test_every_message_round_trips(cls: type) -> None:
    msg = sample(cls)
    tag, _, has_payload = m.registration(cls)
    payload = b"xy" if has_payload else None
    frames = m.to_frames(msg, payload)
    decoded, got_payload = m.from_frames(frames)
    assert decoded == msg and got_payload == payload
    envelope = json.loads(frames[0])
    assert envelope["protocol"] == m.PROTOCOL_VERSION and envelope["type"] == tag
    # the shallow encoder writes exactly what dataclasses.asdict would (nested ones too)
    assert envelope["body"] == json.loads(json.dumps(asdict(msg)))


def test_the_messages_carry_the_runners_runtime_spec_which_needs_no_openvino() -> None:
    import ast
    from pathlib import Path

    from dataplane.runtime import config

    assert r.RuntimeSpec is config.RuntimeSpec  # one definition, not a mirror to keep in step
    tree = ast.parse(Path(config.__file__).read_text(encoding="utf-8"))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    heavy = {name for name in imported if name.split(".")[0] in ("openvino", "dataplane", "zctl")}
    assert not heavy, f"dataplane.runtime.config imports {sorted(heavy)}: the schemas would too"


def envelope(body: object, type_: str = "enrol", protocol: object = m.PROTOCOL_VERSION) -> bytes:
    return json.dumps({"protocol": protocol, "type": type_, "body": body}).encode()


def enrol_body(**change: object) -> dict:
    body = json.loads(m.encode_message(sample(m.Enrol)))["body"]
    body.update(change)
    return body


def assign_body(**change: object) -> dict:
    body = json.loads(m.encode_message(sample(m.AssignStage)))["body"]
    body.update(change)
    return body


def stats_body() -> dict:
    return json.loads(m.encode_message(sample(sm.ServiceStats)))["body"]


@pytest.mark.parametrize("data, text", [
    (b"\xff\xfe", "not a JSON message"),
    (b"hello", "not a JSON message"),
    (b"[1, 2]", "must be a JSON object, got list"),
    (b'{"protocol": %d, "body": {}}' % m.PROTOCOL_VERSION, "no string 'type'"),
    (b'{"type": "heartbeat", "body": {}}', "no 'protocol' version"),
    (b'{"protocol": %d, "type": "heartbeat", "body": {}, "x": 1}' % m.PROTOCOL_VERSION,
     "unknown field(s) 'x'"),
    (envelope({}, "heartbeat") .replace(b'"body": {}', b'"body": []'), "must be an object"),
    (envelope(enrol_body(ram_total="lots")), "enrol.ram_total must be an integer, got string"),
    (envelope(enrol_body(ram_total=True)), "enrol.ram_total must be an integer, got boolean"),
    (envelope(enrol_body(tok_s="fast")), "enrol.tok_s must be a number"),
    (envelope(enrol_body(devices=[{"name": "CPU", "memory_bytes": "1"}])),
     "enrol.devices[0].memory_bytes must be an integer"),
    (envelope(enrol_body(devices={"name": "CPU"})), "enrol.devices must be a list"),
    (envelope(enrol_body(host=None)), "enrol.host must be a string, got null"),
    (envelope(enrol_body(colour="blue")), "enrol has unknown field(s) 'colour'"),
    (envelope({k: v for k, v in enrol_body().items() if k != "node_id"}),
     "missing required field 'node_id'"),
    (envelope(enrol_body(node_id="../../etc")), "enrol.node_id"),
    (envelope(enrol_body(data_addr="ipc:///x")), "must be a tcp:// endpoint"),
    (envelope(enrol_body(cached_shards=["zz"])), "64 lowercase hex digits"),
    (envelope(enrol_body(data_key="short")), "enrol.data_key must be a 40-character Z85"),
    (envelope(enrol_body(data_key="~" * 40)), "enrol.data_key must be a 40-character Z85"),
    (envelope(assign_body(admit_keys=[]), "assign_stage"), "peer_key and admit_keys come together"),
    (envelope(assign_body(admit_keys=["x" * 39]), "assign_stage"),
     "admit_keys entry must be a 40-character Z85"),
    (envelope({"heartbeat_interval": 0, "node_id": "a", "coordinator_id": "b", "session": "s",
               "liveness": 3}, "welcome"), "heartbeat_interval must be > 0"),
    (envelope({"shard_hash": HASH, "file": "f", "chunk": -1, "offset": 0, "size": 1},
              "shard_request"), "shard_request.chunk must be >= 0"),
    (b"[" * 100000 + b"]" * 100000, "nested too deeply"),
    # Python refuses to read an integer of more than 4300 digits with a bare ValueError,
    # which escaped and ended the coordinator (found by tools.fuzz_live)
    (b"1" * 5000, "not a JSON message"),
    (b'{"protocol":%d,"type":"heartbeat","body":{"kv_slots":' % m.PROTOCOL_VERSION + b"9" * 5000 + b"}}",
     "not a JSON message"),
    (envelope({"kv_slots": -5}, "heartbeat"), "heartbeat.kv_slots must be >= -1"),
    (envelope({"reference_s": -0.004}, "heartbeat"), "heartbeat.reference_s must be >= 0"),
    (envelope({"state": "measured"}, "profile_report"),
     "a profile comes with state kept or measured"),
    (envelope({"state": "bored"}, "profile_report"), "is not one of kept, measured"),
    (envelope({"state": "kept", "profile": {"shape": "x"}}, "profile_report"),
     "profile_report.profile is missing required field 'weights'"),
    (envelope({"probe_id": 1, "peer": "n2", "peer_addr": "ipc:///x", "sizes": [8]},
              "link_probe"), "link_probe.peer_addr 'ipc:///x' must be a tcp:// endpoint"),
    (envelope({"probe_id": 1, "peer": "n2", "peer_addr": "tcp://h:1", "sizes": [8],
               "rounds": 0}, "link_probe"), "1-100 rounds"),
    (envelope({"probe_id": 1, "peer": "n2", "ok": True, "forward_bps": 0.0}, "link_report"),
     "positive bandwidths"),
    (envelope({"shape": {"name": "x"}, "weights": "int4", "device": "CPU"}, "profile_request"),
     "profile_request.shape is missing required field"),
    (envelope({"shape": dataclasses.asdict(SMOL), "weights": "int8", "device": "CPU",
               "int8_form": "i4-groups"}, "profile_request"),
     "profile_request.int8_form 'i4-groups' is not one of"),
    (envelope({"shape": dataclasses.asdict(SMOL), "weights": "int4", "device": "CPU",
               "exact_experts": True}, "profile_request"),
     "profile_request.exact_experts: smollm2-135m has no experts"),
    (envelope({**stats_body(), "hops": [{"name": "0-1", "bytes": 1, "network_ms": {
        "bounds": [1.0, 2.0], "counts": [1, 2]}}]}, "service_stats"),
     "service_stats.hops[0].network_ms has 2 counts for 2 bounds"),
    (envelope({**stats_body(), "stages": [{"index": 0, "node_id": "c", "up": True,
                                           "kv_slots": 0, "compute_ms": {
        "bounds": [2.0, 1.0], "counts": [1, 2, 0]}}]}, "service_stats"),
     "service_stats.stages[0].compute_ms has bounds that are not strictly ascending"),
    (envelope({**stats_body(), "decode_rates": [{"streams": 0, "tokens": 5, "seconds": 1.0}]},
              "service_stats"), "service_stats.decode_rates[0]: streams must be >= 1"),
    (envelope({**stats_body(), "decode_rates": [{"streams": 2, "tokens": 5}]},
              "service_stats"), "seconds"),
])
def test_bad_messages_raise_clear_errors(data: bytes, text: str) -> None:
    with pytest.raises(m.MessageError) as info:
        m.decode_message(data)
    assert text in str(info.value)


def test_unknown_type_is_its_own_error() -> None:
    with pytest.raises(m.UnknownMessage, match="unknown message type 'teleport'"):
        m.decode_message(envelope({}, "teleport"))


def test_protocol_mismatch_carries_both_versions_and_best_effort_fields() -> None:
    other = m.PROTOCOL_VERSION + 1
    refuse = envelope({"code": "x", "reason": "too old", "node_id": "n", "new": 1}, "refuse",
                      other)
    with pytest.raises(m.ProtocolMismatch) as info:
        m.decode_message(refuse)
    exc = info.value
    assert (exc.theirs, exc.ours, exc.msg_type) == (other, m.PROTOCOL_VERSION, "refuse")
    assert f"protocol {other}" in str(exc) and f"speaks {m.PROTOCOL_VERSION}" in str(exc)
    assert m.refusal_text(exc) == "too old"
    with pytest.raises(m.ProtocolMismatch) as info:
        m.decode_message(envelope(enrol_body(), "enrol", 0))
    assert m.peer_node_id(info.value) == "node-1" and m.refusal_text(info.value) is None
    with pytest.raises(m.ProtocolMismatch) as info:
        m.decode_message(envelope({"node_id": "x/../y"}, "enrol", m.PROTOCOL_VERSION + 1))
    assert m.peer_node_id(info.value) == "?"


@pytest.mark.parametrize(("body", "text"), [
    ({"request_id": "r", "prompt": ""}, "give one of a prompt, messages or prompt token ids"),
    ({"request_id": "r", "prompt": "x", "max_tokens": -1}, "max_tokens must be in"),
    ({"request_id": "", "prompt": "x"}, "request_id must be"),
    ({"request_id": "r", "prompt": 5}, "must be a string"),
])
def test_bad_generate_requests_are_refused(body: dict, text: str) -> None:
    with pytest.raises(m.MessageError, match=text):
        m.decode_message(envelope(body, "generate_request"))


def test_frames_must_fit_the_type() -> None:
    hb = m.encode_message(m.Heartbeat())
    chunk = sample(m.ShardChunk)
    with pytest.raises(m.MessageError, match="empty message"):
        m.from_frames([])
    with pytest.raises(m.MessageError, match="takes no payload"):
        m.from_frames([hb, b"extra"])
    with pytest.raises(m.MessageError, match="1 or 2 frames, got 3"):
        m.from_frames([hb, b"", b""])
    with pytest.raises(m.MessageError, match="needs a payload frame"):
        m.from_frames([m.encode_message(chunk)])
    with pytest.raises(m.MessageError, match="says 2 bytes but its payload has 3"):
        m.from_frames([m.encode_message(chunk), b"abc"])
    with pytest.raises(TypeError):
        m.to_frames(chunk)
    with pytest.raises(TypeError):
        m.to_frames(m.Heartbeat(), b"x")


def test_encode_with_another_protocol_for_refusal_tests() -> None:
    data = m.encode_message(m.Heartbeat(), protocol=m.PROTOCOL_VERSION + 1)
    with pytest.raises(m.ProtocolMismatch):
        m.decode_message(data)


def test_status_to_dict_is_json() -> None:
    status = sample(m.StatusReply).status  # type: ignore[attr-defined]
    text = json.dumps(status.to_dict())
    assert json.loads(text)["nodes"][0]["devices"][0]["memory_bytes"] == 1 << 30


def test_a_status_shows_the_cpu_quota_a_profile_ran_under_and_an_older_one_reads_as_none() -> None:
    status = sample(m.StatusReply).status  # type: ignore[attr-defined]
    node = status.nodes[0]
    held = replace(node, profile=replace(node.profile, cpu_share=0.5, quota_period_s=0.02,
                                         cpu_per_wall=1.1))
    shown = json.loads(json.dumps(replace(status, nodes=[held]).to_dict()))["nodes"][0]["profile"]
    assert (shown["cpu_share"], shown["quota_period_s"], shown["cpu_per_wall"]) == (0.5, 0.02, 1.1)
    older = asdict(node.profile)
    for name in ("cpu_share", "quota_period_s", "cpu_per_wall"):
        del older[name]
    record = build(r.ProfileRecord, older, "profile")
    assert (record.cpu_share, record.quota_period_s, record.cpu_per_wall) == (0.0, 0.0, 0.0)
