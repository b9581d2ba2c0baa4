"""Graphs that are not a model's forward: optimizer steps, compiled autograd, parameters held
on the graph, and static inputs as plain torch.compile marks them."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from helpers import (
    MLP,
    OpRecorder,
    TinyLM,
    cosine,
    grads,
    recording_backend,
)

from amp_compiler import AmpBackend

aten = torch.ops.aten


class Literal(nn.Module):
    """A tensor written in forward: make_fx lifts it into a constant of amp's graph."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * torch.tensor([1.0, 2.0, 3.0, 4.0])


def _conv_bn():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2)
    ), torch.randn(2, 3, 8, 8)


def _static_input_indices(compile_and_run) -> tuple[list, list]:
    """(static input indices, input count) AOTAutograd saw for each forward that
    ``compile_and_run(backend)`` compiled: under plain torch.compile, then under amp."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def seen_with(backend_of):
        seen = []

        def forward(gm, example_inputs):
            fw_metadata = torch._guards.TracingContext.get().fw_metadata
            seen.append((list(fw_metadata.static_input_indices), len(example_inputs)))
            return make_boxed_func(gm)

        inner = aot_autograd(fw_compiler=forward, bw_compiler=lambda gm, ex: make_boxed_func(gm))
        torch._dynamo.reset()
        torch.manual_seed(0)
        compile_and_run(backend_of(inner))
        return seen

    return seen_with(lambda inner: inner), seen_with(lambda inner: AmpBackend(dtype="bf16", inner=inner))


@pytest.mark.parametrize("build", [_conv_bn, lambda: (Literal(), torch.randn(2, 4))], ids=["conv-bn", "tensor-literal"])
def test_parameters_reach_the_inner_compiler_as_static_inputs_as_under_plain_compile(build):
    """The graph amp hands on carries Dynamo's input metadata: AOTAutograd marks the same
    inputs static (parameters, buffers) as for plain torch.compile. Without it the
    partitioner prices saving a parameter like an activation and CUDA graphs copy every
    parameter in on each call."""

    def compile_and_run(backend):
        model, x = build()
        torch.compile(model, backend=backend)(x).float().sum().backward()
        assert all(p.grad is not None for p in model.parameters())

    plain, ours = _static_input_indices(compile_and_run)
    n_params = sum(1 for _ in build()[0].parameters())
    assert plain == ours and len(ours) == 1 and len(ours[0][0]) >= n_params, (plain, ours)


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-2),
        lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False),
        lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
    ],
    ids=["sgd-momentum", "adamw", "adam-foreach"],
)
def test_optimizer_step_compiled_with_amp_updates_as_eager(make):
    """Dynamo's graph of an optimizer step reads the parameters and their state off the module
    and updates them in place: amp traces them as inputs (refused by the fake mode before;
    read as constants, the in-place updates were lost) and the step equals eager's."""
    torch.manual_seed(0)
    base = MLP()
    eager, ours = copy.deepcopy(base), copy.deepcopy(base)
    opt_eager, opt_ours = make(eager.parameters()), make(ours.parameters())
    backend = AmpBackend(dtype="bf16", inner="aot_eager")
    step = torch.compile(lambda: opt_ours.step(), backend=backend)
    x = torch.randn(4, 16)
    for _ in range(3):  # the first step creates the state, the later ones update it
        for model, opt in ((eager, opt_eager), (ours, opt_ours)):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
        opt_eager.step()
        step()
    for p, q in zip(eager.parameters(), ours.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6)
    for s, t in zip(opt_eager.state.values(), opt_ours.state.values()):
        for key in s:
            torch.testing.assert_close(t[key], s[key], rtol=1e-6, atol=1e-6)
    assert backend.compiled >= 1 and backend.plan().summary()["nodes"]["LOW"] == 0
    assert all(p.dtype == torch.float32 for p in ours.parameters())


def test_compiled_autograd_backward_graph_goes_on_as_written():
    """Under compiled autograd, amp compiles the backward graph too: it keeps the dtypes the
    forward plan gave (16-bit matmul gradients) and plans nothing again."""
    torch.manual_seed(0)
    base = MLP()
    x = torch.randn(4, 16)
    plain = copy.deepcopy(base)
    torch.compile(plain, backend=AmpBackend(dtype="bf16", inner="aot_eager"))(x).pow(2).mean().backward()

    recorder = OpRecorder()

    def recording(gm, example_inputs):
        def run(*args):
            with recorder:
                return gm(*args)

        return run

    torch._dynamo.reset()
    ours = copy.deepcopy(base)
    forward = torch.compile(ours, backend=AmpBackend(dtype="bf16", inner="aot_eager"))
    backward = AmpBackend(dtype="bf16", inner=recording)
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend=backward)):
        forward(x).pow(2).mean().backward()
    for p, q in zip(plain.parameters(), ours.parameters()):
        assert q.grad.dtype == torch.float32
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)
    assert backward.records and all(
        not r.plan.applied and r.dtype == "bf16" and "compiled autograd" in r.plan.dtype_reason
        for r in backward.records
    )
    matmuls = recorder.dtypes_of(torch.ops.aten.mm)
    assert matmuls and all(dtypes == [torch.bfloat16] * 2 for dtypes in matmuls)


def test_parameters_held_on_the_graph_module_are_planned_and_trained(gradient_flow_runs, caplog):
    """Under Dynamo's install_free_tensors the parameters reach amp as attributes of the graph
    (get_attr), not inputs: they are planned, checked and receive their gradients."""
    ran = gradient_flow_runs
    model = TinyLM()
    eager = copy.deepcopy(model)
    x = torch.randint(0, 64, (2, 16))
    eager(x).float().pow(2).mean().backward()
    recorder = OpRecorder()
    backend = AmpBackend(dtype="bf16", inner=recording_backend(recorder))
    with torch._dynamo.config.patch(install_free_tensors=True), caplog.at_level("WARNING", logger="amp_compiler"):
        torch.compile(model, backend=backend)(x).float().pow(2).mean().backward()
    graph = backend.records[0].graph
    assert graph.graph.find_nodes(op="get_attr")  # the parameters were attributes indeed
    assert len(ran) == 2 and ran[0] == ran[1] and "gradient-flow check skipped" not in caplog.text
    assert all(p.grad is not None for p in model.parameters())
    assert cosine(grads(eager), grads(model)) > 0.9999
    # counted as the model's: the training step's "no graph took the parameters" stays quiet
    assert backend.coverage.with_parameters == 1 and backend.coverage.parameters_outside(model) == []
    assert recorder.dtypes_of(torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm)
    assert all(dt == torch.bfloat16 for dts in recorder.dtypes_of(torch.ops.aten.mm) for dt in dts)


def test_optimizer_step_marks_the_same_inputs_static_as_plain_compile():
    """The parameters and state an optimizer step reads off its module reach AOTAutograd as
    static inputs, as under plain torch.compile (CUDA graphs would copy them in otherwise)."""

    def compile_and_run(backend):
        model = MLP()
        opt = torch.optim.AdamW(model.parameters(), foreach=False)
        model(torch.randn(4, 16)).sum().backward()
        torch.compile(lambda: opt.step(), backend=backend)()

    plain, ours = _static_input_indices(compile_and_run)
    assert plain == ours and ours[0][0], (plain, ours)
