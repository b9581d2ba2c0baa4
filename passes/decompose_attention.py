"""Decompose attention that PyTorch would run in FP32 behind the policy's back.

Rule: on CPU, when training, ``scaled_dot_product_attention`` with a floating
mask computed from parameters (T5's and Swin's learned position bias) needs a
mask gradient, which the fused kernel cannot give;
PyTorch's math fallback then upcasts BF16 inputs to FP32 internally, so the
matmuls would not run in BF16 although the plan says LOW. Such a node is
rewritten into matmul -> scale -> (+ mask) -> softmax -> (dropout) -> matmul,
which the tags then place exactly (matmuls LOW, softmax FP32). Everything else
keeps the fused op. Runs before tagging; skips nodes with symbolic head sizes.
"""

from __future__ import annotations

import torch

from .graph_util import refresh_vals
from .infra import PassContext, PassResult

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _from_parameter(node: torch.fx.Node) -> bool:
    """Whether a value is computed from a graph input that requires grad (a parameter)."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            val = n.meta.get("val")
            if "parameters" in n.name or getattr(val, "requires_grad", False):
                return True
        todo.extend(n.all_input_nodes)
    return False


def _needs_decomposition(node: torch.fx.Node) -> dict | None:
    if node.op != "call_function" or node.target is not SDPA or not torch.is_grad_enabled():
        return None
    a = dict(zip(_ARGS, node.args)) | dict(node.kwargs)
    q, mask = a["query"].meta.get("val"), a.get("attn_mask")
    mask_val = mask.meta.get("val") if isinstance(mask, torch.fx.Node) else None
    if q is None or q.device.type != "cpu" or mask_val is None:
        return None
    if not (mask_val.is_floating_point() and _from_parameter(mask)):
        return None
    if not isinstance(q.shape[-1], int) or a.get("enable_gqa", False):
        return None
    return a


def decompose_attention(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Rewrite CPU SDPA with a trainable float mask into its math form (see module docstring)."""
    graph = gm.graph
    done = 0
    for node in list(graph.nodes):
        a = _needs_decomposition(node)
        if a is None:
            continue
        q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
        head = q.meta["val"].shape[-1]
        scale = a.get("scale") or head ** -0.5
        with graph.inserting_before(node):
            call = graph.call_function
            scores = call(aten.matmul.default, (q, call(aten.transpose.int, (k, -2, -1))))
            scores = call(aten.mul.Tensor, (scores, scale))
            if a.get("is_causal", False):
                lq, lk = q.meta["val"].shape[-2], k.meta["val"].shape[-2]
                ones = call(aten.ones.default, ([lq, lk],), {"dtype": torch.bool,
                                                             "device": q.meta["val"].device})
                scores = call(aten.masked_fill.Scalar,
                              (scores, call(aten.triu.default, (ones, 1)), float("-inf")))
            scores = call(aten.add.Tensor, (scores, mask))
            weights = call(aten.softmax.int, (scores, -1))
            if a.get("dropout_p", 0.0):
                weights = call(aten.dropout.default, (weights, a["dropout_p"], True))
            out = call(aten.matmul.default, (weights, v))
        _copy_meta(node, out)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        done += 1
    if done:
        refresh_vals(gm, ctx.fake_mode)
        graph.lint()
        gm.recompile()
    return PassResult(done > 0, {"decomposed": done} if done else {})


def _copy_meta(old: torch.fx.Node, last: torch.fx.Node) -> None:
    """The new nodes (between the inputs and ``last``) inherit the module stack of ``old``."""
    node = last
    while node is not None and node is not old and "val" not in node.meta:
        for key in ("nn_module_stack", "stack_trace"):
            if key in old.meta:
                node.meta[key] = old.meta[key]
        node = node.prev
