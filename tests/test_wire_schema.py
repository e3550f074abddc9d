"""The control and service messages' wire schema is pinned to the protocol version.

A decoder refuses fields it does not know, so a side that adds even an optional field can
no longer talk to a side without it. Bumping ``PROTOCOL_VERSION`` with every schema change
turns that into the clear "speaks control protocol N" refusal (a node that cannot enrol, a
``zctl serve`` that names the mismatch) instead of "unknown field" errors mid-request."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from controlplane import messages as m
from controlplane.schema import describe
from zctl.service import messages as service_messages  # noqa: F401 - registers the service messages

# The digest of every registered message's schema, for each protocol version since it was
# pinned. A failure here means a schema changed: bump PROTOCOL_VERSION in
# controlplane/messages.py and add the new version's digest below.
PINNED = {
    2: "be925e012bbe67ff",
    3: "133cc69c0970c7d0",  # generate_request: grammar_kind, grammar
    4: "25fb90e1c2975b9b",  # tokenize_request, detokenize_request, tokens_reply;
    # generate_request: prompt_logprobs, repetition_penalty, prompt_ids, min_p,
    # stop_token_ids; generate_chunk: prompt_logprobs
    5: "31e6f2e7e2fd2644",  # tokenize_request: the generation it tokenizes as one field,
    # ``generation`` (the engine's GenerationRequest), not its fields at the top; the
    # generate_* messages are the engine's GenerationRequest, GenerationChunk and
    # GenerationDone themselves (their JSON as before, their schemas' names changed)
    6: "4fa789680443feb1",  # generate_request: temperature, top_k, top_p, min_p and
    # repetition_penalty may be null (left out: the model's default sampling);
    # generate_done: sampling (what the generation sampled with); enrol: cluster_id (an
    # embedded cluster admits only its own nodes)
    7: "b64ae561932bae79",  # profile_request, profile_report, link_probe, link_report; enrol:
    # probe_addr; status_reply: each node's profile and profile_state, the model's shape,
    # the links' figures
    8: "c1363e3a972e76f7",  # status_reply: prediction (the running placement's predicted speed), how
    # the stages were placed (placement) and the nodes the planner left out, with its
    # reasons (left_out); service_stats: prediction (the status's, for /metrics)
    9: "6dd1c584fbd88664",  # profile_report, status_reply: a profile's graph (the layer graph
    # it timed), engine_decode_s (the coordinator's own work per decode step at 1-8 rows) and
    # frame_decode_s (a node's frames' work per step)
    10: "ed4f533c4244b049",  # service_stats: cluster (the coordinator's whole status, for the
    # web page's cluster view) in place of prediction (now read from it)
    11: "f6067bb924aecef6",  # status_reply, service_stats: replan (the last re-plan's kind,
    # note and time, and how many there were)
    12: "d40fd54f9419b488",  # profile_report, status_reply: a profile's cpu_share and
    # quota_period_s (the CPU quota it ran under) and cpu_per_wall (its steps' CPU use)
    13: "32f6055bd09914f8",  # profile_request, profile_report, status_reply: int8_form (the
    # INT8 weights' form a profile times: i8 groups or u8 per channel); profile_report,
    # status_reply, heartbeat: the host's reference workload's time (reference_s, and a
    # node's speed factor in the status)
    14: "beb72b68ae1cac95",  # profile_request, status_reply: the model's shape states its
    # sliding-window layers (sliding_window, sliding_layers: how many of them slide)
    15: "cf7f7d5a7e903405",  # service_stats: decode_rates (the aggregate decode tok/s measured
    # by streams decoding together, for /metrics beside the predicted)
    16: "9331db6f35e80269",  # profile_request, profile_report, status_reply: exact_experts
    # (a profile timed a mixture of experts' weights in their exact i8 form)
}


def wire_schema() -> str:
    return "\n".join(f"{name}={describe(m.REGISTRY[name])}" for name in sorted(m.REGISTRY))


def test_the_schema_matches_the_protocol_version() -> None:
    digest = hashlib.sha256(wire_schema().encode()).hexdigest()[:16]
    assert PINNED.get(m.PROTOCOL_VERSION) == digest, (
        f"the wire schema's digest is {digest}, but protocol {m.PROTOCOL_VERSION} was pinned "
        f"to {PINNED.get(m.PROTOCOL_VERSION)}: bump PROTOCOL_VERSION and pin the new digest")


@dataclass(frozen=True)
class Inner:
    values: list[int]
    scale: float | None = None


@dataclass(frozen=True)
class Outer:
    name: str
    inner: Inner
    tags: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class OuterWithMore:
    name: str
    inner: Inner
    tags: dict[str, str] = field(default_factory=dict)
    note: str = ""


def test_the_description_names_every_field_type_and_nested_record() -> None:
    text = describe(Outer)
    assert text == ("Inner(values:list[int], scale:float|null?)\n"
                    "Outer(name:str, inner:Inner, tags:dict[str,str]?)")


def test_an_added_optional_field_changes_the_description() -> None:
    assert describe(Outer).replace("Outer(", "X(") != describe(OuterWithMore).replace(
        "OuterWithMore(", "X(")
