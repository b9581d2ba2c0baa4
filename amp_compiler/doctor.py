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
from dataclasses import dataclass
from typing import Any

import torch

from .compare import FP16_MAX, DoctorRun, NodeError, run_side_by_side


@dataclass
class Diagnosis:
    runs: dict[str, DoctorRun]
    first_out_of_fp16_range: NodeError | None
    pins: dict[str, list[str]]
    pinned_runs: dict[str, DoctorRun]


def _pin_for(n: NodeError) -> str:
    """A regex for the node's module; ``^$`` is the top-level module's own ops."""
    return "^" + re.escape(n.module) + "$"


def diagnose(
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict | None = None,
    dtypes: tuple[str, ...] = ("bf16", "fp16"),
    error_threshold: float = 0.05,
    options: dict | None = None,
    max_rounds: int = 4,
) -> Diagnosis:
    """Run every dtype; pin the culprits' modules and re-run until no Inf/NaN is left
    (at most ``max_rounds`` rounds of pins)."""
    kwargs = kwargs or {}
    runs = {d: run_side_by_side(model, args, kwargs, d, options) for d in dtypes}
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
        pinned = {d: run_side_by_side(model, args, kwargs, d, merged) for d in dtypes}
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
    lines.append(
        "first output beyond FP16 range (|x| > 65504): "
        + (_fmt(d.first_out_of_fp16_range) if d.first_out_of_fp16_range else "none")
    )
    if not d.pins:
        lines.append("no pins needed: no Inf/NaN, nothing out of FP16 range, errors within tolerance")
        return "\n".join(lines)
    lines.append("proposed pins: " + ", ".join(f"{k}={v!r}" for k, v in d.pins.items()))
    for dtype, run in d.pinned_runs.items():
        before = d.runs[dtype]
        fixed = before.first_nonfinite is not None and run.first_nonfinite is None
        state = "fixed" if fixed else ("still Inf/NaN" if run.first_nonfinite else "no Inf/NaN")
        lines.append(
            f"  re-run [{dtype}] with pins: {state}; max rel error {before.max_error:.2e} -> {run.max_error:.2e}"
        )
    return "\n".join(lines)


def diagnosis_to_dict(d: Diagnosis) -> dict[str, Any]:
    from dataclasses import asdict

    def run(r: DoctorRun):
        return {
            "worst": [asdict(n) for n in r.worst()],
            "first_nonfinite": asdict(r.first_nonfinite) if r.first_nonfinite else None,
            "max_error": r.max_error,
        }

    return {
        "runs": {k: run(v) for k, v in d.runs.items()},
        "first_out_of_fp16_range": (asdict(d.first_out_of_fp16_range) if d.first_out_of_fp16_range else None),
        "pins": d.pins,
        "pinned_runs": {k: run(v) for k, v in d.pinned_runs.items()},
    }
