"""An FP32 copy of a 16-bit ONNX graph whose every 16-bit value is rounded through Cast
pairs: what ORT's CPU provider (no BF16 arithmetic) can run to check a BF16 export."""

from __future__ import annotations

import logging

from .kernels import value_types

log = logging.getLogger("amp_compiler")


def emulate_low(model, round_values: bool = True):
    """An FP32 copy of a BF16/FP16 ONNX model that ORT CPU can run.

    Every 16-bit value becomes FP32; with ``round_values`` each one is rounded
    through Cast(16-bit) -> Cast(fp32) where it is produced, so the numbers are
    those of 16-bit storage with FP32 arithmetic inside each op (what tensor
    cores do). Run it with graph optimisations off.
    """
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    types = value_types(model)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    low_types = (TensorProto.BFLOAT16, TensorProto.FLOAT16)
    g = m.graph
    for i, init in enumerate(g.initializer):
        if init.data_type in low_types:
            arr = numpy_helper.to_array(init).astype(np.float32)
            g.initializer[i].CopyFrom(numpy_helper.from_array(arr, init.name))
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.type.tensor_type.elem_type in low_types:
            vi.type.tensor_type.elem_type = TensorProto.FLOAT
    nodes = []
    for node in g.node:
        low_outs = [o for o in node.output if types.get(o) in low_types]
        for a in node.attribute:
            if node.op_type == "Cast" and a.name == "to" and a.i in low_types:
                a.i = TensorProto.FLOAT
            if node.op_type == "Constant" and a.name == "value" and a.t.data_type in low_types:
                a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float32)))
        if not round_values or not low_outs:
            nodes.append(node)
            continue
        renamed = {o: f"{o}__unrounded" for o in low_outs}
        node.output[:] = [renamed.get(o, o) for o in node.output]
        nodes.append(node)
        for o in low_outs:
            to = types[o]
            nodes.append(helper.make_node("Cast", [renamed[o]], [f"{o}__low"], to=to))
            nodes.append(helper.make_node("Cast", [f"{o}__low"], [o], to=TensorProto.FLOAT))
    del g.node[:]
    g.node.extend(nodes)
    del g.value_info[:]
    return m
