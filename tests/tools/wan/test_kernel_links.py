"""The experiment's kernel links (tools/wan/kernel_links.py): scenarios sweep who
shapes a link, tbf gets parameters that pace without dropping, the ratio pairs tbf and our
shaper at the same rate, and a tbf cluster runs where namespaces can be made (root,
iproute2), else its cells say why."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.tools.wan.test_analysis import row
from tests.tools.wan.test_scenario import scenario_of
from tools.wan.analysis import comparisons, tbf_over_ours
from tools.wan.kernel_links import MTU_FRAME, QUEUE_BYTES, KernelLinks, tbf_args
from tools.wan.runner import RunSettings, link_shape_of, measure_topology, run_topology
from tools.wan.scenario import Link, Workload, load_scenario


def test_a_scenario_sweeps_the_shaper_and_names_tbf_links(tmp_path):
    scenario = load_scenario(scenario_of(
        "[link]\ndelay_ms = 5\nrate_mbit = [1, 10]\nshaper = ['ours', 'tbf']", tmp_path))
    labels = [t.link.label for t in scenario.topologies]
    assert labels == ["1mbit", "1mbit-tbf", "10mbit", "10mbit-tbf"]
    tbf = Link(5.0, 1.0, 10.0, shaper="tbf")
    shape = link_shape_of(tbf)  # the kernel caps the rate: the link layer only delays
    assert (shape.delay_ms, shape.jitter_ms, shape.rate_mbit) == (5.0, 1.0, 0.0)
    assert link_shape_of(Link(5.0, 0.0, 10.0)).rate_mbit == 10.0


def test_tbf_paces_without_dropping():
    args = tbf_args(1)
    assert args[:3] == ["tbf", "rate", "1000kbit"] and tbf_args(0.05)[2] == "50kbit"
    burst, limit = int(args[args.index("burst") + 1]), int(args[args.index("limit") + 1])
    assert burst == 2 * MTU_FRAME and limit == QUEUE_BYTES > 4 * 196_608 * 5
    assert int(tbf_args(1000)[4]) == 125_000  # 1 ms at the rate
    with pytest.raises(ValueError, match="rate > 0"):
        tbf_args(0)


def test_tbf_over_ours_pairs_the_same_cell_at_the_same_rate():
    rows = [row(10, "plain", 20.0, link="10mbit"), row(10, "plain", 19.0, link="10mbit-tbf"),
            row(10, "plain", 2.0, payload="logits", link="10mbit"),
            row(10, "plain", 1.5, payload="logits", link="10mbit-tbf"),
            row(10, "plain", 1.0, payload="logits", link="relay-10mbit"),
            row(10, "plain", 3.0, payload="logits", link="1mbit-tbf")]  # no twin
    assert tbf_over_ours(rows) == {"10mbit/top1": 0.95, "10mbit/logits": 0.75}
    # a tbf cluster is a cluster of its own: its plain cell is not another cluster's base
    assert comparisons(rows)["best_over_plain"]["10@10mbit-tbf"] == 1.0


def test_without_namespaces_a_tbf_cluster_s_cells_say_why(monkeypatch, tmp_path):
    import tools.wan.kernel_links as kernel_links

    monkeypatch.setattr(kernel_links.os, "geteuid", lambda: 1000)
    scenario = load_scenario(scenario_of("[link]\nrate_mbit = 5\nshaper = 'tbf'\n"
                                         "[model]\nexports = { 2 = 'x' }", tmp_path))
    (topology,) = scenario.topologies
    samples = run_topology(scenario, topology, tmp_path / "x", None, _Quiet())  # type: ignore[arg-type]
    assert samples == {w: [{"error": "kernel links: not root: network namespaces need "
                                     "CAP_NET_ADMIN"}] for w in scenario.workloads}


@pytest.mark.e2e
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("tc"),
                    reason="kernel links need root and iproute2")
def test_a_tbf_cluster_serves_over_shaped_veths(dp_export2, tmp_path):
    from zctl.launcher.processes import runtime_spec

    scenario = load_scenario(scenario_of(f"""
[model]
exports = {{ 2 = "{dp_export2}" }}
[link]
delay_ms = 2
rate_mbit = 0.2
shaper = "tbf"
[workload]
payload = ["top1", "logits"]
tokens = 10
""", tmp_path))
    (topology,) = scenario.topologies
    settings = RunSettings(runtime_spec("f32", None, "CPU", "f32"), tmp_path / "run", 120, 120)
    with KernelLinks(2, topology.link.rate_mbit) as net:
        samples = measure_topology(scenario, topology, dp_export2, settings, _Quiet(), net,
                                   net.shape)
        sent = net.sent_bytes()
    top1, logits = (samples[Workload("plain", None, 1, p)][0] for p in ("top1", "logits"))
    assert "error" not in top1 and "error" not in logits, samples
    # both ways through tbf; full logits (1.5 KB a token here) over 200 kbit/s: far slower
    assert sent["zcev1"] > 10_000 and sent["zcen1:eth0"] > 10_000, (sent, samples)
    assert logits["tok_s"] < top1["tok_s"] / 2, samples
    assert not [n for n in os.listdir("/var/run/netns") if n.startswith("zce")]


class _Quiet:
    def cluster(self, text: str) -> None: ...
    def sample(self, text: str) -> None: ...
    def cluster_done(self) -> None: ...
