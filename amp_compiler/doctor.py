"""``doctor``: run FP32 and amp side by side, node by node, and find where precision hurts.

Each graph Dynamo compiles is lowered twice: once as is (the FP32 reference) and
once through the amp pipeline. Both run on the same real inputs under an
Interpreter; nodes are matched by name (the passes only add casts). Reported:
the nodes with the largest relative error ``||amp - fp32|| / ||fp32||``, the
first node whose amp output is Inf/NaN, and the first whose FP32 output leaves
FP16's range (|x| > 65504). Pins are proposed (``fp32_modules`` for the
culprit's module, ``fp32_ops`` when it has none) and the model is re-run with
them to show whether they fix it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

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


@dataclass
class Diagnosis:
    runs: dict[str, DoctorRun]
    first_out_of_fp16_range: NodeError | None
    pins: dict[str, list[str]]
    pinned_runs: dict[str, DoctorRun]


class _Recorder(torch.fx.Interpreter):
    def __init__(self, gm, keep):
        super().__init__(gm)
        self.keep, self.values = keep, {}

    def run_node(self, n):
        out = super().run_node(n)
        if n.op == "call_function" and isinstance(out, torch.Tensor) and out.is_floating_point() \
                and self.keep(n):
            self.values[n.name] = out.detach()
        return out


def _compare(amp_gm, ref_vals, amp_vals, index) -> list[NodeError]:
    rows = []
    for node in amp_gm.graph.nodes:
        i = info(node)
        if node.name not in amp_vals or node.name not in ref_vals or i is None or i.inserted:
            continue
        a, r = amp_vals[node.name].double(), ref_vals[node.name].double()
        if a.shape != r.shape:
            continue
        nonfinite = bool(not torch.isfinite(a).all() and torch.isfinite(r).all())
        denom = r.norm().item()
        err = float("inf") if nonfinite else ((a - r).norm().item() / denom if denom > 0 else 0.0)
        rows.append(NodeError(index, node.name, i.op, i.module, i.precision.value, err,
                              r.abs().max().item() if r.numel() else 0.0, nonfinite))
    return rows


def side_by_side(model, args, kwargs, dtype: str, options: AmpOptions | dict | None, *,
                 on_graph=None, on_run=None) -> tuple[DoctorRun, AmpBackend]:
    """Run every graph FP32 and through the plan on the same inputs, node by node.

    ``on_graph(index, amp_gm)`` sees each rewritten graph once; ``on_run(index, amp_gm,
    fp32_values, amp_values)`` each execution (values by node name).
    """
    result = DoctorRun(dtype)
    amp = AmpBackend(options, dtype=dtype, inner="eager")

    def backend(gm, example_inputs):
        ref_gm = to_aten(gm, example_inputs)[0]
        amp_gm = amp.rewrite(gm, example_inputs)
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


def _run(model, args, kwargs, dtype: str, options: AmpOptions | dict | None) -> DoctorRun:
    return side_by_side(model, args, kwargs, dtype, options)[0]


def _pin_for(n: NodeError) -> str:
    """A regex for the node's module; ``^$`` is the top-level module's own ops."""
    return "^" + re.escape(n.module) + "$"


def diagnose(model: torch.nn.Module, args: tuple, kwargs: dict | None = None,
             dtypes: tuple[str, ...] = ("bf16", "fp16"), error_threshold: float = 0.05,
             options: dict | None = None, max_rounds: int = 4) -> Diagnosis:
    """Run every dtype; pin the culprits' modules and re-run until no Inf/NaN is left
    (at most ``max_rounds`` rounds of pins)."""
    kwargs = kwargs or {}
    runs = {d: _run(model, args, kwargs, d, options) for d in dtypes}
    first = next(iter(runs.values()))
    out_of_range = next((n for n in first.nodes if n.max_abs > FP16_MAX), None)
    culprits = [r.first_nonfinite for r in runs.values() if r.first_nonfinite]
    if out_of_range is not None:
        culprits.append(out_of_range)
    if not culprits:
        culprits = [n for r in runs.values() for n in r.worst(2) if n.rel_error > error_threshold]
    pins: list[str] = []
    pinned: dict[str, DoctorRun] = {}
    for _ in range(max_rounds):
        new = [p for p in dict.fromkeys(_pin_for(n) for n in culprits) if p not in pins]
        if not new:
            break
        pins += new
        merged = dict(options or {})
        merged["fp32_modules"] = tuple(merged.get("fp32_modules", ())) + tuple(pins)
        pinned = {d: _run(model, args, kwargs, d, merged) for d in dtypes}
        culprits = [r.first_nonfinite for r in pinned.values() if r.first_nonfinite]
        if not culprits:
            break
    return Diagnosis(runs, out_of_range, {"fp32_modules": pins} if pins else {}, pinned)


def _fmt(n: NodeError) -> str:
    where = f" in module '{n.module}'" if n.module else ""
    err = "Inf/NaN" if n.nonfinite else f"rel err {n.rel_error:.2e}"
    return f"node '{n.name}' ({n.op}, {n.precision}){where}: {err}, FP32 max |x| {n.max_abs:.3g}"


def format_diagnosis(d: Diagnosis, top: int = 5) -> str:
    lines = []
    for dtype, run in d.runs.items():
        lines.append(f"[{dtype}] largest relative error (top {top}):")
        lines += [f"    {_fmt(n)}" for n in run.worst(top)]
        bad = run.first_nonfinite
        lines.append(f"  first Inf/NaN: {_fmt(bad) if bad else 'none'}")
    lines.append("first output beyond FP16 range (|x| > 65504): "
                 + (_fmt(d.first_out_of_fp16_range) if d.first_out_of_fp16_range else "none"))
    if not d.pins:
        lines.append("no pins needed: no Inf/NaN, nothing out of FP16 range, errors within tolerance")
        return "\n".join(lines)
    lines.append("proposed pins: " + ", ".join(f"{k}={v!r}" for k, v in d.pins.items()))
    for dtype, run in d.pinned_runs.items():
        before = d.runs[dtype]
        fixed = before.first_nonfinite is not None and run.first_nonfinite is None
        state = "fixed" if fixed else ("still Inf/NaN" if run.first_nonfinite else "no Inf/NaN")
        lines.append(f"  re-run [{dtype}] with pins: {state}; max rel error "
                     f"{before.max_error:.2e} -> {run.max_error:.2e}")
    return "\n".join(lines)


def diagnosis_to_dict(d: Diagnosis) -> dict[str, Any]:
    from dataclasses import asdict

    def run(r: DoctorRun):
        return {"worst": [asdict(n) for n in r.worst()],
                "first_nonfinite": asdict(r.first_nonfinite) if r.first_nonfinite else None,
                "max_error": r.max_error}

    return {"runs": {k: run(v) for k, v in d.runs.items()},
            "first_out_of_fp16_range": (asdict(d.first_out_of_fp16_range)
                                        if d.first_out_of_fp16_range else None),
            "pins": d.pins, "pinned_runs": {k: run(v) for k, v in d.pinned_runs.items()}}
