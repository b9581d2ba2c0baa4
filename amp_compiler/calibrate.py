"""``calibrate``: measure a model under the plan and write down the FP32 pins it needs.

    cal = amp_compiler.calibrate(model, batches, dtype="bf16", budget=1e-2)
    cal.summary(); cal.save("amp-policy.json")
    torch.compile(model, backend="amp", options={"policy_file": "amp-policy.json"})

For each batch the model runs in FP32 (the reference) and through the amp plan; the
outputs' relative error ``||amp - fp32|| / ||fp32||`` (and the loss's, with ``loss_fn``)
is the measure. While the worst output error exceeds ``budget``, or anything is Inf/NaN,
or (FP16) a 16-bit value leaves FP16's range, the node that adds the most error (its
error minus its inputs', the doctor's node-by-node machinery) is pinned: its innermost
module with ``fp32_modules``, or its op with ``fp32_ops`` when it belongs to no module.
Every pin is re-measured; afterwards each pin is dropped again if the budget holds
without it. A model already within budget gets no pins. Greedy, bounded by ``max_pins``.
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .atomic import write_text
from .backend import AmpBackend
from .compare import FP16_MAX, NodeError, pin_of, side_by_side
from .meta import info
from .plan import PrecisionPlan
from .policy_file import FORMAT, VERSION, fingerprint, with_pins
from .upstream.torch_private import pytree

__all__ = ["Calibration", "Pin", "calibrate"]
_MATMULS = (
    "aten.mm",
    "aten.addmm",
    "aten.bmm",
    "aten.matmul",
    "aten.linear",
    "aten.baddbmm",
    "aten.convolution",
    "aten.conv1d",
    "aten.conv2d",
    "aten.conv3d",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten.scaled_dot_product_attention",
)


@dataclass
class Pin:
    option: str  # "fp32_modules" or "fp32_ops"
    pattern: str
    reason: str
    error_before: float
    error_after: float


@dataclass
class Measure:
    error: float  # worst output (or loss) relative error over the batches
    nonfinite: bool
    out_of_range: bool  # FP16: a 16-bit value beyond 65504
    nodes: list[NodeError] = field(default_factory=list)
    inputs: dict[str, list[str]] = field(default_factory=dict)  # node -> its input nodes
    flops: dict[str, float] = field(default_factory=dict)  # "graph:node" -> matmul/conv FLOPs
    plan: PrecisionPlan | None = None

    def within(self, budget: float, dtype: str) -> bool:
        return not self.nonfinite and self.error <= budget and not (dtype == "fp16" and self.out_of_range)


@dataclass
class Calibration:
    dtype: str
    budget: float
    pins: list[Pin]
    error_before: float
    error_after: float
    fp32_flops_share: float
    batches: int
    fingerprints: list[str]
    base_options: dict = field(default_factory=dict)
    within_budget: bool = True

    @property
    def options(self) -> dict:
        """Options for ``torch.compile(..., options=...)`` that apply the pins."""
        return with_pins(self.base_options, ((p.option, p.pattern) for p in self.pins))

    def summary(self) -> str:
        lines = [
            f"{self.dtype}, budget {self.budget:.1e} over {self.batches} batch(es): output error "
            f"{self.error_before:.2e} -> {self.error_after:.2e}"
            + ("" if self.within_budget else " (NOT within budget: see the pins tried)")
        ]
        if not self.pins:
            lines.append("no pins needed" if self.within_budget else "no pin found that helps")
        for p in self.pins:
            lines.append(f"  {p.option} {p.pattern!r}: {p.error_before:.2e} -> {p.error_after:.2e} ({p.reason})")
        lines.append(f"FP32 share of matmul/conv FLOPs the pins cost: {self.fp32_flops_share:.1%}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        from .version import __version__

        return {
            "format": FORMAT,
            "version": VERSION,
            "dtype": self.dtype,
            "budget": self.budget,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "amp_compiler": __version__,
            "torch": torch.__version__,
            "fingerprints": self.fingerprints,
            "measured": {
                "error_before": _num(self.error_before),
                "error_after": _num(self.error_after),
                "batches": self.batches,
                "fp32_flops_share": self.fp32_flops_share,
                "within_budget": self.within_budget,
            },
            "pins": [{k: _num(v) for k, v in asdict(p).items()} for p in self.pins],
            "overrides": {
                k: list(v) if isinstance(v, tuple) else v for k, v in self.base_options.items() if _jsonable(v)
            },
        }

    def save(self, path: str) -> None:
        """Write the policy file atomically (a temp file renamed into place)."""
        write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")


def _num(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(list(v) if isinstance(v, tuple) else v)
        return True
    except TypeError:
        return False


def _split(batch: Any) -> tuple[tuple, dict]:
    if isinstance(batch, dict):
        return (), batch
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    return (batch,), {}


def _rel(a: torch.Tensor, r: torch.Tensor) -> tuple[float, bool]:
    a, r = a.double(), r.double()
    if not torch.isfinite(a).all() and torch.isfinite(r).all():
        return math.inf, True
    denom = r.norm().item()
    return ((a - r).norm().item() / denom if denom > 0 else (a - r).norm().item()), False


def _measure(model, batches, dtype, options, loss_fn) -> Measure:
    """Output errors on every batch; node errors (and the plan) on the first."""
    m = Measure(0.0, False, False)
    _profile(model, *_split(batches[0]), dtype, options, m)
    torch.compiler.reset()
    compiled = torch.compile(model, backend=AmpBackend(options, dtype=dtype, inner="eager"))
    for batch in batches:  # one compile for all batches (Dynamo recompiles on a new shape)
        args, kwargs = _split(batch)
        with torch.no_grad():
            ref = model(*args, **kwargs)
            out = compiled(*args, **kwargs)
        pairs = [
            (a, r)
            for a, r in zip(pytree.tree_leaves(out), pytree.tree_leaves(ref))
            if isinstance(r, torch.Tensor) and r.is_floating_point()
        ]
        if loss_fn is not None:
            pairs.append((loss_fn(out).detach().reshape(1), loss_fn(ref).detach().reshape(1)))
        for a, r in pairs:
            err, bad = _rel(a, r)
            m.error, m.nonfinite = max(m.error, err), m.nonfinite or bad
    torch.compiler.reset()
    return m


def _profile(model, args, kwargs, dtype, options, m: Measure) -> None:
    def graph(index, amp_gm):
        for node in amp_gm.graph.nodes:  # inputs by their original names (casts looked through)
            m.inputs[f"{index}:{node.name}"] = [f"{index}:{_through_casts(a).name}" for a in node.all_input_nodes]
            m.flops[f"{index}:{node.name}"] = _flops(node)

    def ran(index, amp_gm, ref_values, amp_values):
        for node in amp_gm.graph.nodes:
            i = info(node)
            if (
                dtype == "fp16"
                and i is not None
                and i.planned == torch.float16
                and node.name in amp_values
                and node.name in ref_values
                and ref_values[node.name].abs().max() > FP16_MAX
            ):
                m.out_of_range = True

    torch.compiler.reset()
    run, amp = side_by_side(model, args, kwargs, dtype, options, on_graph=graph, on_run=ran)
    m.nodes.extend(run.nodes)
    m.plan = amp.plan()


def _through_casts(node: torch.fx.Node) -> torch.fx.Node:
    while info(node) is not None and info(node).inserted and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def _culprit(m: Measure, tried: set[str], dtype: str) -> NodeError | None:
    """The first Inf/NaN node, else the node adding the most error, among unpinned ones."""
    errors = {f"{n.graph}:{n.name}": n for n in m.nodes}
    open_ = [n for n in m.nodes if n.precision != "FP32" and pin_of(n)[1] not in tried]
    bad = [n for n in open_ if n.nonfinite]
    if bad:
        return bad[0]
    if dtype == "fp16":
        over = [n for n in open_ if n.max_abs > FP16_MAX]
        if over:
            return over[0]

    def added(n: NodeError) -> float:
        upstream = [errors[k].rel_error for k in m.inputs.get(f"{n.graph}:{n.name}", []) if k in errors]
        return n.rel_error - max(upstream, default=0.0)

    ranked = sorted(open_, key=added, reverse=True)
    return ranked[0] if ranked and added(ranked[0]) > 0 else None


def _flops(node: torch.fx.Node) -> float:
    """Multiply-add FLOPs of a matmul/conv node, from its shapes (0 for anything else)."""
    op = str(getattr(node.target, "overloadpacket", ""))
    out = node.meta.get("val")
    if op not in _MATMULS or not isinstance(out, torch.Tensor):
        return 0.0
    args = [a for a in node.args if isinstance(a, torch.fx.Node)]
    vals = [a.meta.get("val") for a in args]
    try:
        if op == "aten.convolution" or op.startswith("aten.conv"):
            per = math.prod(vals[1].shape[1:])  # weight: (Cout, Cin/groups, *kernel)
        elif op in ("aten.addmm", "aten.baddbmm"):
            per = vals[1].shape[-1]
        elif op.startswith("aten._scaled_dot") or op == "aten.scaled_dot_product_attention":
            per = 2 * vals[1].shape[-2]  # q @ k^T and p @ v, per output element
        else:
            per = vals[0].shape[-1]
        return float(2 * out.numel() * int(per))
    except (IndexError, TypeError, AttributeError):
        return 0.0


def calibrate(
    model: torch.nn.Module,
    batches: Iterable[Any],
    *,
    dtype: str = "bf16",
    budget: float = 1e-2,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    options: dict | None = None,
    max_pins: int = 8,
) -> Calibration:
    """Find the smallest set of FP32 pins that brings every output under ``budget``
    (see the module docstring). ``batches``: inputs as a tensor, a tuple or a dict each."""
    if dtype not in ("bf16", "fp16"):
        raise ValueError(f"calibrate dtype must be 'bf16' or 'fp16', got {dtype!r}")
    if not (isinstance(budget, (int, float)) and budget > 0):
        raise ValueError(f"budget must be a relative error > 0, got {budget!r}")
    batches = list(batches)
    if not batches:
        raise ValueError("calibrate needs at least one batch")
    base = dict(options or {})
    was_training = model.training
    model.eval()
    try:

        def measure(pins: list[Pin]) -> Measure:
            opts = with_pins(base, ((p.option, p.pattern) for p in pins))
            return _measure(model, batches, dtype, opts, loss_fn)

        first = current = measure([])
        pins: list[Pin] = []
        tried: set[str] = set()
        while not current.within(budget, dtype) and len(pins) < max_pins:
            culprit = _culprit(current, tried, dtype)
            if culprit is None:
                break
            option, pattern = pin_of(culprit)
            tried.add(pattern)
            after = measure(pins + [Pin(option, pattern, "", 0, 0)])
            if after.error >= current.error and not (current.nonfinite and not after.nonfinite):
                continue  # this pin does not help: leave it out, try the next culprit
            why = (
                "Inf/NaN"
                if culprit.nonfinite
                else f"beyond FP16's range (|x| up to {culprit.max_abs:.3g})"
                if culprit.max_abs > FP16_MAX and dtype == "fp16"
                else f"adds the most error (node error {culprit.rel_error:.2e})"
            )
            where = f"module '{culprit.module}'" if culprit.module else f"op {culprit.op}"
            pins.append(Pin(option, pattern, f"{where}: {culprit.op} {why}", _num(current.error), _num(after.error)))
            current = after
        if current.within(budget, dtype):
            # a pin the others make unnecessary goes again: fewest pins that hold the budget
            for pin in list(pins):
                rest = [p for p in pins if p is not pin]
                trial = measure(rest)
                if trial.within(budget, dtype):
                    pins, current = rest, trial
        share = _fp32_share(first, current)
        prints = [fingerprint(g.nodes) for g in first.plan.graphs] if first.plan else []
        return Calibration(
            dtype,
            float(budget),
            pins,
            first.error,
            current.error,
            share,
            len(batches),
            prints,
            base,
            current.within(budget, dtype),
        )
    finally:
        model.train(was_training)
        torch.compiler.reset()


def _fp32_share(before: Measure, after: Measure) -> float:
    """Share of the matmul/conv FLOPs that ran in 16 bit unpinned and run FP32 pinned."""
    if before.plan is None or after.plan is None:
        return 0.0
    low = {f"{n.graph}:{n.name}" for n in before.plan.nodes if n.precision == "LOW"}
    total = sum(before.flops.get(k, 0.0) for k in low)
    pinned = {f"{n.graph}:{n.name}" for n in after.plan.nodes if n.precision == "FP32"}
    moved = sum(before.flops.get(k, 0.0) for k in low & pinned)
    return moved / total if total else 0.0
