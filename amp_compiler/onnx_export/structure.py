"""Structure: every node of the exported graph computes in the dtype the plan gave it and
has a kernel on the target provider."""

from __future__ import annotations

import logging

from ..plan import GraphPlan
from .base import ExportError
from .kernels import FLOAT_NAMES, ORT_VERSION, has_kernel, value_types

log = logging.getLogger("amp_compiler")


# ONNX ops the policy keeps in FP32: a 16-bit one in the export breaks the plan.
FP32_ONNX_OPS = frozenset(
    {
        "Softmax",
        "LogSoftmax",
        "LayerNormalization",
        "ReduceMean",
        "ReduceSum",
        "ReduceProd",
        "ReduceL2",
        "ReduceLogSumExp",
        "BatchNormalization",
        "GroupNormalization",
        "InstanceNormalization",
        "Exp",
        "Log",
        "Pow",
        "Reciprocal",
        "CumSum",
        "SoftmaxCrossEntropyLoss",
        "NegativeLogLikelihoodLoss",
    }
)


LOW_ONNX_OPS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Attention"})


def check_structure(path: str, dtype: str, target: str, plan: GraphPlan) -> dict:
    """onnx.checker (full), every node's dtypes against the plan, and the target's kernels."""
    import onnx
    from onnx import TensorProto

    try:
        onnx.checker.check_model(path, full_check=True)
    except Exception as e:
        raise ExportError(f"onnx.checker rejected the export: {str(e).splitlines()[0]}") from e
    model = onnx.load(path, load_external_data=False)
    types = value_types(model)
    low = {"bf16": TensorProto.BFLOAT16, "fp16": TensorProto.FLOAT16}.get(dtype)
    low_mm, fp32_mm, problems = 0, 0, []
    for node in model.graph.node:
        ins = [types.get(x) for x in node.input if x]
        node_dtype = FLOAT_NAMES.get(ins[0] if ins else None, "-")
        if node.op_type in LOW_ONNX_OPS:
            if low is not None and all(t == low for t in ins):
                low_mm += 1
            else:
                fp32_mm += 1
        if low is not None and node.op_type in FP32_ONNX_OPS and any(t == low for t in ins):
            problems.append(
                f"{node.name or node.output[0]} ({node.op_type}) takes {dtype} inputs; the plan keeps it FP32"
            )
        # OpenVINO converts what it has no kernel for; its executed precision is checked instead
        if target != "openvino" and not has_kernel(node.op_type, node_dtype, target):
            problems.append(
                f"{node.name or node.output[0]} ({node.op_type}, {node_dtype}) has no "
                f"kernel on ORT {ORT_VERSION} {target.upper()}"
            )
    planned_low = plan.summary()["nodes"]["LOW"]
    if low is not None and planned_low and not low_mm:
        problems.append(f"the plan has {planned_low} LOW ops but no MatMul/Gemm/Conv takes {dtype} inputs")
    if problems:
        raise ExportError("export does not follow the plan: " + "; ".join(problems[:5]))
    return {
        "low_matmul_conv": low_mm,
        "fp32_matmul_conv": fp32_mm,
        "checker": "full_check passed",
    }
