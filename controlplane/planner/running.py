"""The running placement's predicted speed: the planner's model of time (timing.py) applied
to what a cluster runs now, whatever chose its placement.

From a ``ClusterStatus`` snapshot: the stages in order, each on its node with its layers;
consecutive stages on one node are one stage of the model (a node that took a lost
neighbour's stages runs them as a chain, an inference call each); each node's profile as
it reported it, measured for the served shape; the links between neighbours and the reply
link, as the coordinator probed them. The prediction is one stream's tok/s, 1 to
``MOST_STREAMS`` streams' aggregate tok/s in the row groups the engine runs them in (its
setting when known, else the best for each count, as ``zctl plan`` predicts), and each
node's step and each hop's time. When something it needs is missing (the shape, a
serving pipeline, a profile, a probed link) there is no prediction, and ``error`` says
why. Pure: no sockets, no clock.
"""

from __future__ import annotations

from dataclasses import replace

from controlplane.planner.cluster_fleet import measured_links, usable_profile
from controlplane.planner.profile import LinkProfile, ProfileError
from controlplane.planner.timing import (
    Pipeline,
    Stage,
    grouped,
    step_times,
    stream_s,
    throughput,
)
from controlplane.records import ClusterStatus, LinkStatus, PredictionStatus, StreamsPrediction

MOST_STREAMS = 8  # streams are predicted up to this many (profiles are measured to 8 rows)
SERVING = "serving"


class NoPrediction(ValueError):
    """What the running placement's prediction lacks."""


def node_runs(status: ClusterStatus) -> list[tuple[str, int, int, int]]:
    """(node, first layer, end layer, stages) of each run of consecutive stages on one node,
    in stage order; NoPrediction when a stage has no node or a node's stages are apart."""
    runs: list[tuple[str, int, int, int]] = []
    for stage in sorted(status.stages, key=lambda s: s.index):
        if not stage.node_id:
            raise NoPrediction(f"stage {stage.index} has no node")
        if runs and runs[-1][0] == stage.node_id and runs[-1][2] == stage.layer_start:
            node, start, _, count = runs[-1]
            runs[-1] = (node, start, stage.layer_end, count + 1)
            continue
        if any(run[0] == stage.node_id for run in runs):
            raise NoPrediction(f"node {stage.node_id} runs stages that are not consecutive: the "
                               "model of time takes a node's stages as one")
        runs.append((stage.node_id, stage.layer_start, stage.layer_end, 1))
    if not runs:
        raise NoPrediction("the cluster has no stages")
    return runs


def pipeline_link(links: list[LinkStatus], a: str, b: str) -> LinkProfile:
    """The link from ``a`` to ``b`` as probed (either way); NoPrediction naming what its
    probe says when it has no figures."""
    measured = measured_links(links)
    if (a, b) in measured:
        return measured[(a, b)]
    if (b, a) in measured:
        return measured[(b, a)].reversed()
    said = next((link.error for link in links if {link.a, link.b} == {a, b} and link.error), "")
    raise NoPrediction(f"the link {a} -> {b} is not measured yet" + (f" ({said})" if said else ""))


def running_pipeline(status: ClusterStatus) -> Pipeline:
    """The pipeline ``status`` runs, as the model of time takes it (module docstring)."""
    if status.shape is None:
        raise NoPrediction("the served model's shape is unknown")
    if status.pipeline != SERVING:
        raise NoPrediction(f"the pipeline is {status.pipeline}, not serving")
    runs = node_runs(status)
    nodes = {n.node_id: n for n in status.nodes}
    profiled = [nodes[n].profile for n, *_ in runs if n in nodes]
    weights = next((p.weights for p in profiled if p is not None), "")  # the served format
    stages = []
    for node_id, start, end, count in runs:
        node = nodes.get(node_id)
        if node is None:
            raise NoPrediction(f"node {node_id} runs a stage but is not a member")
        profile, why = usable_profile(node, status.shape, weights)
        if profile is None:
            raise NoPrediction(f"node {node_id} has no profile: {why}")
        stages.append(Stage(node_id, replace(profile, call_s=profile.call_s * count), start, end))
    order = [s.node for s in stages]
    hops = tuple(pipeline_link(status.links, a, b) for a, b in zip(order, order[1:], strict=False))
    reply = pipeline_link(status.links, order[-1], order[0]) if len(order) > 1 else None
    return Pipeline(status.shape, tuple(stages), hops, reply)


def running_prediction(status: ClusterStatus, row_groups: int | None = None) -> PredictionStatus:
    """The prediction for what ``status`` runs (module docstring); ``row_groups``: the
    engine's setting (0: none, every stream steps on its own; None: not known)."""
    if row_groups is not None and row_groups < 0:
        raise ValueError(f"row groups must be >= 0 or None, got {row_groups}")
    try:
        pipe = running_pipeline(status)
    except (NoPrediction, ProfileError) as exc:
        return PredictionStatus(error=str(exc))
    one = step_times(pipe, 1)
    streams = []
    for count in range(1, MOST_STREAMS + 1):
        got = (throughput(pipe, count) if row_groups is None
               else grouped(pipe, count, row_groups or count))
        streams.append(StreamsPrediction(count, got.tok_s, got.groups, got.rows))
    return PredictionStatus(
        tok_s=1.0 / stream_s(one), streams=streams, nodes=[s.node for s in pipe.stages],
        stage_ms=[s * 1e3 for s in one.stage_s], hop_ms=[h * 1e3 for h in (*one.hop_s, one.reply_s)]
        if len(pipe.stages) > 1 else [], row_groups=-1 if row_groups is None else row_groups)


def streams_prediction(prediction: PredictionStatus, streams: int) -> StreamsPrediction:
    """What ``prediction`` says of ``streams`` streams; NoPrediction with the reason when it
    says nothing (``prediction.error``, or more streams than are predicted)."""
    if prediction.error:
        raise NoPrediction(prediction.error)
    if streams < 1:
        raise ValueError(f"streams must be >= 1, got {streams}")
    for entry in prediction.streams:
        if entry.streams == streams:
            return entry
    raise NoPrediction(f"{streams} streams are not predicted (1 to {len(prediction.streams)} are)")


def relative_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured: positive when the prediction is too fast."""
    if not measured > 0:
        raise ValueError(f"a measured speed must be positive, got {measured!r}")
    return (predicted - measured) / measured
