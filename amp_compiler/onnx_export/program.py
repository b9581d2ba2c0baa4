"""The planned program: torch.export, the amp pipeline, weights stored in 16 bit."""

from __future__ import annotations

import inspect
import logging
import os
import traceback

import torch
from torch.export.graph_signature import InputKind, OutputKind, TensorArgument

from amp_compiler.passes import PIPELINE, PassContext, run_pipeline
from amp_compiler.passes.decompose_attention import write_out_all
from amp_compiler.passes.graph_util import is_inserted_cast, refresh_vals

from ..meta import META_KEY, NodeInfo
from ..options import AmpOptions
from ..plan import GraphPlan
from ..policy import LOW_DTYPES, Precision
from ..upstream.torch_private import private
from .base import ExportError
from .kernels import export_fp32_pins

log = logging.getLogger("amp_compiler")


def planned_program(model, args, kwargs, dtype, target, dynamic_shapes, options, low_io, fused_attention=False):
    """torch.export the model, run the amp pipeline on it, store 16-bit-only weights in 16 bit.
    ``fused_attention``: SDPA stays one op (ONNX's Attention, opset 23), its softmax computed
    in FP32 inside the runtime's kernel, as PyTorch's fused kernels compute it."""
    try:
        # torch.distributions' argument checks are Python branches on values; torch.compile
        # turns them off for the whole process, so do the same here, for this call only
        validate = torch.distributions.Distribution._validate_args
        torch.distributions.Distribution.set_default_validate_args(False)
        try:
            ep = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
        finally:
            torch.distributions.Distribution.set_default_validate_args(validate)
    except Exception as e:
        raise ExportError(f"torch.export failed: {type(e).__name__}: {str(e).splitlines()[0]}{_export_hint(e)}") from e
    if dtype != "fp32":
        # The exporter lowers SDPA to MatMul/Softmax/MatMul below opset 23; write it out
        # first (as the backend's pass does, in the fused op's memory layout, which views
        # after it may rely on) so the policy sees the softmax and keeps it FP32. The retrace
        # also canonicalises ops (split -> split_with_sizes: ONNX's Split, where a 16-bit
        # SplitToSequence is invalid) for the exporter.
        if not fused_attention:
            write_out_all(ep.graph_module)
        ep = ep.run_decompositions({})
    fp32_bytes = sum(t.numel() * 4 for t in _lifted_tensors(ep).values() if t.is_floating_point())
    gm = ep.graph_module
    if dtype == "fp32":
        for node in gm.graph.nodes:
            node.meta[META_KEY] = NodeInfo(Precision.FP32, "fp32 export: no rewrite")
        return (
            ep,
            GraphPlan.from_graph(gm, 0, "fp32", "dtype='fp32' requested"),
            fp32_bytes,
        )
    # the fused loss head is a custom op no ONNX runtime has: an exported head stays as written
    opts = AmpOptions.from_mapping(options, dtype=dtype, low_precision_outputs=low_io, loss_head="off")
    policy = opts.policy(LOW_DTYPES[dtype])
    if dtype == "bf16":
        policy = policy.with_fp32(export_fp32_pins(target))
    fake_mode = private("torch._guards.detect_fake_mode")(
        [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    )
    ctx = PassContext(policy=policy, options=opts, fake_mode=fake_mode)
    try:
        run_pipeline(gm, ctx, PIPELINE)
    except Exception as e:
        raise ExportError(f"amp pipeline failed: {e}") from e
    _store_low_weights(ep, LOW_DTYPES[dtype], fake_mode)
    _sync_output_specs(ep)
    gm.recompile()
    return ep, GraphPlan.from_graph(gm, 0, dtype, f"export for {target}"), fp32_bytes


def _export_hint(error: Exception) -> str:
    """What to change in the model or the call, for the torch.export failures users meet."""
    message = str(error)
    if "Cache" in message:
        return " (a KV cache in the outputs: pass use_cache=False in kwargs)"
    if "Constraints violated" in message:
        return _range_hint(message)
    if "data-dependent" in message:
        # the model's own line: the last frame outside torch and this package
        skip = (os.path.dirname(torch.__file__), os.path.dirname(__file__))
        user = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(skip)]
        at = f" at {user[-1].filename}:{user[-1].lineno}" if user else ""
        return (
            f" (the model branches on a tensor's value{at}, e.g. `if mask.any():` or "
            "`.item()`; torch.export traces one program for every input, so make that "
            "branch independent of the values or write it with torch.cond)"
        )
    return ""


def _range_hint(message: str) -> str:
    """A dynamic dimension the model bounds (a position table, a window): torch's own reason
    and suggested Dim, which its first line leaves out, and how to give the range."""
    lines = [line.strip() for line in message.splitlines()]
    why = next((line.removeprefix("- ") for line in lines if line.startswith("- ")), None)
    fixes = []
    if "Suggested fixes:" in lines:
        after = lines[lines.index("Suggested fixes:") + 1 :]
        fixes = after[: after.index("")] if "" in after else after  # up to torch's next paragraph
    said = f": {why}" if why else ""
    suggested = f"; torch suggests {', '.join(fixes)}" if fixes else ""
    return (
        f" (the model constrains a dimension you made dynamic{said}{suggested}; give that Dim "
        "the range the model supports, Dim(name, max=...), or on the command line "
        "--dynamic AXIS:NAME:MAX; a dimension it fixes cannot be dynamic)"
    )


def _lifted_tensors(ep) -> dict[str, torch.Tensor]:
    """Placeholder name -> tensor for parameters, buffers and constants."""
    out = {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            out[spec.arg.name] = (
                ep.state_dict[spec.target] if spec.target in ep.state_dict else ep.constants[spec.target]
            )
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            out[spec.arg.name] = ep.constants[spec.target]
    return out


def _store_low_weights(ep, low: torch.dtype, fake_mode) -> None:
    """A weight read only through casts to ``low`` (and by embedding lookups) is stored in ``low``.

    The casts go away; an embedding lookup of a 16-bit table gets its rows cast
    back to FP32, so the FP32 residual stream is unchanged (the table's values
    are rounded once, as any BF16 weight is).
    """
    graph = ep.graph_module.graph
    specs = {
        s.arg.name: s
        for s in ep.graph_signature.input_specs
        if s.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
    }
    for node in [n for n in graph.nodes if n.op == "placeholder" and n.name in specs]:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dtype != torch.float32 or not node.users:
            continue
        casts = [u for u in node.users if is_inserted_cast(u) and u.kwargs["dtype"] == low]
        lookups = [u for u in node.users if u.target is torch.ops.aten.embedding.default and u.args[0] is node]
        if len(casts) + len(lookups) != len(node.users) or not casts and not lookups:
            continue
        spec = specs[node.name]
        store = ep.state_dict if spec.target in ep.state_dict else ep.constants
        store[spec.target] = store[spec.target].detach().to(low)
        if spec.kind == InputKind.PARAMETER:
            store[spec.target] = torch.nn.Parameter(store[spec.target], requires_grad=False)
        with fake_mode:
            node.meta["val"] = torch.empty_like(val, dtype=low)
        for cast in casts:
            cast.replace_all_uses_with(node)
            graph.erase_node(cast)
        for lookup in lookups:
            with graph.inserting_after(lookup):
                up = graph.call_function(torch.ops.aten._to_copy.default, (lookup,), {"dtype": torch.float32})
            lookup.replace_all_uses_with(up, delete_user_cb=lambda n, up=up: n is not up)
            up.meta[META_KEY] = NodeInfo(
                Precision.FP32,
                "embedding rows from a 16-bit table, back to fp32",
                inserted=True,
                planned=torch.float32,
                orig=torch.float32,
            )
            up.meta["val"] = lookup.meta["val"]
    refresh_vals(ep.graph_module, fake_mode)
    graph.lint()


def _sync_output_specs(ep) -> None:
    """Outputs may now be casts: point the signature's user outputs at them."""
    out = next(n for n in ep.graph_module.graph.nodes if n.op == "output")
    for spec, arg in zip(ep.graph_signature.output_specs, out.args[0]):
        if spec.kind == OutputKind.USER_OUTPUT and isinstance(arg, torch.fx.Node):
            spec.arg = TensorArgument(name=arg.name)


def in_signature_order(model, kwargs: dict) -> dict:
    """Keyword inputs in the order of ``forward``'s parameters, as torch.export lists them."""
    try:
        names = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return kwargs
    return {k: kwargs[k] for k in names if k in kwargs} | kwargs
