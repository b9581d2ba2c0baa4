"""Fold: remove casts this package inserted that do nothing; never a user's cast.

Rules, applied only to nodes tagged ``inserted``:
- a cast whose input already has the target dtype is dropped;
- cast(cast(x, fp32), d) where x is already d is x: widening then narrowing
  back is exact. (Narrowing then widening is not, so that pair stays.)
- two casts of one value to one dtype in one region merge into the first,
  unless the value is written in place in between (then both are needed).
A user's ``.float()`` / ``.to(...)`` is never touched: folding fp32->bf16->fp32
would change the numbers the user asked for.
"""

from __future__ import annotations

import torch

from amp_compiler.meta import info

from .graph_util import is_inserted_cast, node_dtype, refresh_vals, volatile_values
from .infra import PassContext, PassResult


def _target(cast: torch.fx.Node) -> torch.dtype:
    return cast.kwargs["dtype"]


def fold_casts(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Drop or merge redundant inserted casts."""
    graph = gm.graph
    volatile = volatile_values(graph)
    seen: dict[tuple, torch.fx.Node] = {}
    removed = {"noop": 0, "round_trip": 0, "duplicate": 0}
    for node in list(graph.nodes):
        if not is_inserted_cast(node):
            continue
        src = node.args[0]
        replacement, kind = None, None
        if node_dtype(src) == _target(node):
            replacement, kind = src, "noop"
        elif is_inserted_cast(src) and _target(src) == torch.float32 and node_dtype(src.args[0]) == _target(node):
            replacement, kind = src.args[0], "round_trip"
        else:
            key = (src, _target(node), info(node).region)
            if src not in volatile and key in seen:
                replacement, kind = seen[key], "duplicate"
            else:
                seen[key] = node
        if replacement is None:
            continue
        for user in list(node.users):
            user_info = info(user)
            if user_info is not None and node.name in user_info.casts:
                user_info.casts.remove(node.name)
                if is_inserted_cast(replacement):
                    user_info.casts.append(replacement.name)
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
        removed[kind] += 1
    for name in [n for n in list(graph.nodes) if is_inserted_cast(n) and not n.users]:
        graph.erase_node(name)
    modified = any(removed.values())
    if modified:
        refresh_vals(gm, ctx.fake_mode)
        graph.lint()
    return PassResult(modified, {k: v for k, v in removed.items() if v})
