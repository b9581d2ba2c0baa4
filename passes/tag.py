"""Tag: decide every node's precision, with a reason, before touching the graph.

Rule: walk the graph in order. Each ATen op gets its table's decision (LOW,
FP32, PROMOTE, PASSTHROUGH), unless a pin says FP32: a
``torch.autocast(enabled=False)`` region or a module matching ``fp32_modules``.
Only ops with an FP32/BF16/FP16 tensor input are candidates; integer, bool,
complex and float64 work is left alone. The planned output dtype of each node
is derived from its inputs' planned dtypes, so insert_casts knows exactly
which inputs need a cast. Writes ``node.meta["amp"]`` and nothing else.
"""

from __future__ import annotations

import logging
import math
import operator
import re
from collections import Counter

import torch

from amp_compiler.hops import HopKind, is_hop, node_treatment
from amp_compiler.meta import META_KEY, NodeInfo, dtype_name, info
from amp_compiler.policy import FIXED_OUTPUT_OPS, AmpPolicyError, Precision, why
from amp_compiler.upstream.torch_private import OpOverload

from .graph_util import (
    AMP_FLOATS,
    USER_CAST_OPS,
    explicit_dtype,
    mutated_inputs,
    node_dtype,
    region_name,
    schema_args,
    tensor_inputs,
    widest,
)
from .infra import PassContext, PassResult

log = logging.getLogger(__name__)
_UNKNOWN = "unknown op"
# The root of a Dynamo source: L['self'], G['model'], or L['args'][0] when the
# compiled frame is a wrapper that received the module positionally.
_MODULE_KEY = re.compile(r"^[LG]\[['\"](?:args['\"]\]\[\d+|[^'\"]+['\"])\]\.?")


def module_path(node: torch.fx.Node) -> list[str]:
    """Dotted module paths of the node's nn_module_stack, outermost first.

    Dynamo spells them as sources ("L['self'].layers[0]._modules['attn']");
    users write "layers.0.attn" (also through a compiled module's ``_orig_mod``).
    """
    stack = node.meta.get("nn_module_stack") or {}
    paths = []
    for value in stack.values():
        src = value[0] if isinstance(value, tuple) else str(value)
        src = re.sub(r"getattr\((.*?), ['\"]([^'\"]+)['\"]\)", r"\1.\2", src)
        src = _MODULE_KEY.sub("", src)
        src = re.sub(r"\._modules\[['\"]([^'\"]+)['\"]\]", r".\1", src)
        src = re.sub(r"\[['\"]?([^'\"\]]+)['\"]?\]", r".\1", src)
        # a compiled module (torch.compile's wrapper) reached from a compiled frame
        src = re.sub(r"(^|\.)_orig_mod(?=\.|$)", "", src)
        src = src.strip(".")
        if src and src not in paths:
            paths.append(src)
    return paths


def _promoted(inputs: list[torch.fx.Node]) -> torch.dtype | None:
    """Widest planned float dtype, ignoring 0-dim tensors as torch promotion does."""

    def planned(n):
        i = info(n)
        return i.planned if i is not None else node_dtype(n)

    dims = [planned(n) for n in inputs if n.meta["val"].dim() > 0]
    return widest(dims) or widest([planned(n) for n in inputs])


class _Tagger:
    def __init__(self, ctx: PassContext):
        self.ctx = ctx
        self.low = ctx.low_dtype
        self.patterns = [(p, re.compile(p)) for p in ctx.options.fp32_modules]
        self.region = 0
        self.autocast_off: list[bool] = []
        self.unknown: Counter = Counter()
        source = ctx.options.policy_source
        self.notes = source.notes if source is not None else {}  # what a policy file says

    def planned(self, node: object) -> object:
        i = info(node) if isinstance(node, torch.fx.Node) else None
        return i.planned if i is not None else node_dtype(node)

    def orig(self, node: torch.fx.Node) -> object:
        i = info(node)
        return i.orig if i is not None else node_dtype(node)

    def pin(self, modules: list[str]) -> str | None:
        if any(self.autocast_off):
            return "pinned FP32: inside torch.autocast(enabled=False)"
        for text, pattern in self.patterns:
            for path in modules or [""]:  # "" is the top-level module's own ops
                if pattern.search(path):
                    why = f"pinned FP32: module '{path or '<top level>'}' matches fp32_modules {text!r}"
                    note = self.notes.get(text)
                    return f"{why} ({note})" if note else why
        return None

    def visit(self, node: torch.fx.Node) -> NodeInfo:
        name = region_name(node)
        if name:
            self.region += 1
            if name == "_enter_autocast":
                enabled = node.args[2] if len(node.args) > 2 else node.kwargs.get("enabled", True)
                self.autocast_off.append(not enabled)
            elif name == "_exit_autocast" and self.autocast_off:
                self.autocast_off.pop()
        modules = module_path(node)
        base = dict(op=_op_name(node), module=modules[-1] if modules else "", orig=self.orig(node), region=self.region)
        if is_hop(node):
            kind, reason = node_treatment(node)
            precision = Precision.FP32 if kind is HopKind.OPAQUE else Precision.PASSTHROUGH
            return NodeInfo(precision, reason, planned=base["orig"], boundary=True, **base)
        precision, reason, compute = self.decide(node, modules)
        planned = self.plan(node, precision, compute, base["orig"])
        constants = {}
        low = compute or planned
        big = overflowing_constants(node, low) if base["orig"] == torch.float32 else {}
        if big:
            if all(abs(v) >= _FP32_MAX for v in big.values()):
                # finfo(float32).min as a mask fill means "the lowest value there is".
                constants = {k: math.copysign(torch.finfo(low).max, v) for k, v in big.items()}
                reason += (
                    f"; fill {_values(big)} (FP32's extreme, baked in from the FP32 "
                    f"model) becomes {dtype_name(low)}'s extreme"
                )
            elif mutated_inputs(node):
                raise AmpPolicyError(
                    f"node '{node.name}' writes the constant {_values(big)} into a "
                    f"{dtype_name(low)} tensor, which cannot hold it; pin its module with "
                    "fp32_modules so the tensor stays FP32"
                )
            else:
                precision, compute = Precision.FP32, torch.float32
                what = "does not fit" if any(abs(v) >= 1 for v in big.values()) else "rounds to 0 in"
                reason = f"constant {_values(big)} {what} {dtype_name(low)}: FP32 (was: {reason})"
                planned = self.plan(node, precision, compute, base["orig"])
        return NodeInfo(
            precision,
            reason,
            compute=compute,
            planned=planned,
            constants=constants,
            unknown=reason.startswith(_UNKNOWN),
            **base,
        )

    def decide(self, node, modules):
        if node.op == "placeholder":
            is_param = "parameters" in node.name or node.name.startswith("p_")  # Dynamo / torch.export
            kind = "parameter (FP32 master copy)" if is_param else "graph input"
            return Precision.PASSTHROUGH, f"{kind}: keeps its dtype", None
        if node.op == "output":
            return Precision.PASSTHROUGH, "graph output: returned in the FP32 model's dtype", None
        if node.op != "call_function" or not isinstance(node.target, OpOverload):
            if node.target is operator.getitem:
                return Precision.PASSTHROUGH, "element of a multi-output op", None
            return Precision.PASSTHROUGH, "not a tensor op", None

        inputs = tensor_inputs(node)
        orig_in = [self.orig(n) for n in inputs]
        if any(d in (torch.float64, torch.complex64, torch.complex128) for d in orig_in):
            return Precision.PASSTHROUGH, "float64/complex input: left untouched", None
        if node.target in USER_CAST_OPS:
            return self.user_cast(node)
        if torch.float32 not in orig_in:
            if any(d in AMP_FLOATS for d in orig_in):
                return Precision.PASSTHROUGH, "input already 16-bit by the model's own cast: left as written", None
            return Precision.PASSTHROUGH, "no floating-point tensor input: untouched", None

        packet = node.target.overloadpacket
        table = self.ctx.policy.decide(packet)
        if table is None:
            if self.ctx.options.strict:
                raise AmpPolicyError(
                    f"unknown op {_op_name(node)} at node '{node.name}'"
                    f"{' in module ' + repr(modules[-1]) if modules else ''} (strict mode); "
                    "classify it with one of the options low_ops, fp32_ops, promote_ops, "
                    "passthrough_ops, or set strict=False to run it in FP32"
                )
            self.unknown[_op_name(node)] += 1
            table, reason = Precision.FP32, f"{_UNKNOWN}: FP32 by default (classify it with the *_ops options)"
        else:
            reason = why(packet, table, self.ctx.policy)
            if str(packet) in self.notes and table is Precision.FP32:
                reason = f"{reason} ({self.notes[str(packet)]})"

        pin = self.pin(modules)
        if pin and table is not Precision.PASSTHROUGH:
            table, reason = Precision.FP32, pin

        written = mutated_inputs(node)
        if written and any(r.alias_info is not None and r.alias_info.is_write for r in node.target._schema.returns):
            target = self.planned(next(iter(written)))
            wanted = {Precision.LOW: self.low, Precision.FP32: torch.float32}.get(table, target)
            # The write happens in the written tensor's dtype; other floating inputs
            # (a copy_ source, index_put_ values) are cast to it once.
            compute = target if target in AMP_FLOATS else None
            if wanted != target:
                return (
                    Precision.PASSTHROUGH,
                    f"in-place op writes a {dtype_name(target)} tensor: runs in its dtype "
                    f"(policy says {table}; write it out of place to change that)",
                    compute,
                )
            if table is Precision.PASSTHROUGH:
                return table, f"in-place: runs in the dtype of the tensor it writes ({dtype_name(target)})", compute
            return table, f"{reason}; in-place, writes a {dtype_name(target)} tensor", compute

        if table is Precision.LOW:
            return table, f"{reason} ({dtype_name(self.low)})", self.low
        if table is Precision.FP32:
            return table, reason, torch.float32
        if table is Precision.PROMOTE:
            compute = _promoted(inputs)
            return table, f"{reason} ({dtype_name(compute)})", compute
        return table, reason, None

    def user_cast(self, node):
        self.ctx.user_casts.add(node.name)
        if node.target is torch.ops.aten.to.device:
            return Precision.PASSTHROUGH, "device move: keeps the dtype that arrives", None
        target = explicit_dtype(node)
        if target == torch.float32:
            return Precision.FP32, "explicit user cast to fp32: pinned, kept as written", None
        return Precision.PASSTHROUGH, f"explicit user cast to {dtype_name(target)}: kept as written", None

    def plan(self, node, precision, compute, orig):
        if node.op in ("placeholder", "get_attr", "output"):
            return orig
        if node.target is operator.getitem:
            src = self.planned(node.args[0])
            return src[node.args[1]] if isinstance(src, tuple) else src
        if not isinstance(node.target, OpOverload) or node.target.name() in FIXED_OUTPUT_OPS:
            return orig
        inputs = tensor_inputs(node)
        if node.target in (torch.ops.aten.type_as.default, torch.ops.aten.to.other):
            follow = self.planned(node.args[1])
        elif node.target is torch.ops.aten.to.device or (node.target in USER_CAST_OPS and explicit_dtype(node) is None):
            follow = self.planned(node.args[0])
        elif explicit_dtype(node) is not None:
            return orig
        elif precision is Precision.LOW:
            follow = self.low
        elif compute is not None:
            follow = compute
        else:
            follow = _promoted(inputs) if inputs else None
        if follow is None:
            return orig

        def one(d):
            return follow if d == torch.float32 else d

        return tuple(one(d) for d in orig) if isinstance(orig, tuple) else one(orig)


_FP32_MAX = torch.finfo(torch.float32).max
_NUMBER_ARGS = {"number", "Optional[number]", "float", "Optional[float]", "Tensor"}
_FILLS = {
    torch.ops.aten.full.default,
    torch.ops.aten.scalar_tensor.default,
    torch.ops.aten.full_like.default,
    torch.ops.aten.new_full.default,
}


def overflowing_constants(node: torch.fx.Node, dtype: object) -> dict:
    """Finite constants the node computes with that ``dtype`` (16-bit) cannot hold: beyond
    its range, or nonzero but rounding to zero (an ``eps`` of 1e-12 in FP16, whose
    ``log(x.clamp(min=eps))`` would turn into ``log(0)``).

    Python scalars in its arguments by ``schema_args`` slot; an input made
    by ``full``/``scalar_tensor`` with such a value counts too (keyed by the
    input's name, never rewritten: such a node runs in FP32 instead).
    """
    if dtype not in (torch.bfloat16, torch.float16):
        return {}
    out = {}
    for slot, arg, value in schema_args(node):
        if str(arg.type) in _NUMBER_ARGS and _unfit(value, dtype):
            out[slot] = float(value)
        elif isinstance(value, torch.fx.Node) and value.target in _FILLS:
            fill = value.args[0] if value.target is torch.ops.aten.scalar_tensor.default else value.args[1]
            if _unfit(fill, dtype):
                # never rewritten, so never recorded as FP32's extreme: forces FP32
                out[value.name] = float(fill) if abs(fill) < 1 else -torch.finfo(dtype).max
    return out


def _unfit(value: object, dtype: torch.dtype) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return False
    return abs(value) > torch.finfo(dtype).max or (value != 0 and abs(value) <= _TINY[dtype])


# Up to half the smallest subnormal (smallest normal x eps) a value rounds to zero.
_TINY = {d: torch.finfo(d).smallest_normal * torch.finfo(d).eps / 2 for d in (torch.bfloat16, torch.float16)}


def _values(big: dict) -> str:
    return ", ".join(f"{v:.4g}" for v in big.values())


def _op_name(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, OpOverload):
        return str(target)
    if node.op == "call_function":
        return getattr(target, "__name__", str(target))
    return node.op


def tag_precision(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Give every node a precision and a reason under ``node.meta["amp"]``."""
    tagger = _Tagger(ctx)
    modified = False
    for node in gm.graph.nodes:
        old = info(node)
        if old is not None and old.inserted:
            continue
        new = tagger.visit(node)
        if old is not None and old.placed and new.precision is old.precision and new.compute is None:
            new = old  # a re-run keeps the minimum cut's placement (the pipeline is idempotent)
        elif old is not None:
            new.casts = old.casts
        if old != new:
            modified = True
        node.meta[META_KEY] = new
    if tagger.unknown:
        log.warning(
            "graph %d: %d unknown op(s) run in FP32: %s",
            ctx.graph_index,
            sum(tagger.unknown.values()),
            dict(tagger.unknown),
        )
    counts = Counter(
        info(n).precision.value for n in gm.graph.nodes if n.op == "call_function" and not info(n).inserted
    )
    return PassResult(modified, {"precision": dict(counts), "unknown": dict(tagger.unknown)})
