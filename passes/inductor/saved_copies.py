"""Joint-graph pass: an FP32 island's backward reads the 16-bit copy that is saved anyway.

The plan keeps softmax in FP32 and casts its output to 16 bit for the next matmul.
Autograd then saves both: the FP32 output for softmax's backward and the 16-bit copy
for the matmul's. This pass, run by Inductor on the joint forward+backward graph
before partitioning, makes every backward use of such an FP32 value read
``copy.to(float32)`` instead, when that 16-bit copy is already needed by backward.
The partitioner then saves the copy alone: 2 bytes per element instead of 6.

Only backward reads change, and only to a value rounded the way the forward's own
consumer saw it: softmax's gradient is computed from BF16 probabilities, as under
``torch.autocast`` (where the whole softmax runs in 16 bit).
"""

from __future__ import annotations

import torch

from amp_compiler.passes.graph_util import JOINT_CAST, JOINT_VIEWS, LOW_FLOATS, closure, node_dtype, tangent_dependent

_ALIAS = {torch.ops.aten.alias.default}


def _backward(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The backward half of the joint graph: nodes that depend on a tangent, and nodes
    computed only for those (``-y`` in softmax's gradient needs no tangent)."""
    seen = tangent_dependent(graph)
    for n in reversed(graph.nodes):
        if n.op == "call_function" and n.users and all(u in seen for u in n.users):
            seen.add(n)
    return seen


def reuse_saved_copies(graph: torch.fx.Graph) -> int:
    """Rewrite backward reads of FP32 values onto their saved 16-bit copies; returns how many."""
    bwd = _backward(graph)
    if not bwd:
        return 0
    order = {n: i for i, n in enumerate(graph.nodes)}
    done = 0
    for node in list(graph.nodes):
        if node in bwd or node.op != "call_function" or node_dtype(node) != torch.float32:
            continue
        copy = next(
            (u for u in node.users if u.target is JOINT_CAST and u not in bwd and u.args[1] in LOW_FLOATS), None
        )
        if copy is None:
            continue
        if not any(u in bwd for v in closure(copy, JOINT_VIEWS) for u in v.users):
            continue  # the copy is not saved: swapping would save it instead, at a precision cost
        # backward readers of the value, looking through aliases; all come after the copy
        uses = [
            (u, v)
            for v in closure(node, _ALIAS)
            for u in v.users
            if u in bwd and u.target not in _ALIAS and order[u] > order[copy]
        ]
        if not uses:
            continue
        with graph.inserting_after(copy):
            up = graph.call_function(JOINT_CAST, (copy, torch.float32))
        up.meta["val"] = node.meta["val"]
        for user, value in uses:
            user.replace_input_with(value, up)
        done += 1
    return done
