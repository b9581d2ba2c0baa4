"""FP32 and the amp plan run side by side on the same inputs, node by node.

The ground ``doctor``, ``calibrate`` and the training step's alert explanation stand on:
each graph Dynamo compiles is lowered twice, once as is (the FP32 reference) and once
through the amp pipeline; both run under an Interpreter and nodes are matched by name
(the passes add casts; a node a rewrite put in place of another, such as the fused loss
head's loss, is compared with the one it replaces).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from .backend import AmpBackend
from .capture import to_aten
from .explain import trace
from .meta import info
from .options import AmpOptions

FP16_MAX = 65504.0


@dataclass
class NodeError:
    graph: int
    name: str
    op: str
    module: str
    precision: str
    rel_error: float
    max_abs: float
    nonfinite: bool


@dataclass
class DoctorRun:
    dtype: str
    nodes: list[NodeError] = field(default_factory=list)

    def worst(self, k: int = 5) -> list[NodeError]:
        finite = [n for n in self.nodes if not n.nonfinite]
        return sorted(finite, key=lambda n: -n.rel_error)[:k]

    @property
    def first_nonfinite(self) -> NodeError | None:
        return next((n for n in self.nodes if n.nonfinite), None)

    @property
    def max_error(self) -> float:
        return max((n.rel_error for n in self.nodes), default=0.0)


class _Recorder(torch.fx.Interpreter):
    def __init__(self, gm, keep):
        super().__init__(gm)
        self.keep, self.values = keep, {}

    def run_node(self, n):
        out = super().run_node(n)
        if n.op == "call_function" and isinstance(out, torch.Tensor) and out.is_floating_point() and self.keep(n):
            self.values[n.name] = out.detach()
        return out


def _compare(amp_gm, ref_vals, amp_vals, index) -> list[NodeError]:
    rows = []
    for node in amp_gm.graph.nodes:
        i = info(node)
        ref_name = (i.replaces if i is not None else "") or node.name
        if node.name not in amp_vals or ref_name not in ref_vals or i is None or i.inserted:
            continue
        a, r = amp_vals[node.name].double(), ref_vals[ref_name].double()
        if a.shape != r.shape:
            continue
        nonfinite = bool(not torch.isfinite(a).all() and torch.isfinite(r).all())
        denom = r.norm().item()
        err = float("inf") if nonfinite else ((a - r).norm().item() / denom if denom > 0 else 0.0)
        rows.append(
            NodeError(
                index,
                ref_name,
                i.op,
                i.module,
                i.precision.value,
                err,
                r.abs().max().item() if r.numel() else 0.0,
                nonfinite,
            )
        )
    return rows


def side_by_side(
    model, args, kwargs, dtype: str, options: AmpOptions | dict | None, *, on_graph=None, on_run=None
) -> tuple[DoctorRun, AmpBackend]:
    """Run every graph FP32 and through the plan on the same inputs, node by node.

    ``on_graph(index, amp_gm)`` sees each rewritten graph once; ``on_run(index, amp_gm,
    fp32_values, amp_values)`` each execution (values by node name).
    """
    result = DoctorRun(dtype)
    amp = AmpBackend(options, dtype=dtype, inner="eager")

    def backend(gm, example_inputs):
        ref_gm = to_aten(gm, example_inputs)[0]
        amp_gm = amp.rewrite(gm, example_inputs).graph
        index = amp.compiled - 1
        if on_graph is not None:
            on_graph(index, amp_gm)

        def run(*real):
            ref = _Recorder(ref_gm, lambda n: True)
            ref.run(*real)
            rec = _Recorder(amp_gm, lambda n: not info(n).inserted)
            out = rec.run(*real)
            result.nodes.extend(_compare(amp_gm, ref.values, rec.values, index))
            if on_run is not None:
                on_run(index, amp_gm, ref.values, rec.values)
            return out

        return run

    trace(model, *args, backend=backend, **kwargs)
    return result, amp


def run_side_by_side(model, args, kwargs, dtype: str, options: AmpOptions | dict | None) -> DoctorRun:
    """``side_by_side``'s per-node errors alone."""
    return side_by_side(model, args, kwargs, dtype, options)[0]


def pin_of(n: NodeError) -> tuple[str, str]:
    """The pin that keeps ``n`` in FP32: its module (``fp32_modules``), else its op."""
    if n.module:
        return "fp32_modules", "^" + re.escape(n.module) + "$"
    return "fp32_ops", n.op.rsplit(".", 1)[0] if n.op.count(".") >= 2 else n.op
