"""The precision plan a user reads: per node what it runs in, why, and its casts.

``PrecisionPlan.to_dict()`` schema (version 1), stable for scripts::

    {
      "schema": "amp_compiler.plan/1",
      "dtype": "bf16" | "fp16",
      "nodes": [ { "graph": int, "name": str, "op": str, "module": str,
                   "precision": "LOW" | "FP32" | "PROMOTE" | "PASSTHROUGH",
                   "reason": str, "compute_dtype": str, "dtype": str,
                   "casts": [str, ...] }, ... ],
      "casts": [ { "graph": int, "name": str, "source": str, "to": str,
                   "for": str, "bytes": int | null }, ... ],
      "summary": { "graphs": int, "nodes": {precision: count}, "casts": int,
                   "cast_bytes": int | null, "unknown_ops": {op: count} },
      "graphs": [ { "index": int, "dtype": str, "dtype_reason": str,
                    "summary": {...same keys...} }, ... ]
    }

``nodes`` lists the graphs' ATen ops (placeholders, outputs and inserted casts
excluded); ``compute_dtype`` is the dtype the op computes in ("bf16" for LOW
under BF16, "fp32" for FP32, the widest input for PROMOTE, what arrives for
PASSTHROUGH); ``dtype`` is its output dtype after the rewrite; ``casts``
names the casts inserted in front of it; ``bytes`` is null under dynamic shapes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import torch

from .hops import is_hop, rewritten_bodies
from .meta import dtype_name, info
from .policy import Precision
from .upstream.torch_private import OpOverload

SCHEMA = "amp_compiler.plan/1"


@dataclass(frozen=True, slots=True)  # thousands per model, kept for its life
class NodePlan:
    graph: int
    name: str
    op: str
    module: str
    precision: str
    reason: str
    compute_dtype: str
    dtype: str
    casts: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class CastPlan:
    graph: int
    name: str
    source: str
    to: str
    consumer: str
    bytes: int | None


@dataclass
class GraphPlan:
    index: int
    dtype: str
    dtype_reason: str
    nodes: list[NodePlan] = field(default_factory=list)
    casts: list[CastPlan] = field(default_factory=list)
    unknown_ops: dict[str, int] = field(default_factory=dict)
    # False: run as written (dtype "fp32"; or as the user's torch.autocast around the call
    # makes it, when amp could not plan it); the nodes show the BF16 plan not applied
    applied: bool = True

    @classmethod
    def from_graph(cls, gm: torch.fx.GraphModule, index: int, dtype: str, dtype_reason: str) -> GraphPlan:
        plan = cls(index, dtype, dtype_reason)
        unknown: Counter = Counter()
        plan._add(gm, "", unknown)
        plan.unknown_ops = dict(unknown)
        return plan

    def _add(self, gm: torch.fx.GraphModule, prefix: str, unknown: Counter) -> None:
        """Nodes and casts of ``gm``, then of the bodies the pipeline rewrote (named
        ``<body>.<node>``); a higher-order op is one node with its reason."""
        for node in gm.graph.nodes:
            i = info(node)
            if i is None or node.op != "call_function":
                continue
            if i.inserted:
                users = [prefix + u.name for u in node.users]
                self.casts.append(
                    CastPlan(
                        self.index,
                        prefix + node.name,
                        prefix + node.args[0].name,
                        dtype_name(node.kwargs["dtype"]),
                        ", ".join(users),
                        _nbytes(node),
                    )
                )
                continue
            if not (isinstance(node.target, OpOverload) or is_hop(node)):
                continue
            if i.unknown:
                unknown[i.op] += 1
            compute = i.compute if i.compute is not None else _arriving(node)
            self.nodes.append(
                NodePlan(
                    self.index,
                    prefix + node.name,
                    i.op,
                    i.module,
                    i.precision.value,
                    i.reason,
                    dtype_name(compute),
                    dtype_name(i.planned),
                    tuple(i.casts),
                )
            )
        for name, body in rewritten_bodies(gm):
            self._add(body, f"{prefix}{name}.", unknown)

    def summary(self) -> dict:
        return _summary([self])


def _arriving(node: torch.fx.Node) -> object:
    """The floating dtype a PASSTHROUGH node's inputs arrive in (its output's if none)."""
    for arg in node.all_input_nodes:
        val = arg.meta.get("val")
        if isinstance(val, torch.Tensor) and val.is_floating_point():
            return val.dtype
    return info(node).planned


def _nbytes(node: torch.fx.Node) -> int | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    numel = val.numel()
    # int() on a SymInt would specialise it and make Dynamo guard on the size
    return numel * val.element_size() if isinstance(numel, int) else None


def _summary(graphs: list[GraphPlan]) -> dict:
    nodes = Counter({p.value: 0 for p in Precision})
    unknown: Counter = Counter()
    casts, cast_bytes = 0, 0
    for g in graphs:
        nodes.update(n.precision for n in g.nodes)
        unknown.update(g.unknown_ops)
        casts += len(g.casts)
        for c in g.casts:
            cast_bytes = None if cast_bytes is None or c.bytes is None else cast_bytes + c.bytes
    return {
        "graphs": len(graphs),
        "nodes": dict(nodes),
        "casts": casts,
        "cast_bytes": cast_bytes,
        "unknown_ops": dict(unknown),
    }


@dataclass
class PrecisionPlan:
    """The plan over every graph a model compiled to (several after graph breaks)."""

    graphs: list[GraphPlan] = field(default_factory=list)

    @property
    def dtype(self) -> str | None:
        return self.graphs[0].dtype if self.graphs else None

    @property
    def nodes(self) -> list[NodePlan]:
        return [n for g in self.graphs for n in g.nodes]

    @property
    def casts(self) -> list[CastPlan]:
        return [c for g in self.graphs for c in g.casts]

    def summary(self) -> dict:
        return _summary(self.graphs)

    def by_op(self, op: str) -> list[NodePlan]:
        """Nodes whose ATen op starts with ``op`` ("aten.softmax" matches every overload)."""
        return [n for n in self.nodes if n.op == op or n.op.startswith(op + ".")]

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA,
            "dtype": self.dtype,
            "nodes": [asdict(n) | {"casts": list(n.casts)} for n in self.nodes],
            "casts": [
                {"graph": c.graph, "name": c.name, "source": c.source, "to": c.to, "for": c.consumer, "bytes": c.bytes}
                for c in self.casts
            ],
            "summary": self.summary(),
            "graphs": [
                {
                    "index": g.index,
                    "dtype": g.dtype,
                    "dtype_reason": g.dtype_reason,
                    "applied": g.applied,
                    "summary": g.summary(),
                }
                for g in self.graphs
            ],
        }

    def format_summary(self) -> str:
        s = self.summary()
        n = s["nodes"]
        total = sum(n.values())
        parts = ", ".join(f"{k} {v}" for k, v in n.items())
        unknown = f"; unknown ops: {s['unknown_ops']}" if s["unknown_ops"] else ""
        mb = "" if s["cast_bytes"] is None else f" ({s['cast_bytes'] / 2**20:.2f} MiB)"
        if self.graphs and not any(g.applied for g in self.graphs):
            return (
                f"{self.graphs[0].dtype}: {total} ops in {s['graphs']} graph(s) run as "
                f"written; the BF16 plan would have been {parts}, {s['casts']} casts{mb}{unknown} "
                f"({self.graphs[0].dtype_reason})"
            )
        return f"{self.dtype}: {total} ops in {s['graphs']} graph(s): {parts}; {s['casts']} casts inserted{mb}{unknown}"

    def format_table(self, keep=None) -> str:
        """Every node (or those ``keep(node)`` accepts) in one row each."""
        rows = [("graph", "node", "op", "module", "precision", "computes", "out", "casts", "reason")]
        rows += [
            (
                str(n.graph),
                n.name,
                n.op,
                n.module or "-",
                n.precision,
                n.compute_dtype,
                n.dtype,
                ",".join(n.casts) or "-",
                n.reason,
            )
            for n in self.nodes
            if keep is None or keep(n)
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]
        return "\n".join(lines + ["", self.format_summary()])

    def __str__(self) -> str:
        return self.format_summary()
