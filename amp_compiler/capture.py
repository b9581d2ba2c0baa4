"""Lower Dynamo's torch-level graph to a pre-dispatch ATen graph.

Pre-dispatch tracing runs above autograd: the graph holds forward ATen ops
(``aten.linear``, ``aten.softmax``...) and the inner compiler's AOTAutograd
differentiates whatever we hand it. So casts inserted here get matching
backward casts and saved activations are stored in the low dtype. Module
stacks and stack traces are carried over so plans can name modules.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx.traceback as fx_traceback
from torch._guards import TracingContext, detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx


def fake_inputs(example_inputs: Sequence[object]) -> tuple[list, object]:
    """Fakes of the example inputs in the fake mode Dynamo compiles under.

    Dynamo may hand real tensors (parameters, floats lifted to 0-dim tensors,
    everything under ``dynamic=True``); they are fakified with the symbolic
    context Dynamo recorded for them, as AOTAutograd does, so sizes stay the
    symbols Dynamo guards on.
    """
    fake_mode = detect_fake_mode(list(example_inputs))
    if fake_mode is None:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    tracing = TracingContext.try_get()
    out = []
    for x in example_inputs:
        if isinstance(x, FakeTensor) and x.fake_mode is not fake_mode:
            x = fake_mode.from_tensor(x)
        elif isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor):
            context = tracing.tensor_to_context.get(x) if tracing is not None else None
            x = fake_mode.from_tensor(
                x, symbolic_context=context,
                source=context.tensor_source if context is not None else None,
                trace=context is None,
            )
        out.append(x)
    return out, fake_mode


def to_aten(gm: torch.fx.GraphModule, example_inputs: Sequence[object]) -> tuple[torch.fx.GraphModule, object]:
    """Trace ``gm`` to pre-dispatch ATen, keeping node metadata; returns (graph, fake mode)."""

    def run(*args):
        return torch.fx.Interpreter(gm).run(*args)

    inputs, fake_mode = fake_inputs(example_inputs)
    with fx_traceback.preserve_node_meta(), fake_mode:
        aten_gm = make_fx(run, pre_dispatch=True)(*inputs)
    # make_fx names inputs arg0_1...; keep Dynamo's (l_self_modules_fc_parameters_weight_)
    # so plans say which parameter a cast reads.
    theirs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ours = [n for n in aten_gm.graph.nodes if n.op == "placeholder"]
    if len(theirs) == len(ours):
        for mine, source in zip(ours, theirs):
            mine._rename(source.name)
        aten_gm.recompile()
    return aten_gm, fake_mode
