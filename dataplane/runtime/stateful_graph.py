"""A stage graph's KV made OpenVINO state: beam_idx in front of the past, past/present
pairs turned into ReadValue/Assign with zero initial values.

The order matters: a ``Gather(past, beam_idx)`` is put in front of
every past-KV input first, then past/present pairs become ReadValue/Assign, then each
ReadValue gets a zero initialiser whose batch dimension follows the stage's main input.
The exporter applies it to every traced stage, a node's profile to the stage it builds
from a shape (dataplane.runtime.synthetic): the graph PagedAttention's pass then reads.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
from openvino import opset13 as ops


def add_beam_idx(model: ov.Model, past_names: list[str]) -> None:
    """Insert Gather(past, beam_idx, axis=0) before every consumer of each past-KV input."""
    beam_idx = ops.parameter([-1], ov.Type.i32, name="beam_idx")
    beam_idx.output(0).get_tensor().set_names({"beam_idx"})
    axis = ops.constant(np.int64(0))
    for name in past_names:
        port = model.input(name)
        consumers = list(port.get_target_inputs())
        gather = ops.gather(port, beam_idx, axis)
        for consumer in consumers:
            consumer.replace_source_output(gather.output(0))
    model.add_parameters([beam_idx])
    model.validate_nodes_and_infer_types()


def make_stateful(model: ov.Model, pairs: list[tuple[str, str]], batch_input: str) -> None:
    """Turn past/present pairs into ReadValue/Assign with zero initial values."""
    from openvino._offline_transformations import apply_make_stateful_transformation

    apply_make_stateful_transformation(model, dict(pairs))
    batch = ops.gather(
        ops.shape_of(model.input(batch_input), output_type="i64"),
        ops.constant(np.array([0], dtype=np.int64)),
        ops.constant(np.int64(0)),
    )
    for op in model.get_ops():
        if op.get_type_name() != "ReadValue":
            continue
        pshape = op.get_output_partial_shape(0)
        dims = []
        for axis_index, dim in enumerate(pshape):
            if axis_index == 0:
                dims.append(batch.output(0))
            elif axis_index == 2:
                dims.append(ops.constant(np.array([0], dtype=np.int64)).output(0))
            else:
                dims.append(ops.constant(np.array([dim.get_length()], dtype=np.int64)).output(0))
        zero = ops.constant(np.array(0, dtype=np.float32)).output(0)
        if op.get_output_element_type(0) != ov.Type.f32:
            zero = ops.convert(zero, op.get_output_element_type(0)).output(0)
        op.set_arguments([ops.broadcast(zero, ops.concat(dims, axis=0))])
    model.validate_nodes_and_infer_types()
