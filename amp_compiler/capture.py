"""Lower Dynamo's torch-level graph to a pre-dispatch ATen graph.

Pre-dispatch tracing runs above autograd: the graph holds forward ATen ops
(``aten.linear``, ``aten.softmax``...) and the inner compiler's AOTAutograd
differentiates whatever we hand it. So casts inserted here get matching
backward casts and saved activations are stored in the low dtype. Module
stacks and stack traces are carried over so plans can name modules.

Higher-order ops are never traced through blindly (``hops.py`` says how each
is treated): a REWRITE body is traced to ATen on its own and kept as a
subgraph, an OPAQUE op is recorded as the node Dynamo gave, bodies untouched.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import (
    disable_proxy_modes_tracing,
    get_proxy_mode,
    make_fx,
    track_tensor_tree,
)

from .fused_layers import DECOMPOSITIONS as FUSED_LAYERS
from .hops import HopKind, outline_vmap_regions, treatment
from .meta import REQUIRES_GRAD
from .upstream.torch_private import FakeTensor, HigherOrderOperator, private, pytree


def fake_inputs(example_inputs: Sequence[object]) -> tuple[list, object]:
    """Fakes of the example inputs in the fake mode Dynamo compiles under.

    Dynamo may hand real tensors (parameters, floats lifted to 0-dim tensors,
    everything under ``dynamic=True``); they are fakified with the symbolic
    context Dynamo recorded for them, as AOTAutograd does, so sizes stay the
    symbols Dynamo guards on.
    """
    fake_mode = private("torch._guards.detect_fake_mode")(list(example_inputs))
    if fake_mode is None:
        fake_mode = private("torch._subclasses.fake_tensor.FakeTensorMode")(allow_non_fake_inputs=True)
    tracing = private("torch._guards.TracingContext").try_get()
    out = []
    for x in example_inputs:
        if isinstance(x, FakeTensor) and x.fake_mode is not fake_mode:
            x = fake_mode.from_tensor(x)
        elif isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor):
            context = tracing.tensor_to_context.get(x) if tracing is not None else None
            x = fake_mode.from_tensor(
                x,
                symbolic_context=context,
                source=context.tensor_source if context is not None else None,
                trace=context is None,
            )
        out.append(x)
    return out, fake_mode


def tensor_attributes(gm: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    """The real tensors ``gm`` reads off its module (get_attr), by target: Dynamo's graph of
    an optimizer step holds the parameters it updates in place, and their state, so; under
    ``install_free_tensors`` a forward holds the parameters so."""
    found = {}
    for node in gm.graph.find_nodes(op="get_attr"):
        value = gm
        for part in node.target.split("."):
            value = getattr(value, part, None)
        if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
            found[node.target] = value
    return found


def held_tensors(*graphs: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    """The tensors the graphs read off their modules, each once (under the first target that
    reads it), in a fixed order."""
    held, seen = {}, set()
    for gm in graphs:
        for target, tensor in tensor_attributes(gm).items():
            if id(tensor) not in seen:
                seen.add(id(tensor))
                held[target] = tensor
    return held


def lift_attributes(gm: torch.fx.GraphModule, held: dict[str, torch.Tensor]) -> torch.fx.GraphModule:
    """A copy of ``gm`` that takes the ``held`` tensors as inputs after its own, in that order,
    in place of reading them off the module (one it does not read becomes an unused input).
    Traced so, an in-place update of one is an op on an input, as AOTAutograd lifts a
    module's parameters and buffers; a fake mode, which refuses real tensors, can run it."""
    reads = tensor_attributes(gm)
    lifted = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    graph = lifted.graph
    last = list(graph.find_nodes(op="placeholder"))[-1:]
    for name, tensor in held.items():
        with graph.inserting_after(last[0]) if last else graph.inserting_before(next(iter(graph.nodes))):
            placeholder = graph.placeholder(name.replace(".", "_"))
        last = [placeholder]
        for target in (target for target, t in reads.items() if t is tensor):
            for node in list(graph.find_nodes(op="get_attr", target=target)):
                node.replace_all_uses_with(placeholder)
                graph.erase_node(node)
    lifted.recompile()
    return lifted


def _restore_attributes(gm: torch.fx.GraphModule, traced: torch.fx.GraphModule, held: dict[str, torch.Tensor]) -> None:
    """Turn the trailing inputs ``lift_attributes`` added for ``gm``'s own ``held`` tensors
    back into get_attr reads of them, held on ``traced`` as ``gm`` held them (parameter,
    buffer or plain attribute)."""
    params, buffers = dict(gm.named_parameters()), dict(gm.named_buffers())
    placeholders = list(traced.graph.find_nodes(op="placeholder"))[-len(held) :]
    for (target, tensor), placeholder in zip(held.items(), placeholders):
        name = target.replace(".", "_")
        if target in params:
            traced.register_parameter(name, tensor)
        elif target in buffers:
            traced.register_buffer(name, tensor)
        else:
            setattr(traced, name, tensor)
        with traced.graph.inserting_before(placeholder):
            read = traced.graph.get_attr(name)
        read.meta = dict(placeholder.meta)
        placeholder.replace_all_uses_with(read)
        traced.graph.erase_node(placeholder)
    traced.recompile()


class _Capture(torch.fx.Interpreter):
    """Runs a Dynamo graph under make_fx, handling higher-order ops by ``hops.treatment``."""

    def call_function(self, target, args, kwargs):
        if not isinstance(target, HigherOrderOperator):
            return super().call_function(target, args, kwargs)
        kind, _ = treatment(target, args[0] if args else None)
        if kind is HopKind.INLINE:
            body, operands = _body_and_operands(target, args)
            return _Capture(body).run(*operands)
        bodies = {}
        if kind is HopKind.REWRITE:
            reenter_make_fx = private("torch._higher_order_ops.utils.reenter_make_fx")
            body, operands = args[0], args[1:]
            flat, _ = pytree.tree_flatten(operands)
            new = reenter_make_fx(lambda *a: _Capture(body).run(*a))(*flat)
            _keep_names(body, new)
            new.meta.update({k: v for k, v in body.meta.items() if k.startswith("_checkpoint")})
            new.meta["amp_rewrite"] = True
            bodies[id(body)] = new
        return _record(target, args, kwargs, bodies)


def _body_and_operands(target, args):
    if target.name() == "invoke_subgraph":  # (subgraph, identifier, *operands)
        return args[0], args[2:]
    return args[0], args[1:]


def _record(target, args, kwargs, bodies):
    """Put ``target(*args, **kwargs)`` into the trace as one node; ``bodies`` swaps subgraphs."""
    mode = get_proxy_mode()
    tracer = mode.tracer
    with disable_proxy_modes_tracing():
        example_out = target(*args, **kwargs)

    def to_proxy(value):
        if isinstance(value, torch.nn.Module):
            value = bodies.get(id(value), value)
            name = tracer.get_fresh_qualname(f"{target.name()}_body")
            tracer.root.register_module(name, value)
            return value
        return tracer.unwrap_proxy(value)

    proxy_args = pytree.tree_map(to_proxy, args)
    proxy_kwargs = pytree.tree_map(to_proxy, kwargs)
    out_proxy = tracer.create_proxy("call_function", target, proxy_args, proxy_kwargs)
    return track_tensor_tree(example_out, out_proxy, constant=None, tracer=tracer)


def _mark_grad_inputs(traced: torch.fx.GraphModule, inputs: Sequence[object]) -> None:
    """Mark each input the backward will want a gradient for (a parameter, under grad mode):
    the fake values make_fx leaves on the placeholders say ``requires_grad=False`` for all."""
    grad = torch.is_grad_enabled()
    for node, x in zip(traced.graph.find_nodes(op="placeholder"), inputs):
        node.meta[REQUIRES_GRAD] = grad and isinstance(x, torch.Tensor) and x.requires_grad


def _keep_names(source: torch.fx.GraphModule, traced: torch.fx.GraphModule) -> None:
    """make_fx names inputs arg0_1...; keep Dynamo's (l_self_modules_fc_parameters_weight_)
    so plans say which parameter a cast reads."""
    theirs = [n for n in source.graph.nodes if n.op == "placeholder"]
    ours = [n for n in traced.graph.nodes if n.op == "placeholder"]
    if len(theirs) == len(ours):
        for mine, src in zip(ours, theirs):
            mine._rename(src.name)
        traced.recompile()


def keep_dynamo_inputs(source: torch.fx.GraphModule, traced: torch.fx.GraphModule) -> None:
    """Carry over what AOTAutograd reads off a Dynamo graph (its compile id, each input's
    source and static mark): without it parameters are not static inputs, so the
    partitioner prices saving them like activations (it saved 16-bit weight copies
    instead) and CUDA graphs copy them in on every call. Left out where the inputs
    do not line up one to one."""
    if "dynamo_compile_id" not in source.meta:
        return
    theirs = list(source.graph.find_nodes(op="placeholder"))
    ours = list(traced.graph.find_nodes(op="placeholder"))
    if len(theirs) != len(ours) or not all(hasattr(n, "_dynamo_source") for n in theirs):
        return
    by_name = getattr(source, "_param_name_to_source", None) or {}
    if any(name not in by_name for name, _ in traced.named_parameters()):
        return
    for name, value in list(traced.named_buffers()):
        if name not in by_name and "." not in name:
            # a constant make_fx lifted (a tensor literal in forward): a plain attribute, as
            # AOTAutograd lifts it from Dynamo's graph, not an input that would need a source
            del traced._buffers[name]
            setattr(traced, name, value)
    owned = [name for name, _ in (*traced.named_parameters(), *traced.named_buffers())]
    if any(name not in by_name for name in owned):
        return
    for mine, src in zip(ours, theirs):
        mine._dynamo_source = src._dynamo_source
        if "tensor_dict" in src.meta:
            mine.meta["tensor_dict"] = src.meta["tensor_dict"]
    traced._param_name_to_source = {name: by_name[name] for name in owned}
    traced.meta["dynamo_compile_id"] = source.meta["dynamo_compile_id"]


def to_aten(gm: torch.fx.GraphModule, example_inputs: Sequence[object]) -> tuple[torch.fx.GraphModule, object, list]:
    """Trace ``gm`` to pre-dispatch ATen, keeping node metadata; returns (graph, fake
    mode, the fake inputs it was traced with)."""

    held = held_tensors(gm)
    outlined = outline_vmap_regions(lift_attributes(gm, held) if held else gm)

    def run(*args):
        return _Capture(outlined).run(*args)

    inputs, fake_mode = fake_inputs(example_inputs)
    held_fakes = [fake_mode.from_tensor(t, static_shapes=True) for t in held.values()]
    # a lazy module writes its code when first read, not at each recompile: AOTAutograd's cache
    # key renames the inputs and back (two recompiles, ~0.15 s of a 12-layer decoder's restart)
    lazy = private("torch.fx._lazy_graph_module._use_lazy_graph_module")(True)
    with lazy, fx_traceback.preserve_node_meta(), fake_mode:
        aten_gm = make_fx(run, pre_dispatch=True, decomposition_table=FUSED_LAYERS)(*inputs, *held_fakes)
    if held:
        _restore_attributes(gm, aten_gm, held)
    # Tracing leaves dead nodes behind (size checks, constants built under vmap
    # that cannot run outside it); nothing reads them.
    aten_gm.graph.eliminate_dead_code()
    _mark_grad_inputs(aten_gm, [*example_inputs, *held.values()])
    _keep_names(gm, aten_gm)
    keep_dynamo_inputs(gm, aten_gm)
    return aten_gm, fake_mode, inputs
