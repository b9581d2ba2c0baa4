"""ONNX Runtime kernel coverage for 16-bit types, and inspection of an ONNX file against it.

The table is versioned: it records what ORT 1.32 offered when probed. The CPU
provider has BF16 kernels only for data movement, Cast and LayerNormalization
(no arithmetic at all: session creation fails with NOT_IMPLEMENTED); its FP16
graphs load because ORT inserts its own casts to FP32. The CUDA provider has
BF16 kernels for the transformer-block ops but not for the ops listed below; a
BF16 node among them makes a GPU session fail to load.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

ORT_VERSION = "1.32"

# Probed on the CPU wheel: InferenceSession(...) with one BF16 node of each op.
CPU_BF16_OPS = frozenset(
    {
        "Cast",
        "Identity",
        "Reshape",
        "Transpose",
        "Concat",
        "Gather",
        "Squeeze",
        "Unsqueeze",
        "Slice",
        "Split",
        "Flatten",
        "Pad",
        "Shape",
        "LayerNormalization",
    }
)
# Reported missing on the CUDA provider (REFERENCE.md); everything else is taken as present.
CUDA_BF16_MISSING = frozenset(
    {
        "ReduceMean",
        "ReduceMax",
        "ReduceMin",
        "ReduceSum",
        "ReduceProd",
        "ReduceL2",
        "LogSoftmax",
        "Reciprocal",
        "Pad",
        "Resize",
        "BatchNormalization",
    }
)
EPS = ("cpu", "cuda")
FLOAT_NAMES = {1: "fp32", 10: "fp16", 16: "bf16", 11: "fp64"}  # ONNX elem types


def has_kernel(op_type: str, dtype: str, ep: str) -> bool:
    """Whether ``ep`` can run ``op_type`` with ``dtype`` inputs (fp32 always can)."""
    if ep not in EPS:
        raise ValueError(f"unknown execution provider {ep!r}; use one of {EPS}")
    if dtype != "bf16":
        return True
    if ep == "cpu":
        return op_type in CPU_BF16_OPS
    return op_type not in CUDA_BF16_MISSING


@dataclass
class OnnxReport:
    path: str
    ep: str
    histogram: Counter = field(default_factory=Counter)  # (op, dtype) -> count
    casts: Counter = field(default_factory=Counter)  # "fp32->bf16" -> count
    unsupported: list[tuple[str, str, str]] = field(default_factory=list)  # (node, op, dtype)

    def to_dict(self) -> dict:
        return {
            "path": self.path,
            "ep": self.ep,
            "ort_table_version": ORT_VERSION,
            "histogram": [{"op": op, "dtype": dt, "count": n} for (op, dt), n in sorted(self.histogram.items())],
            "casts": dict(self.casts),
            "unsupported": [{"node": n, "op": op, "dtype": dt} for n, op, dt in self.unsupported],
        }

    def format(self) -> str:
        lines = [
            f"{self.path}: {sum(self.histogram.values())} nodes; ORT {ORT_VERSION} {self.ep.upper()} provider table",
            "",
            f"{'op':<28}{'dtype':<8}{'count':>6}",
        ]
        lines += [f"{op:<28}{dt:<8}{n:>6}" for (op, dt), n in sorted(self.histogram.items())]
        lines += [
            "",
            "casts: " + (", ".join(f"{k} x{v}" for k, v in sorted(self.casts.items())) or "none"),
        ]
        if self.unsupported:
            lines.append(f"{len(self.unsupported)} node(s) with no {self.ep.upper()} kernel for their dtype:")
            lines += [f"  {n} ({op}, {dt})" for n, op, dt in self.unsupported]
        else:
            lines.append(f"every node has a {self.ep.upper()} kernel for its dtype")
        return "\n".join(lines)


def value_types(model, best_effort: bool = False) -> dict[str, int]:
    """Value name -> ONNX elem type, from shape inference, initializers and Constants.

    With ``best_effort`` a failing shape inference leaves the declared types only.
    """
    import onnx

    try:
        model = onnx.shape_inference.infer_shapes(model)
    except Exception:
        if not best_effort:
            raise
    g = model.graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in list(g.input) + list(g.output) + list(g.value_info)}
    types.update({i.name: i.data_type for i in g.initializer})
    for node in g.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    types[node.output[0]] = a.t.data_type
    return types


def inspect_onnx(path: str, ep: str = "cuda") -> OnnxReport:
    """Per-op dtype histogram, casts, and nodes the provider cannot run in their dtype."""
    import onnx

    model = onnx.load(path, load_external_data=False)
    types = value_types(model, best_effort=True)
    g = model.graph
    report = OnnxReport(path, ep)
    for node in g.node:
        dts = [FLOAT_NAMES.get(types.get(x)) for x in list(node.input) + list(node.output) if x]
        floats = [d for d in dts if d]
        dtype = "bf16" if "bf16" in floats else (floats[0] if floats else "-")
        if node.op_type == "Cast":
            src = FLOAT_NAMES.get(types.get(node.input[0]), "?")
            to = next((a.i for a in node.attribute if a.name == "to"), None)
            report.casts[f"{src}->{FLOAT_NAMES.get(to, str(to))}"] += 1
        report.histogram[(node.op_type, dtype)] += 1
        if not has_kernel(node.op_type, dtype, ep):
            report.unsupported.append((node.name or node.output[0], node.op_type, dtype))
    return report


def export_fp32_pins(target: str) -> dict:
    """ATen ops the policy may leave in BF16 whose ONNX lowering cannot take BF16.

    Two sources: ONNX's own type constraints (SplitToSequence, which the exporter
    uses for ``split``, and Einsum have no bfloat16), and the ORT CUDA kernels missing above.
    A BF16 export pins them to FP32 (op -> reason).
    """
    import torch

    aten = torch.ops.aten
    pins = {
        op: "ONNX SplitToSequence takes no bfloat16: FP32 in the export" for op in (aten.split, aten.split_with_sizes)
    }
    pins[aten.einsum] = "ONNX Einsum takes no bfloat16: FP32 in the export"
    if target == "cuda":
        pins.update(_cuda_pins(aten))
    return pins


def _cuda_pins(aten) -> dict:
    from ..policy import RESIZE_OPS

    lowering = {
        # im2col / col2im (nn.Unfold / nn.Fold, ConvBERT) pad their input in the lowering
        "Pad": (
            aten.pad,
            aten.constant_pad_nd,
            aten.reflection_pad1d,
            aten.reflection_pad2d,
            aten.reflection_pad3d,
            aten.replication_pad1d,
            aten.replication_pad2d,
            aten.replication_pad3d,
            aten._pad_circular,
            aten.im2col,
            aten.col2im,
        ),
        "Resize": RESIZE_OPS,
        "ReduceMax": (aten.amax, aten.max, aten.aminmax),
        "ReduceMin": (aten.amin, aten.min),
    }
    return {
        op: f"no BF16 {onnx_op} kernel on ORT {ORT_VERSION} CUDA: FP32 in the export"
        for onnx_op, ops in lowering.items()
        for op in ops
    }
