"""Which dtype ``dtype="auto"`` picks, per device, and what the FP32 path hands on."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from helpers import (
    MLP,
    OpRecorder,
    grads,
    recording_backend,
)

import amp_compiler
import amp_compiler.autocast_region
import amp_compiler.backend
import amp_compiler.device
from amp_compiler import AmpBackend

aten = torch.ops.aten


X86 = {"architecture": "x86_64"}


@pytest.mark.parametrize(
    "onednn,flags,native,says",
    [
        ((True, False), {**X86, "avx512_bf16": True}, {"bf16"}, "native BF16"),  # Zen4, Cooper Lake
        ((True, True), {**X86, "amx_bf16": True, "avx512_fp16": True}, {"bf16", "fp16"}, "native BF16"),
        ((True, False), {**X86, "avx512_f": True}, set(), "no BF16 instructions"),  # Skylake-X, Cascade Lake
        ((False, False), {**X86, "avx2": True}, set(), "emulates"),  # Zen3: no AVX-512
        ((False, True), {**X86, "avx512_fp16": True}, {"fp16"}, "native FP16"),
        ((True, False), None, {"bf16"}, "native BF16"),  # not x86 (ARM with BF16): oneDNN decides
    ],
)
def test_cpu_native_dtypes_need_the_instructions_not_only_onednn(onednn, flags, native, says):
    """oneDNN says BF16 for any AVX-512 CPU; without BF16 instructions it computes in FP32
    after converting, no faster than FP32, so auto must not pick it there."""
    found, about = amp_compiler.device.cpu_native(*onednn, flags)
    assert found == native and says in about


def test_auto_dtype_without_bf16_is_fp32_for_the_backend_alone(monkeypatch):
    """Only FP16 native (a V100): the backend alone cannot scale the loss, so auto keeps FP32
    and says how to get FP16 (the training step picks FP16 with loss scaling there)."""
    monkeypatch.setattr(
        amp_compiler.device, "native_dtypes", lambda device: (frozenset({"fp16"}), "fake device without BF16")
    )
    backend = AmpBackend(inner="eager")
    torch.compile(MLP(), backend=backend)(torch.randn(2, 16))
    rec = backend.records[0]
    assert rec.dtype == "fp32" and not rec.plan.applied
    assert "fake device without BF16" in rec.dtype_reason and "loss scaling" in rec.dtype_reason
    assert "GradScaler" in rec.dtype_reason and "make_train_step" in rec.dtype_reason
    backend = AmpBackend(dtype="fp16", inner="eager")  # asked for: done, no warning needed
    torch.compile(MLP(), backend=backend)(torch.randn(2, 16))
    assert backend.records[0].dtype == "fp16"


def test_auto_dtype_picks_bf16_when_supported(monkeypatch):
    monkeypatch.setattr(amp_compiler.device, "native_dtypes", lambda device: (frozenset({"bf16", "fp16"}), "fake BF16"))
    backend = AmpBackend(dtype="auto", inner="eager")
    torch.compile(MLP(), backend=backend)(torch.randn(2, 16))
    assert backend.records[0].dtype == "bf16"
    assert backend.records[0].dtype_reason == "auto: fake BF16"


def test_auto_dtype_is_fp32_without_fast_16_bit_and_hands_the_graph_on(monkeypatch):
    """No native BF16/FP16: Dynamo's graph reaches the inner compiler as it came, nothing
    executes in 16 bit, and the plan that was not applied is recorded with the reason."""
    monkeypatch.setattr(amp_compiler.device, "native_dtypes", lambda device: (frozenset(), "fake CPU emulating 16 bit"))
    seen = []

    def inner(gm, example_inputs):
        seen.append(gm)
        return recording_backend(rec)(gm, example_inputs)

    rec = OpRecorder()
    model = MLP()
    backend = AmpBackend(inner=inner)  # the default: what backend="amp" runs
    assert backend.options.dtype == "auto"
    x = torch.randn(2, 16)
    out = torch.compile(model, backend=backend)(x)
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    rec_ = backend.records[0]
    assert rec_.dtype == "fp32" and "fake CPU emulating 16 bit" in rec_.dtype_reason
    assert seen[0] is rec_.graph and not rec_.plan.applied
    calls = rec.dtypes_of(aten.mm, aten.addmm)
    assert calls and all(d == torch.float32 for call in calls for d in call)
    plan = backend.plan()
    assert plan.by_op("aten.linear")[0].precision == "LOW"  # what BF16 would have done
    assert "run as written" in plan.format_summary()


def test_fp32_path_keeps_inductors_partition_unless_a_budget_is_asked_for(monkeypatch):
    """Under FP32 the inner compiler gets Inductor's own memory budget (1.0, plain
    torch.compile's program); a 16-bit plan gets amp's default, an explicit one always wins."""
    budgets = []

    def inner(name, mode, budget):
        budgets.append(budget)
        return lambda gm, ex: gm.forward

    monkeypatch.setattr(amp_compiler.backend, "inner_compiler", inner)
    for native, options in ((frozenset(), {}), (frozenset({"bf16"}), {}), (frozenset(), {"memory_budget": 0.5})):
        monkeypatch.setattr(amp_compiler.device, "native_dtypes", lambda d, n=native: (n, "fake"))
        torch._dynamo.reset()
        torch.compile(MLP(), backend=AmpBackend(**options))(torch.randn(2, 16))
    assert budgets == [1.0, None, 0.5]


def test_fp32_path_through_inductor_gives_plain_torch_compiles_gradients(monkeypatch, no_caches):
    """Where 16 bit is emulated, ``backend="amp"`` is Inductor FP32 plus amp's code-generation
    passes (here the ReLU mask recomputed in backward): same loss and gradients as plain
    ``torch.compile``, to FP32 rounding. (30 Hugging Face models from tests/fixtures/zoo.py
    agreed the same way in an ad-hoc run.)"""
    monkeypatch.setattr(amp_compiler.device, "native_dtypes", lambda device: (frozenset(), "fake CPU emulating 16 bit"))
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.LayerNorm(16))
    x = torch.randn(2, 12, 16)
    import amp_compiler.passes.inductor.recompute_masks as pass_module

    tagged, run_pass = [], pass_module.recompute_masks

    def counted(graph):
        tagged.append(run_pass(graph))
        return tagged[-1]

    monkeypatch.setattr(pass_module, "recompute_masks", counted)
    runs = []
    for backend in ("inductor", AmpBackend()):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        loss = torch.compile(model, backend=backend)(x).square().mean()
        loss.backward()
        runs.append((loss.item(), grads(model)))
    assert backend.records[0].dtype == "fp32" and not backend.plan().graphs[0].applied
    assert tagged == [1], tagged  # the ReLU's mask, in amp's compile only
    (loss_plain, g_plain), (loss_amp, g_amp) = runs
    assert loss_amp == pytest.approx(loss_plain, rel=1e-6)
    assert torch.allclose(g_amp, g_plain, rtol=1e-4, atol=1e-6)


def test_explicit_bf16_on_an_emulating_device_runs_and_warns_once_with_the_factor(monkeypatch, caplog):
    monkeypatch.setattr(amp_compiler.device, "native_dtypes", lambda device: (frozenset(), "fake CPU emulating 16 bit"))
    monkeypatch.setattr(amp_compiler.device, "_warned", set())
    rec = OpRecorder()
    with caplog.at_level("WARNING", logger="amp_compiler"):
        for _ in range(2):
            torch._dynamo.reset()
            backend = AmpBackend(dtype="bf16", inner=recording_backend(rec))
            torch.compile(MLP(), backend=backend)(torch.randn(2, 16))
    warnings = [r.getMessage() for r in caplog.records if "emulated" in r.getMessage()]
    assert len(warnings) == 1 and "x slower than in FP32" in warnings[0], warnings
    assert backend.records[0].dtype == "bf16" and "emulated" in backend.records[0].dtype_reason
    assert any(call[:2] == [torch.bfloat16] * 2 for call in rec.dtypes_of(aten.addmm, aten.mm))
