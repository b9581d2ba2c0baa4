"""Higher-order ops: how each one Dynamo emits is captured and planned.

A higher-order op carries subgraphs (a checkpointed block, a custom
``autograd.Function``'s forward and backward, the branches of ``cond``). Tracing
through one as if it were ordinary code changes the program: a custom
Function traced that way loses its backward, so the parameters before it get
no gradient. Every higher-order op therefore gets one of three treatments:

INLINE   no semantics of its own: traced through, the body joins the graph.
REWRITE  the body is traced to ATen and rewritten by the same pipeline as the
         graph around it; the op stays, with the new body. Its inputs and
         outputs keep the FP32 program's dtypes at the boundary.
OPAQUE   kept exactly as written (bodies untouched); its floating inputs are
         cast back to the dtypes the FP32 program gave them, so the region runs
         as it would without amp. Every op not named below is OPAQUE: an op
         the backend does not understand runs unchanged, never differently.

A custom ``autograd.Function`` is OPAQUE on purpose: its backward was written
by hand for the dtypes its forward saw, so running its forward in 16 bit would
feed the backward tensors it was not written for.
"""

from __future__ import annotations

import enum
import operator

import torch

from .upstream.torch_private import HigherOrderOperator


class HopKind(str, enum.Enum):
    INLINE = "INLINE"
    REWRITE = "REWRITE"
    OPAQUE = "OPAQUE"


_hop = torch.ops.higher_order
# name -> (treatment, the reason the plan shows)
_TABLE = {
    "wrap": (HopKind.INLINE, "wrapper with no semantics: traced through"),
    "invoke_subgraph": (
        HopKind.INLINE,
        "nested compile region: traced through (same program, the region is no longer compiled once for all calls)",
    ),
    "tag_activation_checkpoint": (
        HopKind.REWRITE,
        "activation checkpoint: the body follows the policy (its nodes are listed under it) and "
        "backward recomputes it in the same precision; FP32 program dtypes at the boundary",
    ),
    "autograd_function_apply": (
        HopKind.OPAQUE,
        "custom autograd.Function: forward and hand-written backward run as written, in the FP32 program's dtypes",
    ),
}


def hop_name(target: object) -> str | None:
    """The op's name when ``target`` is a higher-order op, else None."""
    return target.name() if isinstance(target, HigherOrderOperator) else None


def treatment(target: object, body: object = None) -> tuple[HopKind, str]:
    """(treatment, reason) of higher-order op ``target`` called with first argument
    ``body``; a region outlined here (``body.meta["amp_opaque"]``) is OPAQUE."""
    reason = getattr(body, "meta", {}).get("amp_opaque")
    if reason:
        return HopKind.OPAQUE, reason
    name = hop_name(target)
    if name in _TABLE:
        return _TABLE[name]
    return HopKind.OPAQUE, (f"higher-order op {name}: runs as written, in the FP32 program's dtypes (an FP32 region)")


def node_treatment(node: torch.fx.Node) -> tuple[HopKind, str]:
    """``treatment`` of a higher-order op node in a graph."""
    body = node.args[0] if node.args else None
    if isinstance(body, torch.fx.Node) and body.op == "get_attr":
        body = getattr(node.graph.owning_module, body.target, None)
    return treatment(node.target, body)


def is_hop(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and hop_name(node.target) is not None


def rewritten_bodies(gm: torch.fx.GraphModule) -> list[tuple[str, torch.fx.GraphModule]]:
    """(qualified name, body) of every subgraph of ``gm`` the pipeline must rewrite."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            body = getattr(gm, node.target, None)
            if isinstance(body, torch.fx.GraphModule) and body.meta.get("amp_rewrite"):
                out.append((node.target, body))
    return out


_VMAP_ENTER = "_vmap_increment_nesting"
_VMAP_EXIT = "_vmap_decrement_nesting"
_VMAP_REASON = (
    "vmap region (torch.func.vmap, associative_scan): runs as written, in the FP32 "
    "program's dtypes (an FP32 region; ATen capture cannot follow batched tensors)"
)


def _vmap_step(node: torch.fx.Node) -> int:
    name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
    return {_VMAP_ENTER: 1, _VMAP_EXIT: -1}.get(name, 0)


def outline_vmap_regions(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Move each top-level vmap region of Dynamo's graph into a ``wrap`` subgraph marked OPAQUE.

    Pre-dispatch tracing through Dynamo's inlined vmap loses track of the batched
    tensors (they become constants, their gradients vanish). As a ``wrap`` node the
    region reaches AOTAutograd as Dynamo wrote it. Returns ``gm`` itself when there
    is no vmap, else a rewritten copy.
    """
    if not any(_vmap_step(n) > 0 for n in gm.graph.nodes):
        return gm
    gm = torch.fx.GraphModule(gm, gm.graph.__deepcopy__())
    regions, current, depth = [], [], 0
    for node in gm.graph.nodes:
        depth += _vmap_step(node)
        if depth or current:
            current.append(node)
        if not depth and current:
            regions.append(current)
            current = []
    for index, region in enumerate(regions):
        _outline(gm, region, f"amp_vmap_region_{index}")
    gm.recompile()
    return gm


def _outline(gm: torch.fx.GraphModule, region: list[torch.fx.Node], name: str) -> None:
    inside = set(region)
    inputs = list(dict.fromkeys(a for n in region for a in n.all_input_nodes if a not in inside))
    outputs = [n for n in region if any(u not in inside for u in n.users)]
    graph, env = torch.fx.Graph(), {}
    for a in inputs:
        env[a] = graph.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in region:
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(tuple(env[o] for o in outputs))
    body = torch.fx.GraphModule(gm, graph)
    body.meta["amp_opaque"] = _VMAP_REASON
    # Tracing dead-code-eliminates subgraphs in place, and vmap's nesting calls
    # have no users: keep the region as written for inline_outlined.
    body.meta["amp_outlined"] = torch.fx.GraphModule(gm, graph.__deepcopy__())
    gm.add_submodule(name, body)
    with gm.graph.inserting_before(region[0]):
        call = gm.graph.call_function(_hop.wrap, (gm.graph.get_attr(name), *inputs))
        call.meta = {k: v for k, v in region[0].meta.items() if k in ("nn_module_stack", "stack_trace")}
        for i, out in enumerate(outputs):
            item = gm.graph.call_function(operator.getitem, (call, i))
            item.meta = dict(out.meta)
            out.replace_all_uses_with(item, delete_user_cb=lambda user: user not in inside)
    for n in reversed(region):
        gm.graph.erase_node(n)


def inline_outlined(gm: torch.fx.GraphModule) -> None:
    """Put the regions ``outline_vmap_regions`` moved out back in place, as Dynamo wrote them.

    They travel through the pipeline as one OPAQUE node; AOTAutograd then traces
    the vmap as it would without amp (it cannot through a ``wrap``).
    """
    graph = gm.graph
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target is _hop.wrap):
            continue
        body = getattr(gm, node.args[0].target).meta.get("amp_outlined")
        if body is None:
            continue
        env = dict(zip([n for n in body.graph.nodes if n.op == "placeholder"], node.args[1:]))
        with graph.inserting_before(node):
            for inner in body.graph.nodes:
                if inner.op == "get_attr" and not hasattr(gm, inner.target):
                    setattr(gm, inner.target, getattr(body, inner.target))
                if inner.op == "output":
                    outputs = inner.args[0]
                elif inner.op != "placeholder":
                    env[inner] = graph.node_copy(inner, env.__getitem__)
        for user in list(node.users):
            user.replace_all_uses_with(env[outputs[user.args[1]]])
            graph.erase_node(user)
        attr = node.args[0]
        graph.erase_node(node)
        if not attr.users:
            graph.erase_node(attr)
            delattr(gm, attr.target)
    gm.recompile()
