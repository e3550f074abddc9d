"""The coordinator and node processes' typed configurations: what zctl writes, the process
entry rebuilds exactly, and a bad one is refused with a clear line."""

from __future__ import annotations

import json

import pytest

from dataplane.runtime.config import RuntimeSpec
from zctl.launcher.__main__ import main
from zctl.launcher.processes import (
    CoordinatorProcess,
    LinkShape,
    NodeProcess,
    parse_process,
    placement_of,
    process_command,
)


def test_configs_round_trip_through_the_process_command() -> None:
    coordinator = CoordinatorProcess(
        "/exports/m", bind="tcp://0.0.0.0:5550", host="10.0.0.1", expect_nodes=3,
        placement={"1": "pc2-1a2b3c4d"}, reassign_after=5.0, curve=True, row_groups=0, max_streams=16,
        runtime=RuntimeSpec(precision=None, num_threads=2, kv_cache_precision="u8"),
        link=LinkShape(25.0, 2.0, 100.0), cpus="0-1")
    node = NodeProcess("tcp://10.0.0.1:5550", host="10.0.0.2", tok_s=12.5,
                       curve_server_key="/k/coordinator.key", link=LinkShape(10.0))
    for config in (coordinator, node):
        argv = process_command(config)
        assert argv[:2] == ["-m", "zctl.launcher"]
        assert parse_process(argv[2], argv[3]) == config


@pytest.mark.parametrize("role, text, problem", [
    ("worker", "{}", "unknown process role 'worker'"),
    ("node", "not json", "bad node configuration"),
    ("node", "{}", "missing required field 'coordinator'"),
    ("node", json.dumps({"coordinator": "tcp://h:1", "heartbeat": "fast"}), "must be a number"),
    ("node", json.dumps({"coordinator": "tcp://h:1", "cpu": "0"}), "unknown field(s) 'cpu'"),
    ("coordinator", json.dumps({"export_dir": "/x", "link": {"delay_ms": [1]}}),
     "coordinator.link.delay_ms must be a number"),
])
def test_a_bad_configuration_is_refused_clearly(role, text, problem, capsys) -> None:
    with pytest.raises(ValueError, match="bad|unknown"):
        parse_process(role, text)
    assert main([role, text]) == 1
    assert problem in capsys.readouterr().err


def test_the_entry_takes_exactly_a_role_and_a_config(capsys) -> None:
    assert main([]) == 2 and main(["node", "--coordinator", "tcp://h:1"]) == 2
    assert "usage: python -m zctl.launcher coordinator|node CONFIG_JSON" in capsys.readouterr().err


def test_placement_pins() -> None:
    assert placement_of(["1=pc2", "2=pc3"]) == {"1": "pc2", "2": "pc3"}
    for bad in ("1", "x=pc2", "1="):
        with pytest.raises(ValueError, match="STAGE=NODE_ID"):
            placement_of([bad])


def test_a_local_cluster_wants_a_runtime_spec() -> None:
    from pathlib import Path

    from zctl.launcher.local import start_local_cluster
    from zctl.launcher.record import ClusterError

    with pytest.raises(ClusterError, match="RuntimeSpec"):
        start_local_cluster(Path("/x"), 2, ["--precision", "f32"])  # type: ignore[arg-type]


def test_the_control_address_nodes_reach() -> None:
    wildcard = CoordinatorProcess("/x", bind="tcp://0.0.0.0:5550")
    assert wildcard.bind_host == "0.0.0.0" and wildcard.control == "tcp://0.0.0.0:5550"
    public = CoordinatorProcess("/x", bind="tcp://0.0.0.0:5550", host="10.0.0.1")
    assert public.control == "tcp://10.0.0.1:5550"
    assert CoordinatorProcess("/x", bind="tcp://127.0.0.2:41000").control == "tcp://127.0.0.2:41000"


def test_an_ipv6_bind_address_and_host_keep_their_brackets_in_the_control_address() -> None:
    loopback = CoordinatorProcess("/x", bind="tcp://[::1]:5550")
    assert loopback.bind_host == "::1" and loopback.control == "tcp://[::1]:5550"
    public = CoordinatorProcess("/x", bind="tcp://[::]:5550", host="fd00::7")
    assert public.bind_host == "::" and public.control == "tcp://[fd00::7]:5550"
    assert CoordinatorProcess("/x", bind="tcp://*:5550", host="[fd00::7]").control == (
        "tcp://[fd00::7]:5550")


@pytest.mark.parametrize("bind", ["tcp://[::1]", "tcp://:5550", "tcp://h:port"])
def test_a_bind_address_without_host_or_port_is_a_clear_error(bind: str) -> None:
    coordinator = CoordinatorProcess("/x", bind=bind)
    with pytest.raises(ValueError, match="is not a tcp://HOST:PORT address"):
        coordinator.control  # noqa: B018 - the property is what is tested
    with pytest.raises(ValueError, match="is not a tcp://HOST:PORT address"):
        coordinator.bind_host  # noqa: B018
