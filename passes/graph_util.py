"""Small graph queries the passes share: dtypes, mutations, regions, casts."""

from __future__ import annotations

import contextlib
import operator

import torch

from amp_compiler.meta import META_KEY, REQUIRES_GRAD, NodeInfo
from amp_compiler.upstream.torch_private import HigherOrderOperator, OpOverload, pytree

# The dtypes mixed precision moves between. float64, integers, bool and complex
# are never touched.
AMP_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_WIDTH = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2}

CAST_OP = torch.ops.aten._to_copy.default
USER_CAST_OPS = {
    torch.ops.aten.to.dtype,
    torch.ops.aten.to.dtype_layout,
    torch.ops.aten.to.other,
    torch.ops.aten.to.device,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.type_as.default,
    torch.ops.prims.convert_element_type.default,
}
_REGION_FNS = {"_enter_autocast", "_exit_autocast", "_set_grad_enabled"}


# The 16-bit dtypes; and, in the joint forward+backward graph AOTAutograd traces, its cast
# and its views (_unsafe_view has no alias in its schema, so is_view misses it, yet it
# carries matmul outputs there)
LOW_FLOATS = (torch.bfloat16, torch.float16)
JOINT_CAST = torch.ops.prims.convert_element_type.default
JOINT_VIEWS = {
    torch.ops.aten.view.default,
    torch.ops.aten.expand.default,
    torch.ops.aten.permute.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten.transpose.int,
    torch.ops.aten.t.default,
    torch.ops.aten.unsqueeze.default,
    torch.ops.aten.squeeze.dim,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten._unsafe_view.default,
}


def closure(node: torch.fx.Node, ops) -> list[torch.fx.Node]:
    """``node`` and the nodes reached from it through ``ops`` only."""
    out, todo = [], [node]
    while todo:
        n = todo.pop()
        out.append(n)
        todo.extend(u for u in n.users if u.op == "call_function" and u.target in ops)
    return out


def val_dtype(value: object) -> object:
    """dtype of a meta value: a dtype, a tuple of them, or None."""
    if isinstance(value, torch.Tensor):
        return value.dtype
    if isinstance(value, (tuple, list)):
        return tuple(val_dtype(v) for v in value)
    return None


def node_dtype(node: object) -> object:
    if isinstance(node, torch.fx.Node):
        return val_dtype(node.meta.get("val"))
    return None


def is_tensor_node(node: object) -> bool:
    return isinstance(node, torch.fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)


def tensor_val(node: object) -> torch.Tensor | None:
    """The (fake) tensor a node holds, or None."""
    return node.meta["val"] if is_tensor_node(node) else None


def draws_random(node: torch.fx.Node) -> bool:
    """Whether a node draws random numbers (recomputing it would draw different ones).
    Dropout at p=0 or outside training is an identity (``nn.TransformerEncoderLayer``'s
    default-argument dropout(0.0) calls): no."""
    if node.op != "call_function":
        return False
    name = getattr(getattr(node.target, "overloadpacket", node.target), "__name__", str(node.target))
    if "dropout" in name:
        p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else None)
        train = node.kwargs.get("train", node.args[2] if len(node.args) > 2 else True)
        if p == 0 or train is False:
            return False
    if isinstance(node.target, OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags:
        return True
    return any(k in name for k in ("rand", "philox", "dropout", "bernoulli"))


def tangent_dependent(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """In a joint forward+backward graph: the tangents and every node computed from one."""
    seen = {n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")}
    for n in graph.nodes:
        if n.op == "call_function" and any(a in seen for a in n.all_input_nodes):
            seen.add(n)
    return seen


def from_input(node: torch.fx.Node, which) -> bool:
    """Whether ``node``'s value is computed from a graph input (placeholder) ``which`` accepts."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" and which(n):
            return True
        todo.extend(n.all_input_nodes)
    return False


def needs_grad(node: torch.fx.Node) -> bool:
    """Whether backward will want a gradient for ``node``'s value: it is computed from a graph
    input ``to_aten`` marked as requiring one. A subgraph's inputs carry no mark (a
    checkpointed body, whose forward runs again in backward, counts as needing none)."""
    return from_input(node, lambda n: n.meta.get(REQUIRES_GRAD, False))


def tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Distinct input nodes that hold a single tensor, in argument order."""
    return [n for n in node.all_input_nodes if is_tensor_node(n)]


def schema_args(node: torch.fx.Node):
    """(slot, schema argument, value) for each argument of an ATen op node; ``slot`` is
    the position in ``node.args`` or, when passed by keyword or omitted, the name."""
    target = node.target
    if not isinstance(target, OpOverload):
        return
    for i, arg in enumerate(target._schema.arguments):
        if i < len(node.args):
            yield i, arg, node.args[i]
        else:
            yield arg.name, arg, node.kwargs.get(arg.name)


def set_arg(node: torch.fx.Node, slot: int | str, value: object) -> None:
    """Set the argument a ``schema_args`` slot names."""
    if isinstance(slot, int):
        node.update_arg(slot, value)
    else:
        node.update_kwarg(slot, value)


def mutated_inputs(node: torch.fx.Node) -> set[torch.fx.Node]:
    """Inputs the op writes to (``Tensor(a!)`` in its schema): never cast these."""
    out = set()
    for _, arg, value in schema_args(node):
        if arg.alias_info is not None and arg.alias_info.is_write:
            if isinstance(value, torch.fx.Node):
                out.add(value)
            elif isinstance(value, (list, tuple)):
                out.update(v for v in value if isinstance(v, torch.fx.Node))
    return out


def is_view(node: torch.fx.Node) -> bool:
    """The op returns an alias of an input without writing to it."""
    target = node.target
    if node.op != "call_function":
        return False
    if target is operator.getitem:
        return True
    if not isinstance(target, OpOverload):
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in target._schema.returns)


def volatile_values(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Values that are, or alias, a tensor written in place somewhere in the graph.

    A cast of such a value goes stale when the value is written, so it is never
    shared between consumers.
    """
    roots = {}

    def root(n: torch.fx.Node) -> torch.fx.Node:
        return roots.get(n, n)

    for node in graph.nodes:
        if is_view(node) and node.args and isinstance(node.args[0], torch.fx.Node):
            roots[node] = root(node.args[0])
        elif node.op == "call_function" and mutated_inputs(node):
            roots[node] = root(next(iter(mutated_inputs(node))))
    written = {root(m) for n in graph.nodes if n.op == "call_function" for m in mutated_inputs(n)}
    return {n for n in graph.nodes if root(n) in written}


def region_name(node: torch.fx.Node) -> str | None:
    """'_enter_autocast' etc. when the node switches grad or autocast mode."""
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        if name in _REGION_FNS:
            return name
    return None


def dtype_arg(node: torch.fx.Node) -> tuple[int | str | None, object]:
    """(slot, value) of the op's ``dtype`` argument; (None, None) when it has none."""
    for slot, arg, value in schema_args(node):
        if arg.name == "dtype":
            return slot, value if isinstance(value, torch.dtype) else None
    return None, None


def explicit_dtype(node: torch.fx.Node) -> object:
    """The value of the op's ``dtype`` argument, or None when not given."""
    return dtype_arg(node)[1]


def wanted_dtype(node_info: NodeInfo, src: torch.fx.Node) -> object:
    """The dtype a tagged node needs input ``src`` in: its compute dtype, or at a
    boundary the dtype the FP32 program gave ``src``."""
    if node_info.boundary:
        src_info = src.meta.get(META_KEY)
        return src_info.orig if src_info is not None else val_dtype(src.meta.get("val"))
    return node_info.compute


def widest(dtypes: list[torch.dtype]) -> torch.dtype | None:
    """fp32 beats the 16-bit types; between bf16 and fp16 torch promotes to fp32."""
    floats = {d for d in dtypes if d in AMP_FLOATS}
    if not floats:
        return None
    if len(floats) == 1:
        return floats.pop()
    return torch.float32


def is_inserted_cast(node: torch.fx.Node) -> bool:
    info = node.meta.get(META_KEY)
    return isinstance(info, NodeInfo) and info.inserted


SIZE_QUERIES = frozenset(
    {
        torch.ops.aten.size.default,
        torch.ops.aten.sym_size.int,
        torch.ops.aten.sym_size.default,
        torch.ops.aten.sym_numel.default,
        torch.ops.aten.sym_stride.int,
        torch.ops.aten.sym_stride.default,
        torch.ops.aten.stride.default,
        torch.ops.aten.numel.default,
    }
)


def refresh_vals(gm: torch.fx.GraphModule, fake_mode: object) -> None:
    """Recompute meta['val'] downstream of inserted casts (their dtypes change).

    Only nodes whose inputs changed are re-run, under the graph's fake mode;
    the rest (``.item()`` on a lifted scalar, size queries) keep Dynamo's values.
    """
    changed: set[torch.fx.Node] = set()
    shape_env = getattr(fake_mode, "shape_env", None)
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.autocast("cpu", enabled=False))
        if fake_mode is not None:
            stack.enter_context(fake_mode)
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            fresh = "val" not in node.meta  # a node a pass just created
            if not fresh and not is_inserted_cast(node) and not any(i in changed for i in node.all_input_nodes):
                continue
            if not fresh and isinstance(node.target, HigherOrderOperator):
                continue  # its inputs keep their dtypes at the boundary, so its outputs do too
            if not fresh and node.target in SIZE_QUERIES:
                continue  # a cast changes no size
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: _value(gm, n, fake_mode))
            if fresh or shape_env is None or not _symbolic((args, kwargs)):
                new = node.target(*args, **kwargs)
            else:
                # Re-run for the new dtypes only, on static stand-ins: a cast changes no size, so
                # the sizes stay the traced (symbolic) ones. Under torch < 2.13 a composite op
                # (matmul) run on symbolic fakes read a size as an int and guarded on it: one
                # recompile per sequence length.
                with shape_env.suppress_guards():
                    static = pytree.tree_map(_static, (args, kwargs))
                new = _retyped(node.meta.get("val"), node.target(*static[0], **static[1]))
            if (
                fresh
                or val_dtype(new) != val_dtype(node.meta.get("val"))
                or any(i in changed for i in node.all_input_nodes)
            ):
                changed.add(node)
            node.meta["val"] = new


def _symbolic(tree: object) -> bool:
    return any(
        isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool))
        or (isinstance(x, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in (*x.shape, *x.stride())))
        for x in pytree.tree_leaves(tree)
    )


def _static(x: object) -> object:
    """A fake of ``x``'s dtype with its sizes' current values (no guard: under suppress_guards)."""
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(
            [int(d) for d in x.shape], [int(d) for d in x.stride()], dtype=x.dtype, device=x.device
        )
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(x)](x)
    return x


def _retyped(old: object, new: object) -> object:
    """``old`` (a value with the traced sizes) in ``new``'s dtypes."""
    if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
        return old if old.dtype == new.dtype else old.to(new.dtype)
    if isinstance(old, (list, tuple)) and isinstance(new, (list, tuple)) and len(old) == len(new):
        return type(new)(_retyped(a, b) for a, b in zip(old, new))
    return new


def _value(gm: torch.fx.GraphModule, node: torch.fx.Node, fake_mode: object) -> object:
    """A node's fake value; a subgraph (get_attr) is the module itself, a tensor held on the
    module (an optimizer step's parameters) its fake, as the fake mode takes no real tensor."""
    if node.op == "get_attr":
        value = torch.fx.graph_module._get_attr(gm, node.target)
        if isinstance(value, torch.Tensor) and fake_mode is not None:
            return node.meta["val"] if "val" in node.meta else fake_mode.from_tensor(value, static_shapes=True)
        return value
    return node.meta.get("val")
