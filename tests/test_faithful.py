"""The rewrite changes numbers, never the program: higher-order ops, in-place writes,
constants that do not fit 16 bit, and gradient flow checked against Dynamo's graph."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import MATMULS, OpRecorder, cosine, grads, recording_backend
from torch.utils.checkpoint import checkpoint

from amp_compiler import AmpBackend
from amp_compiler.passes import AmpVerifyError
from amp_compiler.passes.gradient_flow import check_gradient_flow
from amp_compiler.upstream import torch_minor

aten = torch.ops.aten


class SiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * s * (1 + x * (1 - s))


class Sandwich(nn.Module):
    """Linear -> ``middle`` -> Linear -> loss: ``middle`` is the construct under test."""

    def __init__(self, middle):
        super().__init__()
        self.a, self.b, self.middle = nn.Linear(8, 8), nn.Linear(8, 8), middle

    def forward(self, x):
        return self.b(self.middle(self.a(x))).pow(2).mean()


def CustomFunction():
    return Sandwich(SiLU.apply)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x):
        return x + self.fc(self.norm(x))


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.b1, self.b2 = Block(), Block()

    def forward(self, x):
        h = checkpoint(self.b1, x, use_reentrant=False)
        return checkpoint(self.b2, h, use_reentrant=False).pow(2).mean()


class RotaryCopy(nn.Module):
    """DeepSeek-V3's pattern: a buffer from new_empty (16-bit under the plan) filled by
    copy_ from an FP32 rotary output, and by slice assignment."""

    def __init__(self):
        super().__init__()
        self.q, self.r = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        q = self.q(x)
        buf = q.new_empty(q.shape)
        buf[..., :4] = q[..., :4]
        buf[..., 4:].copy_(torch.cos(self.r(x)))
        return (buf @ buf.transpose(-1, -2)).mean()


class MaskFill(nn.Module):
    """DeBERTa's pattern: masked_fill with finfo(float32).min, Dynamo bakes the number in."""

    def __init__(self, fill=None):
        super().__init__()
        self.q, self.k, self.fill = nn.Linear(8, 8), nn.Linear(8, 8), fill

    def forward(self, x, mask):
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        fill = torch.finfo(scores.dtype).min if self.fill is None else self.fill
        scores = scores.masked_fill(mask, fill)
        return (torch.softmax(scores, -1) @ self.k(x)).pow(2).mean()


def _step(model, inputs, dtype="bf16", inner=None):
    """(amp loss, FP32 loss, amp model, FP32 model, backend, recorder)."""
    ref = copy.deepcopy(model)
    ref_loss = ref(*inputs)
    ref_loss.backward()
    rec = OpRecorder()
    backend = AmpBackend(dtype=dtype, inner=inner or recording_backend(rec))
    loss = torch.compile(model, backend=backend)(*inputs)
    loss.backward()
    return loss, ref_loss, model, ref, backend, rec


@pytest.mark.skipif(
    torch_minor() < (2, 13),
    reason="Dynamo before torch 2.13 cannot trace an autograd.Function with setup_context: it breaks the "
    "graph there, and amp names the break (README, tested range)",
)
def test_custom_function_keeps_gradients_upstream():
    """Parameters before a custom autograd.Function get their gradients (BLOOM's GeLU)."""
    loss, ref_loss, model, ref, backend, rec = _step(CustomFunction(), (torch.randn(4, 8),))
    assert model.a.weight.grad is not None and model.a.bias.grad is not None
    assert cosine(grads(model), grads(ref)) >= 0.99
    hop = [n for n in backend.plan().nodes if n.op == "autograd_function_apply"]
    assert hop and hop[0].precision == "FP32" and "hand-written backward" in hop[0].reason
    assert all(d[:2] == [torch.bfloat16] * 2 for d in rec.dtypes_of(*MATMULS))


class SpectralMix(nn.Module):
    """FNet's token mixing (an FFT over sequence and features, real part), a bilinear resize
    and broadcast_tensors of mixed dtypes: ops the tables name, not unknown ones run in FP32
    with a warning."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.gate = nn.Linear(8, 8), nn.Linear(16, 8), nn.Linear(8, 1)

    def forward(self, x):
        h = torch.fft.fftn(self.a(x), dim=(-2, -1)).real
        h = F.interpolate(h.unsqueeze(1), scale_factor=2, mode="bilinear").squeeze(1)
        # one FP32 and one 16-bit input (Informer's distribution head): one dtype out
        h, g = torch.broadcast_tensors(h, self.gate(x[:, :1]))
        return self.b(h * g).pow(2).mean()


def test_fft_runs_fp32_and_resizing_passes_through():
    loss, ref_loss, model, ref, backend, rec = _step(SpectralMix(), (torch.randn(2, 6, 8),))
    plan = backend.plan()
    assert plan.summary()["unknown_ops"] == {}
    by_op = {n.op: n for n in plan.nodes}
    fft = next(n for op, n in by_op.items() if "fft" in op)
    assert fft.precision == "FP32" and "FFT" in fft.reason
    assert by_op["aten.upsample_bilinear2d.vec"].precision == "PASSTHROUGH"
    assert by_op["aten.broadcast_tensors.default"].precision == "PROMOTE"
    assert rec.dtypes_of(aten.view_as_complex) == [[torch.float32]]  # the FFT reads FP32 numbers
    assert all(d[:2] == [torch.bfloat16] * 2 for d in rec.dtypes_of(*MATMULS))
    assert cosine(grads(model), grads(ref)) >= 0.999
    assert abs(loss.item() - ref_loss.item()) <= 0.02 * abs(ref_loss.item())


class ComplexRotary(nn.Module):
    """Rotary embeddings through complex numbers, as Meta's Llama writes them (polar,
    view_as_complex, a complex product, view_as_real), without a ``.float()`` first: the
    program is FP32, so the 16-bit projection must reach view_as_complex as FP32."""

    def __init__(self):
        super().__init__()
        self.q, self.out = nn.Linear(8, 8), nn.Linear(8, 4)
        self.register_buffer("angles", torch.outer(torch.arange(6.0), 0.5 ** torch.arange(4.0)))

    def forward(self, x):
        turns = torch.polar(torch.ones_like(self.angles), self.angles)
        q = torch.view_as_complex(self.q(x).reshape(*x.shape[:-1], 4, 2))
        return self.out(torch.view_as_real(q * turns).flatten(-2)).square().mean()


def test_complex_rotary_runs_fp32_where_complex_numbers_are_made():
    loss, ref_loss, model, ref, backend, rec = _step(ComplexRotary(), (torch.randn(2, 6, 8),))
    plan = backend.plan()
    assert plan.summary()["unknown_ops"] == {}
    made = [n for n in plan.nodes if n.op.startswith(("aten.view_as_complex", "aten.polar"))]
    assert len(made) == 2 and all(n.precision == "FP32" and "complex" in n.reason for n in made)
    assert rec.dtypes_of(aten.view_as_complex) == [[torch.float32]] * 2
    assert rec.dtypes_of(aten.polar) == [[torch.float32] * 2]
    assert all(d[:2] == [torch.bfloat16] * 2 for d in rec.dtypes_of(*MATMULS))
    assert cosine(grads(model), grads(ref)) >= 0.999
    assert abs(loss.item() - ref_loss.item()) <= 0.02 * abs(ref_loss.item())


class HopRecorder(OpRecorder):
    """OpRecorder that also records higher-order ops (flex_attention) as they execute."""

    supports_higher_order_operators = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not isinstance(func, torch._ops.HigherOrderOperator):
            return super().__torch_dispatch__(func, types, args, kwargs)
        self.record(func, args, kwargs or {})
        return func(*args, **(kwargs or {}))


class Assorted(nn.Module):
    """Ops user code reaches for beside the transformer block: an EmbeddingBag and a
    max_norm embedding (renormalised in forward), reflect padding, isnan/median, a
    bucketize against FP32 boundaries and a small linear solve on a BF16 product."""

    def __init__(self):
        super().__init__()
        self.bag, self.emb = nn.EmbeddingBag(16, 8, mode="mean"), nn.Embedding(16, 8, max_norm=1.0)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("edges", torch.linspace(-1, 1, 5))

    def forward(self, ids, x):
        h = self.a(x) + self.bag(ids)[:, None] + self.emb(ids)
        h = F.pad(h.transpose(1, 2), (1, 1), mode="reflect").transpose(1, 2)[:, 1:-1]
        h = torch.where(torch.isnan(h), 0.0, h) - h.median(-1, keepdim=True).values
        bins = torch.bucketize(torch.tanh(h), self.edges).float() / 4
        gram = self.b(h).transpose(1, 2) @ h + 4 * torch.eye(8)
        sol = torch.linalg.solve(gram, h.transpose(1, 2)).transpose(1, 2)
        return (sol + bins).pow(2).mean()


def test_ops_beside_the_block_are_named_in_the_tables():
    """No unknown op (each would run in FP32 with a warning): the bag's mean and the
    solve run FP32 by their tables, padding and selection pass through, bucketize
    promotes its values to the FP32 boundaries; the step matches FP32."""
    g = torch.Generator().manual_seed(0)
    inputs = (torch.randint(0, 16, (2, 6), generator=g), torch.randn(2, 6, 8, generator=g))
    rec = HopRecorder()  # linalg's error check runs as an effectful higher-order op
    loss, ref_loss, model, ref, backend, _ = _step(Assorted(), inputs, inner=recording_backend(rec))
    plan = backend.plan()
    assert plan.summary()["unknown_ops"] == {}
    by_op = {n.op.split(".")[1]: n for n in plan.nodes if n.op.startswith("aten.")}
    assert by_op["embedding_bag"].precision == "FP32" and "reduction" in by_op["embedding_bag"].reason
    assert "norm" in by_op["embedding_renorm_"].reason  # the in-place op gets its group's reason
    assert by_op["linalg_solve"].precision == "FP32" and "condition number" in by_op["linalg_solve"].reason
    assert by_op["pad"].precision == "PASSTHROUGH"
    assert by_op["median"].precision == "PASSTHROUGH" and by_op["isnan"].precision == "PASSTHROUGH"
    assert by_op["bucketize"].precision == "PROMOTE"
    assert rec.dtypes_of(aten._linalg_solve_ex) and all(
        d[0] == torch.float32 for d in rec.dtypes_of(aten._linalg_solve_ex)
    )
    assert any(d[:2] == [torch.bfloat16] * 2 for d in rec.dtypes_of(*MATMULS))
    assert cosine(grads(model), grads(ref)) >= 0.999
    assert abs(loss.item() - ref_loss.item()) <= 0.02 * abs(ref_loss.item())


class FlexBlock(nn.Module):
    """Attention through flex_attention with a block mask and a score_mod (ALiBi-like)."""

    def __init__(self, d=32, heads=2):
        super().__init__()
        self.norm, self.qkv, self.o, self.heads = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d), heads

    def forward(self, x, block_mask):
        from torch.nn.attention.flex_attention import flex_attention

        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = flex_attention(
            q, k, v, block_mask=block_mask, score_mod=lambda s, b_, h, qi, ki: s - (qi - ki).abs() * 0.01
        )
        return x + self.o(y.transpose(1, 2).reshape(b, t, d))


def test_flex_attention_inference_runs_as_written_in_fp32():
    """flex_attention (a higher-order op with a user score_mod) is an FP32 region: its
    q/k/v arrive FP32 although the projection ran in BF16; the output is FP32's. CPU has
    no flex-attention backward (PyTorch refuses requires_grad inputs), so inference only."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    from torch._higher_order_ops.flex_attention import flex_attention as flex_hop

    torch.manual_seed(0)
    model, x = FlexBlock().eval(), torch.randn(2, 128, 32)
    mask = flex.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 128, 128, device="cpu")
    rec = HopRecorder()
    backend = AmpBackend(inner=recording_backend(rec))
    with torch.no_grad():
        ref = model(x, mask)
        out = torch.compile(model, backend=backend)(x, mask)
    hop = [n for n in backend.plan().nodes if n.op == "flex_attention"]
    assert len(hop) == 1 and hop[0].precision == "FP32"
    assert rec.dtypes_of(flex_hop) and all(set(d) == {torch.float32} for d in rec.dtypes_of(flex_hop))
    projections = rec.dtypes_of(aten.addmm, aten.mm)
    assert len(projections) == 2 and all(d == [torch.bfloat16] * len(d) for d in projections)
    assert out.dtype == torch.float32
    assert ((out - ref).norm() / ref.norm()).item() < 2e-3


def test_custom_function_body_runs_in_fp32_program_dtypes():
    """The Function's forward receives FP32 although the Linear before it ran in BF16."""
    rec = OpRecorder()
    torch.compile(CustomFunction(), backend=AmpBackend(inner=recording_backend(rec)))(torch.randn(4, 8)).backward()
    sigmoid = rec.dtypes_of(aten.sigmoid)
    assert sigmoid and all(d == [torch.float32] for d in sigmoid), sigmoid


def test_checkpoint_body_rewritten_and_recomputed_in_low():
    """A checkpointed block compiles; its matmuls run BF16 in forward and in the recompute."""
    loss, ref_loss, model, ref, backend, rec = _step(Checkpointed(), (torch.randn(4, 8),))
    assert abs(loss.item() - ref_loss.item()) <= 0.02 * abs(ref_loss.item())
    assert cosine(grads(model), grads(ref)) >= 0.99
    mms = rec.dtypes_of(*MATMULS)
    assert mms and all(d[:2] == [torch.bfloat16] * 2 for d in mms), mms
    nodes = backend.plan().nodes
    body = [n for n in nodes if "." in n.name and n.op.startswith("aten.linear")]
    assert len(body) == 2 and all(n.precision == "LOW" for n in body)
    assert all(n.precision == "FP32" for n in nodes if n.op.startswith("aten.layer_norm"))
    assert any(n.op == "tag_activation_checkpoint" for n in nodes)


def test_checkpoint_recompute_in_backward_matches_forward_precision():
    """With a partitioner that honours checkpoint tags, backward recomputes the BF16 matmuls."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    rec = OpRecorder()
    inner = recording_backend(rec, partition_fn=min_cut_rematerialization_partition)
    model = Checkpointed()
    loss = torch.compile(model, backend=AmpBackend(inner=inner))(torch.randn(4, 8))
    forward_mms = len(rec.dtypes_of(*MATMULS))
    loss.backward()
    mms = rec.dtypes_of(*MATMULS)
    assert len(mms) > forward_mms + 4  # the recompute, plus the two grad matmuls per Linear
    assert all(d[:2] == [torch.bfloat16] * 2 for d in mms), mms


def test_inplace_copy_of_other_dtype_computes_in_written_dtype():
    """copy_ / slice assignment of an FP32 value into a BF16 buffer: one cast of the source."""
    loss, ref_loss, model, ref, backend, rec = _step(RotaryCopy(), (torch.randn(4, 8),))
    assert cosine(grads(model), grads(ref)) >= 0.99
    copies = [n for n in backend.plan().nodes if n.op == "aten.copy_.default"]
    assert copies and all(n.compute_dtype == "bf16" and n.dtype == "bf16" for n in copies)
    assert any(n.casts for n in copies)
    written = rec.dtypes_of(aten.copy, aten.slice_scatter)  # the writes, as functionalised
    assert len(written) >= 4 and all(d == [torch.bfloat16] * 2 for d in written), written


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mask_fill_with_fp32_min_stays_finite(dtype):
    """A fully masked row gives FP32's finite answer, not NaN: the fill becomes the low extreme."""
    mask = torch.zeros(4, 4, dtype=torch.bool)
    mask[0] = True  # one row masked out entirely
    loss, ref_loss, model, ref, backend, rec = _step(MaskFill(), (torch.randn(4, 8), mask), dtype)
    assert torch.isfinite(loss) and torch.isfinite(grads(model)).all()
    assert abs(loss.item() - ref_loss.item()) <= 0.03 * abs(ref_loss.item())
    fill = [n for n in backend.plan().nodes if n.op.startswith("aten.masked_fill")]
    assert fill and "extreme" in fill[0].reason
    graph = backend.records[0].graph
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    values = [n.args[2] for n in graph.graph.nodes if n.target is aten.masked_fill.Scalar]
    assert values == [torch.finfo(low).min]
    filled = rec.dtypes_of(aten.masked_fill)
    assert filled and all(d == [low] for d in filled), filled


def test_mask_fill_constant_beyond_fp16_runs_in_fp32():
    """-1e9 is not FP32's extreme, just too big for FP16: the fill runs in FP32 instead."""
    mask = torch.zeros(4, 4, dtype=torch.bool)
    mask[0] = True
    loss, ref_loss, model, _, backend, rec = _step(MaskFill(fill=-1e9), (torch.randn(4, 8), mask), "fp16")
    assert torch.isfinite(loss) and torch.isfinite(grads(model)).all()
    fill = [n for n in backend.plan().nodes if n.op.startswith("aten.masked_fill")]
    assert fill[0].precision == "FP32" and "does not fit fp16" in fill[0].reason
    filled = rec.dtypes_of(aten.masked_fill)
    assert filled and all(d == [torch.float32] for d in filled), filled


class WhereFull(nn.Module):
    """A mask applied with ``where`` and a ``full_like`` of FP32's minimum (an input made by
    a fill, not a scalar argument: the node runs in FP32, never rewritten)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x, mask):
        h = self.a(x)
        h = torch.where(mask, torch.full_like(h, torch.finfo(torch.float32).min), h)
        return torch.softmax(h, -1).square().mean()


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_where_with_a_filled_fp32_minimum_compiles_and_stays_finite(dtype):
    mask = torch.zeros(4, 8, dtype=torch.bool)
    mask[0], mask[1, :4] = True, True
    loss, ref_loss, model, ref, backend, rec = _step(WhereFull(), (torch.randn(4, 8), mask), dtype)
    assert torch.isfinite(loss) and torch.isfinite(grads(model)).all()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=0.02)
    where = [n for n in backend.plan().nodes if n.op.startswith("aten.where")]
    assert where and where[0].precision == "FP32" and "does not fit" in where[0].reason
    ran = rec.dtypes_of(aten.where)
    assert ran and all(d == [torch.float32] * 2 for d in ran), ran


class TinyEps(nn.Module):
    """``log(x.clamp(min=1e-12))`` and ``log(x + 1e-10)`` after a ReLU that outputs zeros:
    in FP16 both constants round to 0 (autocast gives -inf), in FP32 they keep the log finite."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        with torch.no_grad():
            self.a.bias.fill_(-0.5)  # most ReLU outputs are exactly 0, some are not

    def forward(self, x):
        h = torch.relu(self.a(x))
        return torch.log(h.clamp(min=1e-12)).mean() + torch.log(h + 1e-10).mean()


def test_constant_that_rounds_to_zero_in_fp16_runs_in_fp32():
    loss, ref_loss, model, ref, backend, rec = _step(TinyEps(), (torch.randn(4, 8),), "fp16")
    assert torch.isfinite(loss) and loss.item() == pytest.approx(ref_loss.item(), rel=1e-3)
    assert torch.isfinite(grads(model)).all() and cosine(grads(model), grads(ref)) >= 0.999
    eps = [n for n in backend.plan().nodes if n.name in ("clamp", "add")]  # h.clamp, h + 1e-10
    assert len(eps) == 2 and all(n.precision == "FP32" and "rounds to 0 in fp16" in n.reason for n in eps)
    assert rec.dtypes_of(aten.clamp) == [[torch.float32]]
    assert all(d[:2] == [torch.float16] * 2 for d in rec.dtypes_of(*MATMULS))
    with torch.autocast("cpu", dtype=torch.float16):  # what a per-op policy gives
        assert not torch.isfinite(copy.deepcopy(ref)(torch.randn(4, 8)))


def test_constants_that_bf16_holds_stay_where_the_plan_puts_them():
    _, _, _, _, backend, rec = _step(TinyEps(), (torch.randn(4, 8),), "bf16")
    eps = [n for n in backend.plan().nodes if n.name in ("clamp", "add")]
    assert len(eps) == 2 and all(n.precision != "FP32" and "rounds to 0" not in n.reason for n in eps)
    assert rec.dtypes_of(aten.clamp) == [[torch.bfloat16]]  # on the ReLU's BF16 output, as planned


def test_mask_fill_in_bf16_keeps_small_constants():
    """-1e9 fits BF16: nothing is refitted, the fill stays where the plan put it."""
    mask = torch.zeros(4, 4, dtype=torch.bool)
    _, _, _, _, backend, rec = _step(MaskFill(fill=-1e9), (torch.randn(4, 8), mask), "bf16")
    fill = [n for n in backend.plan().nodes if n.op.startswith("aten.masked_fill")]
    assert fill[0].precision == "PASSTHROUGH" and "extreme" not in fill[0].reason
    filled = rec.dtypes_of(aten.masked_fill)
    assert filled and all(d == [torch.bfloat16] for d in filled), filled


def _detached_weight():
    """(a program, its rewrite that detaches the weight's path, a fake mode, fake inputs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def program(x, w):
        return (x @ w).sum()

    def broken(x, w):
        return (x @ w.detach()).sum()

    mode = FakeTensorMode()
    inputs = [mode.from_tensor(torch.randn(2, 3)), mode.from_tensor(torch.randn(3, 3).requires_grad_())]
    return torch.fx.symbolic_trace(program), torch.fx.symbolic_trace(broken), mode, inputs


def test_gradient_flow_check_names_the_input_that_lost_its_gradient():
    """A rewritten graph that detaches a parameter's path raises, naming that input."""
    original, rewritten, mode, inputs = _detached_weight()
    with pytest.raises(AmpVerifyError, match="node 'w'.*none after the amp rewrite"):
        check_gradient_flow(original, rewritten, inputs, mode)
    check_gradient_flow(original, original, inputs, mode)  # the same program passes


def test_gradient_flow_check_is_remembered_beside_inductors_cache(tmp_path, monkeypatch, gradient_flow_runs):
    """A restarted job with a warm cache skips a check its programs passed before; a broken
    rewrite of the same program is checked (and refused) all the same, and never remembered."""
    original, rewritten, mode, inputs = _detached_weight()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    with torch._inductor.config.patch(force_disable_caches=False):
        for _ in range(2):
            check_gradient_flow(original, original, inputs, mode)
        assert len(gradient_flow_runs) == 2  # once (as written, as rewritten), then remembered
        assert len(list((tmp_path / "amp" / "gradient_flow").iterdir())) == 1
        for _ in range(2):
            with pytest.raises(AmpVerifyError, match="node 'w'"):
                check_gradient_flow(original, rewritten, inputs, mode)
        assert len(gradient_flow_runs) == 6
        other = [inputs[0], mode.from_tensor(torch.randn(3, 4).requires_grad_())]  # other sizes: checked
        check_gradient_flow(original, original, other, mode)
        assert len(gradient_flow_runs) == 8


def test_gradient_flow_check_covers_parameters_held_on_the_graph():
    """A parameter the graph reads off its module (get_attr) is a leaf the check follows."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    class Program(nn.Module):
        def __init__(self, w):
            super().__init__()
            self.w = w

        def forward(self, x):
            return (x @ self.w).sum()

    class Broken(Program):
        def forward(self, x):
            return (x @ self.w.detach()).sum()

    w = nn.Parameter(torch.randn(3, 3))
    original, rewritten = torch.fx.symbolic_trace(Program(w)), torch.fx.symbolic_trace(Broken(w))
    assert original.graph.find_nodes(op="get_attr")
    mode = FakeTensorMode()
    inputs = [mode.from_tensor(torch.randn(2, 3))]
    with pytest.raises(AmpVerifyError, match="node 'w'.*none after the amp rewrite"):
        check_gradient_flow(original, rewritten, inputs, mode)
    check_gradient_flow(original, original, inputs, mode)  # the same program passes


class FloatAttribute(nn.Module):
    """A Python float attribute in the arithmetic (Hugging Face rotary's attention_scaling):
    under dynamic shapes Dynamo passes it as a 0-d tensor input and reads it with .item()."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scaling = 0.5

    def forward(self, x):
        return (self.lin(x).cos() * self.scaling).sum()


def test_gradient_flow_is_checked_under_dynamic_shapes(gradient_flow_runs, caplog):
    ran = gradient_flow_runs
    model = FloatAttribute()
    f = torch.compile(model, backend=AmpBackend(dtype="bf16", inner="aot_eager"), dynamic=True)
    with caplog.at_level("WARNING", logger="amp_compiler"):
        f(torch.randn(4, 8)).backward()
    assert "gradient-flow check skipped" not in caplog.text
    assert len(ran) == 2  # the graph as written and as rewritten both ran on the fakes
    assert ran[0] == ran[1] and ran[0][0]  # parameters receive gradients in both
    assert model.lin.weight.grad is not None


def test_unknown_higher_order_op_runs_as_written():
    """torch.cond is no op the backend rewrites: it stays one node, fed FP32, grads intact."""

    branchy = Sandwich(lambda y: torch.cond(y.sum() > 0, lambda t: torch.sin(t), lambda t: torch.cos(t), (y,)))
    loss, ref_loss, model, ref, backend, _ = _step(branchy, (torch.randn(4, 8),), inner="aot_eager")
    assert set(n for n, p in model.named_parameters() if p.grad is not None) == set(
        n for n, p in ref.named_parameters() if p.grad is not None
    )
    assert cosine(grads(model), grads(ref)) >= 0.99
    cond = [n for n in backend.plan().nodes if n.op == "cond"]
    assert cond and cond[0].precision == "FP32" and "as written" in cond[0].reason


def test_vmap_region_is_opaque_and_differentiable():
    """A torch.func.vmap inside the model (associative_scan's way) keeps its gradients."""

    scan = Sandwich(lambda y: torch.func.vmap(lambda r: r * torch.tanh(r))(y))
    loss, ref_loss, model, ref, backend, rec = _step(scan, (torch.randn(4, 8),))
    assert model.a.weight.grad is not None
    assert cosine(grads(model), grads(ref)) >= 0.99
    assert any("vmap region" in n.reason for n in backend.plan().nodes)
    assert all(d[:2] == [torch.bfloat16] * 2 for d in rec.dtypes_of(*MATMULS))


class _Lm(nn.Module):
    """Embedding -> Linear -> head, loss as a dict: the shape of a user's model."""

    def __init__(self, tie=False):
        super().__init__()
        self.emb, self.fc, self.head = nn.Embedding(32, 16), nn.Linear(16, 16), nn.Linear(16, 32)
        if tie:
            self.head.weight = self.emb.weight

    def hidden(self, ids):
        return self.fc(self.emb(ids))

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.hidden(ids)))
        return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def _lm_inputs():
    g = torch.Generator().manual_seed(0)
    return {"ids": torch.randint(0, 32, (2, 6), generator=g), "labels": torch.randint(0, 32, (2, 6), generator=g)}


class _Ema(_Lm):
    """A buffer updated in forward (running statistics written by the model itself)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("ema", torch.zeros(16))

    def hidden(self, ids):
        h = self.fc(self.emb(ids))
        with torch.no_grad():
            self.ema.mul_(0.9).add_(h.mean((0, 1)), alpha=0.1)
        return h + self.ema


def _hooked():
    m = _Lm()
    m.fc.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    m.fc.register_forward_hook(lambda mod, args, out: out - out.mean(-1, keepdim=True))
    return m


def _parametrized():
    m = _Lm()
    nn.utils.parametrizations.weight_norm(m.fc)
    nn.utils.parametrizations.orthogonal(m.head)
    return m


def _spectral():
    """spectral_norm's power iteration writes its vectors in forward (train mode)."""
    m = _Lm()
    nn.utils.parametrizations.spectral_norm(m.fc)
    return m


PATTERNS = {
    "forward_hooks": _hooked,
    "weight_norm_orthogonal": _parametrized,
    "spectral_norm_buffers": _spectral,
    "tied_embedding": lambda: _Lm(tie=True),
    "buffer_updated_in_forward": _Ema,
}


@pytest.mark.parametrize("name", PATTERNS)
def test_user_pattern_one_training_step_is_faithful(name):
    """Hooks, parametrizations, weight tying and buffers written in forward: the same
    program as FP32 eager (gradients, finiteness, cosine vs autocast, no extra graphs)."""
    from differential import one_step

    step = one_step(lambda: (PATTERNS[name](), _lm_inputs()))
    assert step.problems() == [], step.problems()


def test_buffer_written_in_forward_stays_fp32_and_matches_eager():
    """The model's own state is the master copy too: written in its dtype, same value."""
    torch.manual_seed(0)
    model = _Ema()
    ref = copy.deepcopy(model)
    inputs = _lm_inputs()
    ref(**inputs)
    torch.compile(model, backend=AmpBackend(dtype="bf16"))(**inputs)
    assert model.ema.dtype == torch.float32
    assert torch.allclose(model.ema, ref.ema, rtol=2e-2, atol=2e-3)
    assert model.ema.abs().sum() > 0


class TopKMoE(nn.Module):
    """Top-2 routing written by hand: softmax gate, each token's two expert outputs weighted
    and index_add_-ed into an FP32 buffer (torch.zeros_like of the FP32 input). Dense
    dispatch keeps shapes static: a torch.where(mask) per expert inside the loop would make
    Dynamo run the whole forward eagerly."""

    def __init__(self, d=16, experts=4):
        super().__init__()
        self.gate = nn.Linear(d, experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) for _ in range(experts)
        )

    def forward(self, x):
        weights, chosen = self.gate(x).softmax(-1).topk(2, -1)
        weights = weights / weights.sum(-1, keepdim=True)
        every = torch.stack([expert(x) for expert in self.experts])  # experts x tokens x d
        tokens = torch.arange(x.shape[0])
        picked = every[chosen, tokens[:, None]] * weights[..., None]  # tokens x 2 x d
        out = torch.zeros_like(x)
        out.index_add_(0, tokens.repeat_interleave(2), picked.flatten(0, 1))
        return (x + out).pow(2).mean()


def test_moe_index_add_of_16_bit_expert_outputs_into_fp32_buffer():
    """The experts' matmuls run BF16; their weighted outputs meet the FP32 buffer in an
    index_add_ (in-place: written in the buffer's dtype, FP32), so nothing raises a dtype
    mismatch (torch.autocast on CPU does: its BF16 product meets the FP32 buffer) and every
    expert gets its FP32 gradient."""
    torch.manual_seed(0)
    loss, ref_loss, model, ref, backend, rec = _step(TopKMoE(), (torch.randn(12, 16),))
    added = [n for n in backend.plan().nodes if n.op.startswith("aten.index_add")]
    assert added and all("fp32" in n.reason for n in added)
    assert rec.dtypes_of(aten.index_add) == [[torch.float32] * 2]
    assert len([d for d in rec.dtypes_of(*MATMULS) if d[:2] == [torch.bfloat16] * 2]) >= 8
    assert all(p.grad is not None for p in model.parameters())
    assert cosine(grads(model), grads(ref)) >= 0.999
    assert abs(loss.item() - ref_loss.item()) <= 0.02 * abs(ref_loss.item())


def test_tied_weight_receives_both_gradients():
    torch.manual_seed(0)
    model = _Lm(tie=True)
    ref = copy.deepcopy(model)
    ref(**_lm_inputs())["loss"].backward()
    torch.compile(model, backend=AmpBackend(dtype="bf16"))(**_lm_inputs())["loss"].backward()
    assert model.head.weight is model.emb.weight
    assert cosine(model.emb.weight.grad.flatten(), ref.emb.weight.grad.flatten()) >= 0.99
