"""Place flexible nodes by a minimum cut over the elements cast.

Tagging runs a PASSTHROUGH node in whatever dtype arrives: greedy, in graph
order. That is not always the fewest bytes converted: a ``slice`` of a large
FP32 value read by a BF16 matmul is cheaper to cast after the slice than before
it, an ``expand`` cheaper before. This pass decides the dtype of every flexible
node together, as an s-t minimum cut (networkx): source = FP32, sink = the low
dtype; nodes whose dtype is fixed hang off either side; each value that some
consumer needs in the other dtype costs its element count once (one shared cast
per value and direction, as insert_casts does).

It never rounds more than the greedy plan does: a node whose greedy dtype is FP32
may move to 16 bit only if every path from it reaches a 16-bit consumer before
anything else (the value would be rounded there anyway). Moving to FP32 is exact.
The result is applied only when it casts strictly fewer elements than the greedy plan.

Flexible: a PASSTHROUGH op with exactly one floating input, FP32 in the FP32
program, writing nothing and never written in place (nor any alias of it), with no
constant the low dtype cannot hold (a mask fill of FP32's minimum stays where it is),
whose consumers either have a compute dtype (they get a cast) or are flexible too.
"""

from __future__ import annotations

import math

import networkx as nx
import torch

from amp_compiler.meta import dtype_name, info
from amp_compiler.policy import Precision
from amp_compiler.upstream.torch_private import OpOverload

from .graph_util import (
    AMP_FLOATS,
    USER_CAST_OPS,
    mutated_inputs,
    tensor_inputs,
    volatile_values,
    wanted_dtype,
)
from .infra import PassContext, PassResult
from .tag import overflowing_constants

_SRC, _SINK = "FP32", "LOW"


def _numel(node: torch.fx.Node) -> int | None:
    val = node.meta.get("val")
    n = val.numel() if isinstance(val, torch.Tensor) else None
    return n if isinstance(n, int) else None  # symbolic sizes: no placement by size


def _candidate(node: torch.fx.Node, low: torch.dtype) -> bool:
    i = info(node)
    if (
        i is None
        or i.inserted
        or i.boundary
        or node.op != "call_function"
        or i.precision is not Precision.PASSTHROUGH
        or i.compute is not None
        or i.constants
        or node.target in USER_CAST_OPS
        or not isinstance(node.target, OpOverload)
    ):
        return False
    if i.orig != torch.float32 or _numel(node) is None or mutated_inputs(node):
        return False
    if overflowing_constants(node, low):  # e.g. a mask fill of FP32's minimum: FP32 only
        return False
    floats = [n for n in tensor_inputs(node) if n.meta["val"].is_floating_point()]
    return len(floats) == 1 and info(floats[0]) is not None and info(floats[0]).orig == torch.float32


def _requirement(user: torch.fx.Node, value: torch.fx.Node, flex: set, low_outputs: bool):
    """The dtype ``user`` needs ``value`` in; the user itself if flexible; None: no cast
    would be inserted for it, so ``value`` must keep its greedy dtype."""
    if user in flex:
        return user
    if user.op == "output":
        return None if low_outputs else info(value).orig
    ui = info(user)
    if ui is None or (ui.compute is None and not ui.boundary):
        return None
    return wanted_dtype(ui, value)


def place_flexible(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Re-place flexible nodes where a minimum cut casts fewer elements (module docstring)."""
    low, low_outputs = ctx.low_dtype, ctx.options.low_precision_outputs
    nodes = list(gm.graph.nodes)
    written = volatile_values(gm.graph)  # an in-place write decided its dtype by the greedy plan
    flex = {n for n in nodes if _candidate(n, low) and n not in written}
    changed = True
    while changed:  # a node whose consumer cannot take a cast keeps its greedy dtype
        changed = False
        for n in list(flex):
            if any(_requirement(u, n, flex, low_outputs) is None for u in n.users):
                flex.discard(n)
                changed = True
    if not flex:
        return PassResult(False, {})

    lowerable: dict[torch.fx.Node, bool] = {}
    for n in reversed(nodes):
        if n in flex:
            lowerable[n] = bool(n.users) and all(
                lowerable.get(u, False) if u in flex else _requirement(u, n, flex, low_outputs) == low for u in n.users
            )

    def side(dtype):
        return _SINK if dtype == low else _SRC if dtype == torch.float32 else None

    g = nx.DiGraph()
    g.add_nodes_from((_SRC, _SINK))
    values = []  # (where the value is, who needs it, elements): for the greedy plan's cost
    for n in flex:
        if info(n).planned == torch.float32 and not lowerable[n]:
            g.add_edge(_SRC, n)  # no capacity attribute: infinite
    for value in {p for n in flex for p in tensor_inputs(n)} | flex:
        vi = info(value)
        if vi is None or vi.planned not in AMP_FLOATS or _numel(value) is None:
            continue
        here = value if value in flex else side(vi.planned)
        users = [r for u in value.users if (r := _requirement(u, value, flex, low_outputs)) is not None]
        users = [u if isinstance(u, torch.fx.Node) else side(u) for u in users]
        users = [u for u in users if u is not None]
        if here is None or not any(isinstance(u, torch.fx.Node) for u in users + [here]):
            continue
        w = _numel(value)
        values.append((here, users, w))
        down, up = ("down", value), ("up", value)
        g.add_edge(here, down, capacity=w)  # value needed in 16 bit while it is FP32
        g.add_edge(up, here, capacity=w)  # value needed in FP32 while it is 16 bit
        for u in users:
            if u != here:
                g.add_edge(down, u)
                g.add_edge(u, up)
    cut, (fp32_side, _) = nx.minimum_cut(g, _SRC, _SINK)
    greedy = _greedy_cost(values)
    if not math.isfinite(cut) or cut >= greedy:
        return PassResult(False, {"flexible": len(flex), "elements_cast": greedy})
    moved = 0
    for n in flex:
        want = torch.float32 if n in fp32_side else low
        i = info(n)
        if want != i.planned:
            i.planned, i.compute, i.placed = want, want, True
            i.reason += f"; {dtype_name(want)} by minimum cut over elements cast"
            moved += 1
    return PassResult(
        moved > 0, {"flexible": len(flex), "moved": moved, "elements_cast": {"greedy": greedy, "min_cut": cut}}
    )


def _greedy_cost(values) -> int:
    """Elements the greedy plan casts in the same network: one cast per value and direction."""

    def on(x):
        return x if isinstance(x, str) else side_of(info(x).planned)

    def side_of(dtype):
        return _SRC if dtype == torch.float32 else _SINK

    total = 0
    for here, users, w in values:
        sides = {on(u) for u in users}
        total += w * len(sides - {on(here)})
    return total
