"""End to end through torch.compile(backend="amp"): ops executed, numbers, semantics."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import MLP, Attention, ConvNet, NormHead, OpRecorder, TinyLM, cosine, grads, recording_backend

import amp_compiler
import amp_compiler.autocast_region
import amp_compiler.backend
import amp_compiler.device
from amp_compiler import AmpBackend, AmpOptionsError

aten = torch.ops.aten
LOW_EXEC = (
    aten.mm,
    aten.bmm,
    aten.addmm,
    aten.baddbmm,
    aten.convolution,
    aten._scaled_dot_product_flash_attention_for_cpu,
)
FP32_EXEC = (
    aten._softmax,
    aten._log_softmax,
    aten.native_layer_norm,
    aten._native_batch_norm_legit,
    aten._native_batch_norm_legit_functional,
    aten.native_batch_norm,
    aten.nll_loss_forward,
    aten.mean,
    aten.exp,
    aten.pow,
    aten.rsqrt,
    aten._softmax_backward_data,
    aten._log_softmax_backward_data,
    aten.native_layer_norm_backward,
)


def train_step(model, inputs, backend, dynamic=None):
    compiled = torch.compile(model, backend=backend, dynamic=dynamic)
    loss = compiled(*inputs)
    loss.backward()
    return loss


def assert_executed_dtypes(rec: OpRecorder, low=torch.bfloat16):
    low_calls = rec.dtypes_of(*LOW_EXEC)
    assert low_calls, "no matmul/conv/attention executed"
    for dtypes in low_calls:
        assert dtypes[:2] == [low, low], dtypes
    fp32_calls = rec.dtypes_of(*FP32_EXEC)
    assert fp32_calls
    for dtypes in fp32_calls:
        assert all(d == torch.float32 for d in dtypes), dtypes


def check_against_fp32(model, inputs, low="bf16", loss_tol=0.02, cos_min=0.99):
    """One training step: amp vs FP32 eager. Returns the recorder and backend."""
    ref = copy.deepcopy(model)
    ref_loss = ref(*inputs)
    ref_loss.backward()
    rec = OpRecorder()
    graphs = []
    backend = AmpBackend(dtype=low, inner=recording_backend(rec, graphs))
    loss = train_step(model, inputs, backend)
    assert loss.dtype == torch.float32
    assert abs(loss.item() - ref_loss.item()) <= loss_tol * abs(ref_loss.item())
    g = grads(model)
    assert g.dtype == torch.float32 and torch.isfinite(g).all()
    assert cosine(g, grads(ref)) >= cos_min
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)
    assert graphs and any(n.meta["amp"].inserted for gm in graphs for n in gm.graph.nodes if "amp" in n.meta)
    return rec, backend, ref


class LMLoss(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.lm = TinyLM(**kw)

    def forward(self, ids, labels):
        return self.lm(ids, labels)


class CNNLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = ConvNet()

    def forward(self, x, y):
        return F.cross_entropy(self.net(x), y)


class MLPLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = MLP()

    def forward(self, x, y):
        return F.mse_loss(self.mlp(x), y)


ids = torch.randint(0, 64, (2, 12))
labels = torch.randint(0, 64, (2, 12))


@pytest.mark.parametrize("sdpa", [False, True], ids=["softmax_attention", "sdpa"])
def test_e2e_transformer_matmuls_bf16_softmax_norms_fp32(sdpa):
    """A transformer LM trains one step: matmuls executed in BF16, softmax/norms/loss in FP32."""
    rec, backend, _ = check_against_fp32(LMLoss(sdpa=sdpa), (ids, labels))
    assert_executed_dtypes(rec)
    plan = backend.plan()
    assert all(n.precision == "FP32" for n in plan.by_op("aten.layer_norm"))
    assert all(n.precision == "LOW" for n in plan.by_op("aten.linear"))
    # on CPU a short SDPA is written out (passes/decompose_attention.py): the same places
    assert not plan.by_op("aten.scaled_dot_product_attention")
    assert plan.by_op("aten.softmax") and all(n.precision == "FP32" for n in plan.by_op("aten.softmax"))
    assert all(n.precision == "LOW" for n in plan.by_op("aten.matmul"))


def test_e2e_cnn_batchnorm_conv_bf16_bn_fp32_running_stats_fp32():
    """Conv runs in BF16, BatchNorm in FP32, running stats stay FP32 and update like eager."""
    model = CNNLoss()
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])
    rec, _, ref = check_against_fp32(model, (x, y))
    assert_executed_dtypes(rec)
    for (name, b), (_, rb) in zip(model.named_buffers(), ref.named_buffers()):
        assert b.dtype == rb.dtype, name
        if b.is_floating_point():
            torch.testing.assert_close(b, rb, atol=0.02, rtol=0.02)
        else:
            assert torch.equal(b, rb), name


def test_e2e_mlp_matches_torch_autocast_where_policies_agree():
    """Linear-ReLU-Linear: same policy as CPU autocast, so the same numbers."""
    model = MLP()
    x = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x).float()
    got = torch.compile(model, backend=AmpBackend(inner="eager"))(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)
    assert (got - model(x)).abs().max() > 0  # it really ran in BF16


def test_e2e_mlp_fp16_path():
    """dtype='fp16': matmuls executed in FP16, loss/grad close to FP32."""
    rec, backend, _ = check_against_fp32(MLPLoss(), (torch.randn(8, 16), torch.randn(8, 4)), low="fp16")
    assert all(d[:2] == [torch.float16] * 2 for d in rec.dtypes_of(aten.addmm, aten.mm))
    assert backend.records[0].dtype == "fp16"


def test_e2e_saved_activations_are_low_precision():
    """Activations autograd saves for backward are stored in BF16, not FP32."""
    model, x = MLP(d=16, hidden=32), torch.randn(8, 16)
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    compiled = torch.compile(model, backend=AmpBackend(inner="aot_eager"))
    compiled(x)  # compile first: tracing runs the hooks on its own tensors
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = compiled(x)
    out.sum().backward()
    assert saved and all(d == torch.bfloat16 for d, _ in saved), saved
    assert (torch.bfloat16, (8, 32)) in saved  # the hidden activation


def test_e2e_inductor_inner_compiles_and_matches():
    """The default inner compiler (Inductor) receives the cast graph and runs it."""
    model, x = MLP(), torch.randn(8, 16)
    backend = AmpBackend()
    out = torch.compile(model, backend=backend)(x)
    assert backend.options.inner == "inductor" and backend.records
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, model(x), atol=0.05, rtol=0.05)


def test_backend_resolves_by_name_in_fresh_interpreter():
    """backend="amp" works without importing amp_compiler (entry point)."""
    code = textwrap.dedent("""
        import sys, torch
        m = torch.nn.Linear(8, 8)
        out = torch.compile(m, backend="amp", options={"inner": "eager"})(torch.randn(2, 8))
        from amp_compiler import amp
        from amp_compiler.device import resolve_dtype
        plan = amp.plan()
        # the default is auto: BF16 where this CPU has it natively, else FP32 (plan not applied)
        auto = resolve_dtype("auto", torch.device("cpu"), loss_scaling=False)[0]
        print(out.dtype, plan.summary()["nodes"]["LOW"], plan.summary()["casts"],
              plan.dtype == auto, plan.graphs[0].applied == (auto == "bf16"))
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["torch.float32", "1", "4", "True", "True"]


def test_backend_options_through_torch_compile():
    """options={...} reach the backend; the named backend records the graph."""
    before = len(amp_compiler.amp.records)
    model = MLP()
    out = torch.compile(model, backend="amp", options={"dtype": "fp16", "inner": "eager"})(torch.randn(2, 16))
    assert out.dtype == torch.float32
    rec = amp_compiler.amp.records[before]
    assert rec.dtype == "fp16" and rec.options.inner == "eager"


@pytest.mark.parametrize(
    "options,match",
    [
        ({"dtyp": "bf16"}, r"unknown option\(s\) \['dtyp'\]; valid options are \[.*'dtype'"),
        ({"dtype": "fp8"}, r"dtype='fp8' is not valid; use one of \('bf16', 'fp16', 'fp32', 'auto'\)"),
        ({"inner": "nope"}, r"inner='nope' is not a torch.compile backend"),
        ({"fp32_ops": ["aten.nothing"]}, r"no ATen op named 'aten.nothing'"),
        ({"fp32_modules": ["("]}, r"fp32_modules pattern '\(' is not a regex"),
        ({"strict": "yes"}, r"strict must be True or False"),
        ({"attention": "flash"}, r"attention='flash' is not valid; use one of \('auto', 'fused', 'explicit'\)"),
    ],
)
def test_options_bad_name_or_value_is_a_clear_error(options, match):
    with pytest.raises(AmpOptionsError, match=match):
        AmpBackend(**options)
    with pytest.raises(Exception, match=match):
        torch.compile(MLP(), backend="amp", options=options)(torch.randn(2, 16))


def test_dynamic_shapes_one_graph_serves_all_lengths():
    """dynamic=True: one rewritten graph serves several sequence lengths."""
    model = TinyLM()
    backend = AmpBackend(inner="aot_eager")
    compiled = torch.compile(model, backend=backend, dynamic=True)
    counts = []
    for t in (5, 9, 13):
        x = torch.randint(0, 64, (2, t))
        torch.testing.assert_close(compiled(x), model(x), atol=0.1, rtol=0.05)
        counts.append(len(backend.records))
    # Dynamo may trace twice on the first call (it retries with floats specialised),
    # but no length after the first compiles again.
    assert counts[0] == counts[1] == counts[2]
    assert backend.plan().summary()["cast_bytes"] is None  # sizes are symbolic


def test_automatic_dynamic_recompile_is_rewritten_too():
    """Without dynamic=, a new shape recompiles (automatically dynamic); every graph is rewritten."""
    model = MLP()
    backend = AmpBackend(inner="eager")
    compiled = torch.compile(model, backend=backend)
    for b in (2, 3, 4):
        x = torch.randn(b, 16)
        torch.testing.assert_close(compiled(x), model(x), atol=0.05, rtol=0.05)
    assert len(backend.records) == 2
    assert all(r.plan.summary()["nodes"]["LOW"] == 2 for r in backend.records)


class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = MLP(16, 32, 16), MLP(16, 32, 4)

    def forward(self, x):
        h = self.a(x)
        torch._dynamo.graph_break()
        return torch.softmax(self.b(h), -1)


def test_graph_breaks_every_graph_rewritten():
    model, x = Broken(), torch.randn(4, 16)
    backend = AmpBackend(inner="aot_eager")
    out = torch.compile(model, backend=backend)(x)
    assert len(backend.records) == 2
    assert [r.plan.summary()["nodes"]["LOW"] for r in backend.records] == [2, 2]
    torch.testing.assert_close(out, model(x), atol=0.02, rtol=0.05)


@pytest.mark.parametrize("mode", ["eval", "no_grad", "inference_mode"])
def test_inference_modes(mode):
    model, x = ConvNet(), torch.randn(2, 3, 8, 8)
    model.eval()
    expected = model(x)
    backend = AmpBackend(inner="aot_eager")
    compiled = torch.compile(model, backend=backend)
    ctx = {"eval": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
    with ctx():
        out = compiled(x)
    torch.testing.assert_close(out, expected, atol=0.05, rtol=0.05)
    assert backend.plan().summary()["nodes"]["LOW"] >= 3


def test_tied_weights_cast_once_grads_shared():
    """An embedding tied to the LM head: one parameter, one cast, FP32 grad."""
    model = LMLoss(tied=True)
    assert model.lm.embed.weight is model.lm.lm_head.weight
    _, backend, _ = check_against_fp32(model, (ids, labels))
    assert model.lm.embed.weight.grad.dtype == torch.float32
    head = [n for n in backend.plan().nodes if n.module == "lm.lm_head"]
    assert head and head[0].precision == "LOW"


def test_fp32_modules_pins_lm_head():
    """fp32_modules=[r'lm_head'] keeps that Linear in FP32 with a reason naming the pattern."""
    plan = amp_compiler.explain(TinyLM(), ids, options={"fp32_modules": [r"lm_head$"]})
    head = [n for n in plan.nodes if n.module == "lm_head"]
    assert head and all(n.precision == "FP32" for n in head)
    assert "fp32_modules" in head[0].reason
    others = [n for n in plan.by_op("aten.linear") if n.module != "lm_head"]
    assert others and all(n.precision == "LOW" for n in others)


class DisabledRegion(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        with torch.autocast("cpu", enabled=False):
            r = h.float() @ x.float().T
        return r


def test_autocast_disabled_region_is_pinned_fp32():
    plan = amp_compiler.explain(DisabledRegion(), torch.randn(4, 8))
    (mm,) = plan.by_op("aten.matmul")
    assert mm.precision == "FP32" and "autocast(enabled=False)" in mm.reason
    assert plan.by_op("aten.linear")[0].precision == "LOW"


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
    import amp_compiler.inductor_passes.recompute_masks as pass_module

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


@pytest.mark.parametrize(
    "around,asked,plan,matmuls",
    [
        (torch.bfloat16, "auto", "bf16", torch.bfloat16),  # amp not told a dtype: autocast's is asked
        (torch.float16, "bf16", "bf16", torch.float16),  # autocast's casts stay: its matmuls FP16
        (torch.bfloat16, "fp32", "fp32", torch.bfloat16),  # FP32 asked: autocast's program as written
    ],
)
@pytest.mark.parametrize("backward_inside", [False, True])
def test_called_under_the_users_autocast_is_a_region_of_the_graph(
    around, asked, plan, matmuls, backward_inside, caplog, monkeypatch
):
    """A training loop that keeps its torch.autocast around the amp-compiled model. Traced
    under the ambient autocast, the pipeline saw autocast's dtypes where the plan had its own and
    refused the graph ('layer_norm computes fp32 but the plan says bf16'). Now the autocast is a
    region of the graph, as one inside the model: its casts stay, amp adds its own."""
    monkeypatch.setattr(amp_compiler.autocast_region, "_warned_autocast", set())
    torch.manual_seed(0)
    model, x, y = NormHead(), torch.randn(8, 32), torch.randint(0, 10, (8,))
    ref = copy.deepcopy(model)
    F.cross_entropy(ref(x), y).backward()
    rec = OpRecorder()
    backend = AmpBackend(dtype=asked, inner=recording_backend(rec))
    with caplog.at_level("WARNING", logger="amp_compiler"):
        with torch.autocast("cpu", dtype=around):
            out = torch.compile(model, backend=backend)(x)
            loss = F.cross_entropy(out, y)
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
    assert backend.records[0].dtype == plan
    assert (plan != "fp32") == backend.records[0].plan.applied
    ran = rec.dtypes_of(aten.addmm, aten.mm)  # forward and backward
    assert ran and all(set(d) == {matmuls} for d in ran), ran
    if plan != "fp32":  # amp's FP32 LayerNorm (CPU autocast alone runs it in BF16)
        assert all(d == [torch.float32] * 3 for d in rec.dtypes_of(aten.native_layer_norm))
    assert torch.isfinite(loss) and cosine(grads(model), grads(ref)) > 0.999
    said = [r.getMessage() for r in caplog.records if "under torch.autocast" in r.getMessage()]
    assert len(said) == 1 and f"amp's plan ({plan})" in said[0], said


def test_called_under_the_users_autocast_through_inductor_trains_like_fp32(no_caches):
    torch.manual_seed(0)
    model, x, y = NormHead(), torch.randn(8, 32), torch.randint(0, 10, (8,))
    ref = copy.deepcopy(model)
    F.cross_entropy(ref(x), y).backward()
    backend = AmpBackend(dtype="auto")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(torch.compile(model, backend=backend)(x), y)
    loss.backward()
    assert backend.records[0].dtype == "bf16" and backend.records[0].plan.applied
    assert "torch.autocast(cpu, bf16) around the call" in backend.records[0].dtype_reason
    assert cosine(grads(model), grads(ref)) > 0.999


class _BiasOfQueryDtype(nn.Module):
    """Builds an attention bias as zeros of the query's dtype, as T5 does for cross-attention."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(16, 16)

    def forward(self, x):
        q = self.q(x).view(2, 4, 2, 8).transpose(1, 2)
        bias = torch.zeros(1, 2, 4, 4, dtype=q.dtype)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=bias).float().pow(2).mean()


def test_a_graph_amp_cannot_plan_under_the_users_autocast_runs_as_autocast_makes_it(caplog):
    """Under autocast Dynamo bakes BF16 into the bias (the query's dtype then); amp's trace sees
    an FP32 query there and cannot plan the graph. It runs as plain torch.compile would under
    that autocast, with a warning, instead of failing the compile."""
    torch.manual_seed(0)
    model, x = _BiasOfQueryDtype(), torch.randn(2, 4, 16)
    ref = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = ref(x)
    expected.backward()
    rec = OpRecorder()
    backend = AmpBackend(inner=recording_backend(rec))
    with caplog.at_level("WARNING", logger="amp_compiler"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.compile(model, backend=backend)(x)
        loss.backward()
    record = backend.records[0]
    assert not record.plan.applied and "amp's plan not applied" in record.dtype_reason
    assert any("could not be planned" in r.getMessage() for r in caplog.records)
    assert all(set(d) == {torch.bfloat16} for d in rec.dtypes_of(aten.addmm, aten.mm))
    assert loss.item() == pytest.approx(expected.item(), rel=1e-2)
    assert cosine(grads(model), grads(ref)) > 0.999


def test_under_the_users_autocast_what_the_user_configured_still_raises():
    """The fallback to autocast's program is for graphs amp cannot trace, not for options: an
    unknown op under strict=True raises as it does without autocast."""
    backend = AmpBackend(dtype="bf16", strict=True, inner="aot_eager")
    fn = torch.compile(lambda x, w: torch.special.bessel_j0(x @ w), backend=backend)
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        pytest.raises(Exception, match="AmpPolicyError: unknown op aten.special_bessel_j0"),
    ):
        fn(torch.randn(4, 8), torch.randn(8, 8))
    assert backend.records == []


def test_slowdown_probe_measures_a_ratio():
    factor = amp_compiler.device.slowdown("bf16", torch.device("cpu"), n=64, reps=3)
    assert factor is not None and factor > 0


def test_integer_inputs_and_float64_buffers_untouched():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("table", torch.randn(4, 4, dtype=torch.float64))

        def forward(self, x, idx):
            return self.fc(x), self.table @ self.table, idx * 2

    m = M()
    x, idx = torch.randn(2, 4), torch.arange(3)
    out = torch.compile(m, backend=AmpBackend(inner="eager"))(x, idx)
    assert [o.dtype for o in out] == [torch.float32, torch.float64, torch.int64]
    torch.testing.assert_close(out[1], m.table @ m.table)


def test_low_precision_outputs_through_compile():
    out = torch.compile(MLP(), backend=AmpBackend(inner="eager", low_precision_outputs=True))(torch.randn(2, 16))
    assert out.dtype == torch.bfloat16


def test_dump_dir_writes_graph_after_each_pass(tmp_path):
    torch.compile(MLP(), backend=AmpBackend(inner="eager", dump_dir=str(tmp_path)))(torch.randn(2, 16))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "graph0_0_decompose_attention.txt",
        "graph0_1_tag_precision.txt",
        "graph0_2_place_flexible.txt",
        "graph0_3_insert_casts.txt",
        "graph0_4_fold_casts.txt",
        "graph0_5_verify_plan.txt",
    ]
    assert "_to_copy" in (tmp_path / "graph0_3_insert_casts.txt").read_text()


@pytest.mark.parametrize("mode", ["train", "eval_no_grad"])
def test_nn_transformer_train_and_fast_path(mode):
    """nn.Transformer: matmuls LOW when training; the fused eval fast path is FP32, not unknown."""
    m = nn.Transformer(
        d_model=32, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=64, dropout=0, batch_first=True
    )
    src, tgt = torch.randn(2, 8, 32), torch.randn(2, 6, 32)
    backend = AmpBackend(inner="aot_eager")
    ctx = torch.enable_grad
    if mode == "eval_no_grad":
        m.eval()
        ctx = torch.no_grad
    with ctx():
        out, ref = torch.compile(m, backend=backend)(src, tgt), m(src, tgt)
    torch.testing.assert_close(out, ref, atol=0.05, rtol=0.05)
    s = backend.plan().summary()
    assert s["unknown_ops"] == {} and s["nodes"]["LOW"] >= 6


class BiasedAttention(nn.Module):
    """Attention with a learned position bias as the SDPA mask (T5, Swin)."""

    def __init__(self, d=16, heads=2, t=6):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.bias = nn.Parameter(torch.randn(heads, t, t) * 0.1)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias).sum()


def test_cpu_sdpa_with_trainable_mask_is_decomposed_so_matmuls_run_bf16():
    """PyTorch's CPU math fallback would upcast to FP32; the decomposed form runs as planned."""
    model, x = BiasedAttention(), torch.randn(2, 6, 16)
    rec, backend, ref = check_against_fp32(model, (x,))
    plan = backend.plan()
    assert not plan.by_op("aten.scaled_dot_product_attention")
    assert [n.precision for n in plan.by_op("aten.matmul")] == ["LOW", "LOW"]
    assert plan.by_op("aten._safe_softmax")[0].precision == "FP32"  # masked: SDPA's zero rows
    assert all(d[:2] == [torch.bfloat16] * 2 for d in rec.dtypes_of(aten.bmm, aten.mm))
    assert model.bias.grad is not None and model.bias.grad.dtype == torch.float32


class NanoGPTAttention(nn.Module):
    """nanoGPT's attention: its output goes through ``.contiguous().view()``, which the trace
    records as a bare view because the fused op's output is laid out for it."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads, self.c_attn, self.c_proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)).square().mean()


def test_written_out_attention_keeps_the_fused_ops_memory_layout():
    """The explicit form is returned in the fused op's layout, so a view the program took of
    the fused output still holds (a compile error on nanoGPT before)."""
    rec, backend, _ = check_against_fp32(NanoGPTAttention(), (torch.randn(2, 8, 32),))
    assert not backend.plan().by_op("aten.scaled_dot_product_attention")
    assert all(d[:2] == [torch.bfloat16] * 2 for d in rec.dtypes_of(aten.bmm))
    assert len(rec.dtypes_of(aten.bmm)) >= 2


def test_trainable_mask_is_written_out_under_attention_fused_too():
    """attention="fused" cannot keep an SDPA whose mask needs a gradient fused: PyTorch would
    run its FP32 math form under a LOW plan."""
    backend = AmpBackend(inner="eager", attention="fused")
    model = BiasedAttention()
    torch.compile(model, backend=backend)(torch.randn(2, 6, 16)).backward()
    record = next(r for r in backend.records[0].passes if r.name == "decompose_attention")
    assert record.detail == {"decomposed": {"trainable_mask": 1}}
    assert model.bias.grad is not None


def test_cpu_sdpa_over_long_sequences_stays_fused():
    """Past SHORT_SCORES the fused kernel is the faster one and stays, planned LOW."""
    from amp_compiler.passes.decompose_attention import SHORT_SCORES

    t = 2048
    assert t * t > SHORT_SCORES
    q = torch.randn(1, 1, t, 4, requires_grad=True)
    backend = AmpBackend(inner="eager")
    f = torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True), backend=backend)
    f(q).sum().backward()
    assert [n.precision for n in backend.plan().by_op("aten.scaled_dot_product_attention")] == ["LOW"]
    assert not backend.plan().by_op("aten.softmax")


class AttentionLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Attention(sdpa=True)

    def forward(self, x):
        return self.block(x).square().mean()


def test_cpu_sdpa_over_short_sequences_runs_as_bf16_matmuls():
    """A short SDPA runs as two BF16 matmuls around an FP32 softmax, not the flash kernel."""
    rec, backend, _ = check_against_fp32(AttentionLoss(), (torch.randn(2, 6, 32),))
    plan = backend.plan()
    assert not plan.by_op("aten.scaled_dot_product_attention")
    assert [n.precision for n in plan.by_op("aten.softmax")] == ["FP32"]
    assert len(rec.dtypes_of(aten.bmm)) >= 2
    assert all(d[:2] == [torch.bfloat16] * 2 for d in rec.dtypes_of(aten.bmm))
    assert not rec.dtypes_of(aten._scaled_dot_product_flash_attention_for_cpu)


def test_attention_explicit_runs_a_long_sdpa_as_bf16_matmuls():
    """attention="explicit" writes out an SDPA that "auto" keeps fused (2048^2 scores): the
    matmuls that execute are BF16 and the flash kernel does not run."""
    rec = OpRecorder()
    backend = AmpBackend(inner=recording_backend(rec), attention="explicit")
    q = torch.randn(1, 1, 2048, 4, requires_grad=True)
    f = torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True), backend=backend)
    f(q).sum().backward()
    assert not backend.plan().by_op("aten.scaled_dot_product_attention")
    assert len(rec.dtypes_of(aten.bmm)) >= 2
    assert all(d[:2] == [torch.bfloat16] * 2 for d in rec.dtypes_of(aten.bmm))
    assert not rec.dtypes_of(aten._scaled_dot_product_flash_attention_for_cpu)
    assert torch.isfinite(q.grad).all()


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
