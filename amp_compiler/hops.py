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

import torch
from torch._ops import HigherOrderOperator


class HopKind(str, enum.Enum):
    INLINE = "INLINE"
    REWRITE = "REWRITE"
    OPAQUE = "OPAQUE"


_hop = torch.ops.higher_order
# name -> (treatment, the reason the plan shows)
_TABLE = {
    "wrap": (HopKind.INLINE, "wrapper with no semantics: traced through"),
    "invoke_subgraph": (HopKind.INLINE, "nested compile region: traced through (same program, "
                                        "the region is no longer compiled once for all calls)"),
    "tag_activation_checkpoint": (
        HopKind.REWRITE,
        "activation checkpoint: the body follows the policy (its nodes are listed under it) and "
        "backward recomputes it in the same precision; FP32 program dtypes at the boundary"),
    "autograd_function_apply": (
        HopKind.OPAQUE,
        "custom autograd.Function: forward and hand-written backward run as written, in the FP32 "
        "program's dtypes"),
}


def hop_name(target: object) -> str | None:
    """The op's name when ``target`` is a higher-order op, else None."""
    return target.name() if isinstance(target, HigherOrderOperator) else None


def treatment(target: object) -> tuple[HopKind, str]:
    name = hop_name(target)
    if name in _TABLE:
        return _TABLE[name]
    return HopKind.OPAQUE, (f"higher-order op {name}: runs as written, in the FP32 program's "
                            "dtypes (an FP32 region)")


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
