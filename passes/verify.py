"""Verify: the invariants of a rewritten graph; a violation names the node and why.

- every node carries a decision and a reason;
- every LOW / FP32 / PROMOTE node receives its floating inputs in its compute
  dtype (inputs it writes in place excepted);
- every node's actual dtype (meta['val']) is the dtype the plan predicted;
- graph inputs (parameters included) keep their dtype; outputs keep the FP32
  model's dtype unless ``low_precision_outputs``;
- no inserted cast feeds another inserted cast; no value is cast twice to one
  dtype in one region unless it is written in place;
- every user cast the tagger saw is still there;
- ``graph.lint()`` passes.
"""

from __future__ import annotations

import torch

from amp_compiler.meta import dtype_name, info

from .graph_util import (
    AMP_FLOATS,
    is_inserted_cast,
    mutated_inputs,
    node_dtype,
    tensor_inputs,
    volatile_values,
    wanted_dtype,
)
from .infra import PassContext, PassResult


class AmpVerifyError(RuntimeError):
    """The rewritten graph breaks a precision invariant."""


def _fail(node: torch.fx.Node, problem: str) -> None:
    i = info(node)
    where = f" in module '{i.module}'" if i is not None and i.module else ""
    why = f" [{i.precision}: {i.reason}]" if i is not None else ""
    raise AmpVerifyError(f"node '{node.name}' ({node.target}){where}: {problem}{why}")


def verify_plan(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Raise AmpVerifyError on the first broken invariant; modify nothing."""
    graph = gm.graph
    graph.lint()
    volatile = volatile_values(graph)
    names = {n.name for n in graph.nodes}
    missing = ctx.user_casts - names
    if missing:
        raise AmpVerifyError(f"user cast(s) {sorted(missing)} were removed; user casts must survive")
    seen = set()
    for node in graph.nodes:
        i = info(node)
        if i is None or not i.reason:
            _fail(node, "has no precision decision")
        actual = node_dtype(node)
        if node.op != "output" and actual != i.planned:
            _fail(node, f"computes {dtype_name(actual)} but the plan says {dtype_name(i.planned)}")
        if node.op == "placeholder" and actual != i.orig:
            _fail(node, f"graph input changed dtype {dtype_name(i.orig)} -> {dtype_name(actual)}")
        if node.op == "output" and not ctx.options.low_precision_outputs:
            for src in node.all_input_nodes:
                si = info(src)
                if (
                    isinstance(src.meta.get("val"), torch.Tensor)
                    and si.orig in AMP_FLOATS
                    and node_dtype(src) != si.orig
                    and not is_inserted_cast(src)
                ):
                    _fail(
                        node,
                        f"returns {src.name} as {dtype_name(node_dtype(src))}, "
                        f"the FP32 model returns {dtype_name(si.orig)}",
                    )
                if is_inserted_cast(src) and node_dtype(src) != si.orig:
                    _fail(
                        node,
                        f"returns {src.name} as {dtype_name(node_dtype(src))}, "
                        f"the FP32 model returns {dtype_name(si.orig)}",
                    )
        if is_inserted_cast(node):
            src = node.args[0]
            if is_inserted_cast(src):
                _fail(node, f"inserted cast feeds on inserted cast '{src.name}'")
            key = (src, node.kwargs["dtype"], i.region)
            if key in seen and src not in volatile:
                _fail(node, f"'{src.name}' is cast to {dtype_name(key[1])} twice in one region")
            seen.add(key)
            continue
        if i.compute is None and not i.boundary:
            continue
        written = mutated_inputs(node)
        for src in tensor_inputs(node):
            have, want = node_dtype(src), wanted_dtype(i, src)
            if src not in written and have in AMP_FLOATS and want in AMP_FLOATS and have != want:
                _fail(
                    node, f"input '{src.name}' arrives as {dtype_name(have)}, the node computes in {dtype_name(want)}"
                )
    return PassResult(False)
