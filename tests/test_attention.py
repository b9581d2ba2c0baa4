"""Attention: SDPA written out or kept fused, nn.Transformer fast paths, layouts the model relied on."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import (
    Attention,
    OpRecorder,
    check_against_fp32,
    recording_backend,
)

from amp_compiler import AmpBackend

aten = torch.ops.aten


@pytest.mark.parametrize("mode", ["train", "eval_no_grad"])
def test_nn_transformer_train_and_eval(mode):
    """nn.Transformer, training and in eval under no_grad (Dynamo traces the layers' regular
    path, not the fused fast path): every GEMM executed took BF16 operands; the output is FP32
    eager's to 16-bit rounding."""
    m = nn.Transformer(
        d_model=32, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=64, dropout=0, batch_first=True
    )
    src, tgt = torch.randn(2, 8, 32), torch.randn(2, 6, 32)
    rec = OpRecorder()
    backend = AmpBackend(inner=recording_backend(rec))
    ctx = torch.enable_grad
    if mode == "eval_no_grad":
        m.eval()
        ctx = torch.no_grad
    with ctx():
        out, ref = torch.compile(m, backend=backend)(src, tgt), m(src, tgt)
    gemms = rec.dtypes_of(aten.mm, aten.addmm, aten.bmm)
    assert len(gemms) >= 12 and all(d[-2:] == [torch.bfloat16] * 2 for d in gemms), gemms
    # measured: 0.0092 off FP32 eager at outputs up to 3.1 (both modes); FP32 gives 0
    torch.testing.assert_close(out, ref, atol=0.03, rtol=0)
    assert backend.plan().summary()["unknown_ops"] == {}


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
    rec = OpRecorder()
    backend = AmpBackend(inner=recording_backend(rec), attention="fused")
    model = BiasedAttention()
    torch.compile(model, backend=backend)(torch.randn(2, 6, 16)).backward()
    record = next(r for r in backend.records[0].passes if r.name == "decompose_attention")
    assert record.detail == {"decomposed": {"trainable_mask": 1}}
    assert model.bias.grad is not None
    # what ran: no SDPA kernel (whose math form would upcast), the scores' matmuls in BF16
    assert not [op for op, _ in rec.calls if "scaled_dot_product" in str(op)]
    bmm = rec.dtypes_of(aten.bmm)
    assert len(bmm) >= 2 and all(d[:2] == [torch.bfloat16] * 2 for d in bmm), bmm


def test_cpu_sdpa_over_long_sequences_stays_fused():
    """Past SHORT_SCORES the fused kernel is the faster one and stays, planned LOW."""
    from amp_compiler.passes.decompose_attention import SHORT_SCORES

    t = 2048
    assert t * t > SHORT_SCORES
    q = torch.randn(1, 1, t, 4, requires_grad=True)
    rec = OpRecorder()
    backend = AmpBackend(inner=recording_backend(rec))
    f = torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True), backend=backend)
    f(q).sum().backward()
    assert [n.precision for n in backend.plan().by_op("aten.scaled_dot_product_attention")] == ["LOW"]
    assert not backend.plan().by_op("aten.softmax")
    # what ran: the fused kernel, forward and backward, on BF16 operands; no scores materialised
    fused = rec.dtypes_of(aten._scaled_dot_product_flash_attention_for_cpu)
    assert len(fused) == 1 and fused[0][:3] == [torch.bfloat16] * 3, fused
    back = rec.dtypes_of(aten._scaled_dot_product_flash_attention_for_cpu_backward)
    # grad_out, q, k, v, out in BF16; the kernel's own logsumexp stays FP32
    assert back == [[torch.bfloat16] * 5 + [torch.float32]], back
    assert not rec.dtypes_of(aten.bmm, aten._softmax)
    assert torch.isfinite(q.grad).all()


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
