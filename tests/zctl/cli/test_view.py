"""The cluster status table: stages with their layers, versions, liveness (pure rendering);
a shard's transfer progress, shown only while it arrives."""

from __future__ import annotations

import io
from dataclasses import replace

from rich.console import Console

from controlplane.placement import layer_range
from controlplane.records import ClusterStatus, DeviceInfo, NodeStatus, StageStatus
from zctl.cli.view import TransferProgress, short_version, status_table

OV = "2026.4.1-22982-e213a147257-releases/2026/4"


def node(node_id: str, stage: int | None, host: str, **kw) -> NodeStatus:
    fields = dict(node_id=node_id, host=host, state="serving", stage=stage,
                  data_addr=f"tcp://{host}:5000", last_seen_s=0.4,
                  devices=[DeviceInfo("CPU", "x86", 8 << 30)], ram_free=6 << 30,
                  ram_total=8 << 30, openvino=OV, zctl="0.1.0", cached_shards=1,
                  local=node_id == "coord")
    fields.update(kw)
    return NodeStatus(**fields)


def cluster(nodes: list[NodeStatus]) -> ClusterStatus:
    stages = [StageStatus(0, 0, 12, "h0", 1, "coord", "serving"),
              StageStatus(1, 12, 23, "h1", 1, "n1", "serving"),
              StageStatus(2, 23, 30, "h2", 1, "n2", "serving")]
    return ClusterStatus("coord", "s", "tcp://127.0.0.1:5550", 1, OV, "0.1.0", "/x", "m",
                         "serving", 1, 1.0, "", nodes, stages, [], {})


def render(status: ClusterStatus, width: int = 140) -> str:
    buf = io.StringIO()
    Console(file=buf, width=width).print(status_table(status))
    return buf.getvalue()


def test_rows_in_stage_order_with_layers_and_versions_in_the_caption() -> None:
    status = cluster([node("coord", 0, "127.0.0.1"), node("n2", 2, "127.0.0.3"),
                      node("n1", 1, "127.0.0.2"), node("spare", None, "127.0.0.4",
                                                       state="idle")])
    text = render(status)
    lines = [line for line in text.splitlines() if "127.0.0." in line and "5550" not in line]
    assert [line.split()[0] for line in lines] == ["coord*", "n1", "n2", "spare"]
    assert "0-11" in lines[0] and "12-22" in lines[1] and "23-29" in lines[2]
    assert "OpenVINO 2026.4.1, zctl 0.1.0 on every node" in " ".join(text.split())
    assert "transfer" not in text and "note" not in text  # nothing arriving, no problems
    assert "OpenVINO / zctl" not in text
    narrow = render(status, width=80)  # ids, hosts and layers stay whole on 80 columns
    assert all(s in narrow for s in ("coord*", "127.0.0.3", "23-29"))


def test_differing_versions_transfers_and_problems_get_columns() -> None:
    status = cluster([node("coord", 0, "127.0.0.1"),
                      node("n1", 1, "127.0.0.2", zctl="0.2.0", state="transferring",
                           transfer_done=25, transfer_total=100),
                      node("n2", 2, "127.0.0.3", state="failed", error="compile failed: x")])
    text = render(status)
    assert "OpenVINO / zctl" in text and "2026.4.1 / 0.2.0" in text
    assert "25%" in text and "compile failed: x" in text
    assert "versions differ" in " ".join(text.split())


def test_how_the_stages_were_placed_and_who_was_left_out_is_in_the_caption() -> None:
    status = replace(cluster([node("coord", 0, "127.0.0.1"), node("n1", 1, "127.0.0.2"),
                              node("n2", 2, "127.0.0.3"),
                              node("slow", None, "127.0.0.4", state="idle")]),
                     placement="by the planner: predicted 41.20 tok/s (latency)",
                     left_out={"slow": "slows the pipeline: 30.10 tok/s with it, 41.20 without"})
    text = " ".join(render(status, width=200).split())
    assert "placed by the planner: predicted 41.20 tok/s (latency)" in text
    assert "left out: slow: slows the pipeline: 30.10 tok/s with it, 41.20 without" in text
    assert "placed" not in render(cluster([node("coord", 0, "127.0.0.1")]))


def test_helpers() -> None:
    assert short_version(OV) == "2026.4.1" and short_version("2025.1") == "2025.1"
    assert layer_range(0, 12) == "0-11" and layer_range(29, 30) == "29"


def test_transfer_progress_shows_only_while_a_shard_arrives() -> None:
    out = io.StringIO()
    with TransferProgress(Console(file=out, force_terminal=False, width=100)) as progress:
        assert not progress.showing  # no refresh thread while the node just serves
        progress.update("a" * 64, 10, 100)
        assert progress.showing
        progress.update("a" * 64, 5, 100)  # the transfer restarted: a fresh bar
        assert len(progress.progress.tasks) == 1
        progress.update("a" * 64, 100, 100)
        assert not progress.showing and not progress.progress.tasks
        progress.update("b" * 64, 1, 2)  # a later transfer shows again
        assert progress.showing
    assert not progress.showing
    assert "shard aaaaaaaaaaaa" in out.getvalue()


def test_each_node_s_profile_and_the_links_show() -> None:
    from dataclasses import replace

    from controlplane.records import LinkStatus, ProfileRecord

    record = ProfileRecord("h576", "int4", "CPU", OV, [2.5e-4, 3e-4, 4e-4, 6e-4], [1e-3] * 4,
                           2e4, 1e-4, 2 << 20, 8 << 30, graph=2, engine_decode_s=[1e-4] * 4)
    status = cluster([node("coord", 0, "127.0.0.1", profile=record, profile_state="kept"),
                      node("n1", 1, "127.0.0.2", profile_state="measuring"),
                      node("n2", 2, "127.0.0.3", profile_state="failed: out of budget")])
    status = replace(status, links=[
        LinkStatus("coord", "n1", 5.4e-4, 1.2e9, 1.1e9, [2316], 1.0),
        LinkStatus("n2", "coord", error="node n2 did not report its probe of coord in time")])
    text = " ".join(render(status, width=200).split())
    assert "0.250 ms/layer" in text and "measuring" in text and "failed" in text
    assert "coord->n1 0.54 ms, 1,200/1,100 MB/s" in text
    assert "n2->coord node n2 did not report its probe" in text


def test_the_caption_says_the_predicted_speed_or_why_there_is_none() -> None:
    from dataclasses import replace

    from controlplane.records import PredictionStatus, StreamsPrediction

    status = cluster([node("coord", 0, "127.0.0.1"), node("n1", 1, "127.0.0.2"),
                      node("n2", 2, "127.0.0.3")])
    assert "predict" not in render(status)  # a coordinator that made none
    predicted = PredictionStatus(74.2, [StreamsPrediction(1, 74.2, 1, 1),
                                        StreamsPrediction(8, 251.0, 3, 3)], ["coord", "n1", "n2"],
                                 [4.0, 4.1, 5.0], [0.2, 0.2, 0.2], 3)
    text = " ".join(render(replace(status, prediction=predicted), width=300).split())
    assert "predicted 1 stream 74.2 tok/s, 8 streams 251 tok/s (3 row groups of 3)" in text
    missing = PredictionStatus(error="node n1 has no profile: measuring")
    text = " ".join(render(replace(status, prediction=missing), width=300).split())
    assert "no prediction: node n1 has no profile: measuring" in text


def test_a_node_held_to_a_cpu_quota_says_so_beside_its_profile() -> None:
    from controlplane.planner.presets import PRESETS
    from controlplane.records import ProfileRecord

    profile = ProfileRecord(PRESETS["smollm2-135m"].fingerprint(), "int4", "CPU", OV,
                            [3e-4] * 4, [1e-3] * 4, 2e4, 1e-4, 2 << 20, 8 << 30, graph=4,
                            engine_decode_s=[1e-4] * 4)
    held = replace(profile, cpu_share=0.5, quota_period_s=0.02)
    text = render(cluster([node("coord", 0, "127.0.0.1", profile=profile),
                           node("n1", 1, "127.0.0.2", profile=held),
                           node("n2", 2, "127.0.0.3")]), width=200)
    lines = {line.split()[0]: line for line in text.splitlines() if "127.0.0." in line}
    assert "0.300 ms/layer, CPU quota 0.5 cores / 20 ms" in lines["n1"]
    assert "0.300 ms/layer" in lines["coord*"] and "quota" not in lines["coord*"]
