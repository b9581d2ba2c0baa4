"""Insert casts: give every tagged node its inputs in the dtype it computes in.

Rule: a LOW, FP32 or PROMOTE node's floating inputs must arrive in its compute
dtype. A value is cast at most once per target dtype per region (a stretch of
the graph with one grad/autocast mode), so each weight is cast once per step
however many ops read it; the cast sits just before its first reader. Values
written in place are the exception: their cast would go stale, so each reader
gets a fresh one. Inputs an op writes to are never cast. Graph outputs go back
to the dtype the FP32 model returns unless ``low_precision_outputs``. At a
higher-order op's boundary inputs go back to the FP32 program's dtypes. Scalar
constants the tagger refitted to the low dtype's range are written here.
"""

from __future__ import annotations

import torch

from amp_compiler.meta import META_KEY, NodeInfo, dtype_name, info
from amp_compiler.policy import Precision

from .graph_util import (
    AMP_FLOATS,
    CAST_OP,
    dtype_arg,
    mutated_inputs,
    refresh_vals,
    set_arg,
    tensor_inputs,
    volatile_values,
    wanted_dtype,
)
from .infra import PassContext, PassResult


def _make_cast(graph, src, dtype, before, region, reason, low):
    with graph.inserting_before(before):
        cast = graph.create_node(
            "call_function", CAST_OP, (src,), {"dtype": dtype}, name=f"{src.name}_to_{dtype_name(dtype)}"
        )
    src_info = info(src)
    cast.meta["val"] = src.meta["val"]  # refreshed below, before anyone reads it
    for key in ("nn_module_stack", "stack_trace"):
        if key in before.meta:
            cast.meta[key] = before.meta[key]
    cast.meta[META_KEY] = NodeInfo(
        Precision.LOW if dtype == low else Precision.FP32,
        reason,
        op=str(CAST_OP),
        module=info(before).module if info(before) else "",
        orig=src_info.orig if src_info else None,
        planned=dtype,
        region=region,
        inserted=True,
    )
    return cast


def insert_casts(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Insert the casts the tags ask for; refresh meta['val'] afterwards."""
    graph = gm.graph
    volatile = volatile_values(graph)
    cache: dict[tuple, torch.fx.Node] = {}
    added = refills = 0

    def cast_for(src, dtype, consumer, region, why):
        nonlocal added
        key = (src, dtype, region)
        if src not in volatile and key in cache:
            return cache[key]
        cast = _make_cast(graph, src, dtype, consumer, region, why, ctx.low_dtype)
        added += 1
        if src not in volatile:
            cache[key] = cast
        return cast

    for node in list(graph.nodes):
        node_info = info(node)
        if node_info is None or node_info.inserted:
            continue
        if node.op == "output":
            if not ctx.options.low_precision_outputs:
                _restore_outputs(node, cast_for)
            continue
        if node.target is torch.ops.aten._assert_tensor_metadata.default:
            # torch.export asserts the dtype each value had when traced; the
            # assertion follows the plan, or the exported program fails on itself.
            src, (slot, asserted) = node.args[0], dtype_arg(node)
            have = info(src).planned if info(src) else None
            if asserted in AMP_FLOATS and have in AMP_FLOATS and have != asserted:
                set_arg(node, slot, have)
                refills += 1
            continue
        for slot, value in node_info.constants.items():
            set_arg(node, slot, value)
            refills += 1
        if node_info.compute is None and not node_info.boundary:
            continue
        written = mutated_inputs(node)
        for src in tensor_inputs(node):
            have = info(src).planned if info(src) else src.meta["val"].dtype
            want = wanted_dtype(node_info, src)
            if src in written or have not in AMP_FLOATS or want not in AMP_FLOATS or have == want:
                continue
            why = f"{src.name} {dtype_name(have)} -> {dtype_name(want)} for {node.name} ({node_info.precision})"
            cast = cast_for(src, want, node, node_info.region, why)
            node.replace_input_with(src, cast)
            node_info.casts.append(cast.name)
    if added:
        refresh_vals(gm, ctx.fake_mode)
        graph.lint()
    detail = {"casts_inserted": added, **({"constants_refitted": refills} if refills else {})}
    return PassResult(added + refills > 0, detail)


def _restore_outputs(output: torch.fx.Node, cast_for) -> None:
    out_info = info(output)
    for src in output.all_input_nodes:
        src_info = info(src)
        if src_info is None or not isinstance(src.meta.get("val"), torch.Tensor):
            continue
        if src_info.orig in AMP_FLOATS and src_info.planned != src_info.orig:
            why = (
                f"{src.name} {dtype_name(src_info.planned)} -> {dtype_name(src_info.orig)}: "
                "outputs keep the FP32 model's dtype"
            )
            cast = cast_for(src, src_info.orig, output, src_info.region, why)
            output.replace_input_with(src, cast)
            out_info.casts.append(cast.name)
