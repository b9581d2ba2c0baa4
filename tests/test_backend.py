"""End to end through torch.compile(backend="amp"): ops executed, numbers, semantics."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import (
    MLP,
    ConvNet,
    OpRecorder,
    TinyLM,
    assert_executed_dtypes,
    assert_near,
    check_against_fp32,
    profiled_gemms,
    recording_backend,
)

import amp_compiler
import amp_compiler.autocast_region
import amp_compiler.backend
import amp_compiler.device
from amp_compiler import AmpBackend, AmpOptionsError

aten = torch.ops.aten


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


GEMMS = (aten.mm, aten.addmm, aten.bmm)


def _vocab_wide(shapes) -> bool:  # TinyLM's head is the only GEMM with a 64-wide operand
    return any(64 in s for s in shapes)


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
            # measured <= 8e-5 off eager's; stats left un-updated are 0.015-0.09 off
            torch.testing.assert_close(b, rb, atol=5e-4, rtol=0)
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
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)  # measured: bitwise equal
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


def test_e2e_inductor_inner_compiles_and_matches(no_caches):
    """The default inner compiler (Inductor) receives the cast graph: the code it generated
    computes in BF16 (a backend that applied nothing would generate FP32 code only)."""
    from torch._inductor.utils import run_and_get_code

    model, x = MLP(), torch.randn(8, 16)
    backend = AmpBackend()
    compiled = torch.compile(model, backend=backend)
    out, code = run_and_get_code(compiled, x)
    assert backend.options.inner == "inductor" and backend.records[0].plan.applied
    assert "bfloat16" in "\n".join(code)
    assert out.dtype == torch.float32
    _, gemms = profiled_gemms(lambda: compiled(x))  # what the generated code ran
    assert gemms == [["bf16", "bf16"]] * 2, gemms
    assert_near(out, model(x), 0.015)  # measured 0.65%


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
        # measured 0.37-0.49%; a BF16 softmax and LayerNorm give the same on this random
        # model (so precision is proven by what executed, elsewhere): the bound holds semantics
        assert_near(compiled(x), model(x), 0.015)
        counts.append(len(backend.records))
    # Dynamo may trace twice on the first call (it retries with floats specialised),
    # but no length after the first compiles again.
    assert counts[0] == counts[1] == counts[2]
    assert backend.plan().summary()["cast_bytes"] is None  # sizes are symbolic


def test_automatic_dynamic_recompile_is_rewritten_too():
    """Without dynamic=, a new shape recompiles (automatically dynamic); every graph is rewritten."""
    model = MLP()
    rec = OpRecorder()
    backend = AmpBackend(inner=recording_backend(rec))
    compiled = torch.compile(model, backend=backend)
    for b in (2, 3, 4):
        x = torch.randn(b, 16)
        assert_near(compiled(x), model(x), 0.015)  # measured 0.27-0.52%
    assert len(backend.records) == 2
    # what executed: both linears of every call in BF16, in both graphs
    assert [d[0] for d in rec.dtypes_of(torch.ops.aten.addmm)] == [torch.bfloat16] * 2 * 3


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
    rec = OpRecorder()
    backend = AmpBackend(inner=recording_backend(rec))
    out = torch.compile(model, backend=backend)(x)
    assert len(backend.records) == 2
    assert [d[0] for d in rec.dtypes_of(torch.ops.aten.addmm)] == [torch.bfloat16] * 4  # 2 a graph
    assert [d[0] for d in rec.dtypes_of(torch.ops.aten._softmax)] == [torch.float32]
    assert_near(out, model(x), 0.005)  # measured 0.06% (outputs of a softmax)


@pytest.mark.parametrize("mode", ["eval", "no_grad", "inference_mode"])
def test_inference_modes(mode):
    model, x = ConvNet(), torch.randn(2, 3, 8, 8)
    model.eval()
    expected = model(x)
    rec = OpRecorder()
    backend = AmpBackend(inner=recording_backend(rec))
    compiled = torch.compile(model, backend=backend)
    ctx = {"eval": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
    with ctx():
        out = compiled(x)
    assert_near(out, expected, 0.015)  # measured 0.38%
    low = rec.dtypes_of(torch.ops.aten.convolution, torch.ops.aten.addmm, torch.ops.aten.mm)
    assert len(low) >= 3 and all(d[0] == torch.bfloat16 for d in low)


def test_tied_weights_cast_once_grads_shared():
    """An embedding tied to the LM head: one parameter, one cast, FP32 grad."""
    model = LMLoss(tied=True)
    assert model.lm.embed.weight is model.lm.lm_head.weight
    rec, backend, _ = check_against_fp32(model, (ids, labels))
    assert model.lm.embed.weight.grad.dtype == torch.float32
    head = [n for n in backend.plan().nodes if n.module == "lm.lm_head"]
    assert head and head[0].precision == "LOW"
    # what ran: the head's GEMMs (an operand of vocabulary width, 64) in BF16, forward and backward
    ran = rec.dtypes_where(GEMMS, _vocab_wide)
    assert len(ran) == 3 and all(d[:2] == [torch.bfloat16] * 2 for d in ran), ran


def test_fp32_modules_pins_lm_head():
    """fp32_modules=[r'lm_head'] keeps that Linear in FP32 with a reason naming the pattern:
    its GEMMs execute in FP32, forward and backward, and every other GEMM in BF16."""
    plan = amp_compiler.explain(TinyLM(), ids, options={"fp32_modules": [r"lm_head$"]})
    head = [n for n in plan.nodes if n.module == "lm_head"]
    assert head and all(n.precision == "FP32" for n in head)
    assert "fp32_modules" in head[0].reason
    others = [n for n in plan.by_op("aten.linear") if n.module != "lm_head"]
    assert others and all(n.precision == "LOW" for n in others)

    rec = OpRecorder()
    backend = AmpBackend(inner=recording_backend(rec), fp32_modules=[r"lm_head$"])
    torch.compile(LMLoss(), backend=backend)(ids, labels).backward()
    pinned = rec.dtypes_where(GEMMS, _vocab_wide)
    assert len(pinned) == 3 and all(d == [torch.float32] * len(d) for d in pinned), pinned
    rest = rec.dtypes_where(GEMMS, lambda shapes: not _vocab_wide(shapes))
    assert len(rest) >= 10 and all(d[:2] == [torch.bfloat16] * 2 for d in rest), rest


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

    rec = OpRecorder()
    torch.compile(DisabledRegion(), backend=AmpBackend(inner=recording_backend(rec)))(torch.randn(4, 8))
    assert rec.dtypes_of(aten.addmm) == [[torch.bfloat16] * 3]  # the Linear
    assert rec.dtypes_of(aten.mm) == [[torch.float32] * 2]  # the product inside the region


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
        "graph0_5_fuse_loss_head.txt",
        "graph0_6_verify_plan.txt",
    ]
    assert "_to_copy" in (tmp_path / "graph0_3_insert_casts.txt").read_text()


def _plan_oracle(x, lin):
    """The plan's program by hand: the linear on BF16-rounded inputs (FP32 accumulation,
    result rounded to BF16), softmax in FP32."""
    h = F.linear(x.bfloat16(), lin.weight.bfloat16(), lin.bias.bfloat16()).float()
    return torch.softmax(h, -1)


@pytest.mark.parametrize("softmax_low", [False, True], ids=["plan", "negative-control-softmax-in-bf16"])
def test_output_matches_the_plans_oracle_and_a_dropped_fp32_softmax_fails(softmax_low):
    """A tolerance that separates a 16-bit run from a broken one: amp's output equals the plan
    computed by hand to 1e-6, while the same model with softmax moved to BF16 (as a dropped
    cast would run it) misses that oracle by more than 1e-4."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 512)
    x = torch.randn(8, 64) * 2
    opts = {"low_ops": ["aten.softmax"]} if softmax_low else {}
    out = torch.compile(
        lambda t: torch.softmax(lin(t), -1), backend=AmpBackend(dtype="bf16", inner="aot_eager", **opts)
    )(x)
    err = (out - _plan_oracle(x, lin)).abs().max().item()
    if softmax_low:
        assert err > 1e-4, err
    else:
        assert err <= 1e-6, err


def test_dynamo_recompile_limit_is_said_in_amps_terms(caplog):
    """Past Dynamo's recompile limit a function runs as written (FP32 for amp): amp says so."""
    model = MLP()
    compiled = torch.compile(model, backend="amp", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=2), caplog.at_level(logging.WARNING, "amp_compiler"):
        for batch in (2, 3, 4):
            compiled(torch.randn(batch, 16))
    said = [r.getMessage() for r in caplog.records if r.name == "amp_compiler" and "recompile limit" in r.getMessage()]
    assert len(said) == 1 and "runs it as written" in said[0] and "FP32, outside the plan" in said[0], said
    assert "'forward'" in said[0] and "(2)" in said[0]
