"""On a CUDA device: the probe, what executes in 16 bit, and the generated training step.

Marked ``gpu``; skipped without CUDA. ``tools/gpu_check.sh`` runs them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import MLP, OpRecorder, recording_backend

from amp_compiler import AmpBackend, LossScaler, make_train_step
from amp_compiler.device import native_dtypes, resolve_dtype

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
aten = torch.ops.aten
CUDA = torch.device("cuda")


def test_auto_follows_the_tensor_cores():
    major, _ = torch.cuda.get_device_capability()
    choice, reason = resolve_dtype("auto", CUDA)
    assert choice == ("bf16" if major >= 8 else "fp16" if major == 7 else "fp32")
    assert f"sm_{major}" in reason and native_dtypes(CUDA)[1] in reason


def test_matmuls_execute_in_bf16_on_cuda():
    torch.manual_seed(0)
    model = MLP().to(CUDA)
    x = torch.randn(8, 16, device=CUDA)
    rec = OpRecorder()
    out = torch.compile(model, backend=AmpBackend(dtype="bf16", inner=recording_backend(rec)))(x)
    calls = rec.dtypes_of(aten.mm, aten.addmm)
    assert calls and all(c[:2] == [torch.bfloat16] * 2 for c in calls)
    torch.testing.assert_close(out, model(x), rtol=3e-2, atol=3e-2)


def _lm():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(128, 64), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 128)).to(CUDA)


def test_generated_training_step_on_cuda_one_sync_per_step(monkeypatch):
    model = _lm()
    step = make_train_step(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()),
        dtype="bf16",
        max_grad_norm=1.0,
    )
    ids = torch.randint(0, 128, (8, 32), device=CUDA)
    first = step(ids, ids).loss.item()
    for _ in range(3):
        step(ids, ids)
    calls = []
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: calls.append(1) or original(t))
    monkeypatch.setattr(torch.Tensor, "item", lambda t: pytest.fail(".item() in the hot path"))
    r = step(ids, ids)
    assert len(calls) == 1 and r.stepped and step.fused is not None
    monkeypatch.undo()
    assert r.loss.item() < first
    assert all(p.dtype == torch.float32 and p.is_cuda for p in model.parameters())


def test_fp16_step_skips_on_inf_and_backs_off():
    model = _lm()
    step = make_train_step(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()),
        dtype="fp16",
        scaler=LossScaler("cuda", init_scale=2.0**10),
    )
    ids = torch.randint(0, 128, (8, 32), device=CUDA)
    step(ids, ids)
    before = [p.detach().clone() for p in model.parameters()]
    bad = lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()) * float("inf")  # noqa: E731
    step.loss_fn = bad
    r = step(ids, ids)
    assert r.skipped and step.scaler.get_scale() == 2.0**9
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_cuda_graphs_take_the_parameters_as_static_inputs():
    """Under ``mode="reduce-overhead"`` CUDA graphs copy every non-static input in on each
    replay. amp hands the parameters on as static inputs, as plain torch.compile does: the
    same inputs are recorded as non-static (the token ids, the tangent), and nothing is
    skipped."""
    from torch._dynamo.utils import counters

    def recorded(backend):
        counters.clear()
        torch._dynamo.reset()
        model = _lm()
        ids = torch.randint(0, 128, (8, 32), device=CUDA)
        compiled = torch.compile(model, backend=backend, mode="reduce-overhead")
        for _ in range(3):
            compiled(ids).float().pow(2).mean().backward()
        inductor = counters["inductor"]
        return inductor["cudagraph_recorded_non_static_inputs"], inductor["cudagraph_skips"]

    plain = recorded("inductor")
    ours = recorded(AmpBackend(dtype="bf16"))
    assert ours == plain and ours[1] == 0, (ours, plain)


def test_exact_loss_head_runs_split_bf16_gemms_on_cuda(monkeypatch):
    """Where BF16 GEMMs write FP32 the exact head's GEMMs are split BF16 products (3 BF16 GEMMs
    writing FP32 per FP32 product, forward and backward), the loss within 1e-3 nats of FP64's."""
    from amp_compiler import loss_head

    if "bf16" not in native_dtypes(CUDA)[0]:
        pytest.skip("no BF16 tensor cores")
    assert loss_head.exact.split_native(CUDA)  # probed before the spy counts the head's GEMMs
    calls, mm32 = [], loss_head.exact.mm_fp32_out

    def spy(a, b):
        out = mm32(a, b)
        calls.append((a.dtype, b.dtype, out.dtype))
        return out

    monkeypatch.setattr(loss_head.exact, "mm_fp32_out", spy)
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(512, 256, generator=g) / 2, torch.randn(8192, 256, generator=g) / 2
    t = torch.randint(0, 8192, (512,), generator=g)
    ref = F.cross_entropy(F.linear(h.double(), w.double()), t)
    hc, wc = h.to(CUDA).requires_grad_(), w.to(CUDA).requires_grad_()
    picked, lse = torch.ops.amp.head_stats(hc, wc, None, t.to(CUDA), "", -100, True, False)[:2]
    loss = (lse - picked).mean()
    loss.backward()
    assert len(calls) == 12 and set(calls) == {(torch.bfloat16, torch.bfloat16, torch.float32)}  # one block
    assert abs(loss.item() - ref.item()) < 1e-3


def test_one_pass_head_on_cuda_gives_the_recomputing_heads_gradients():
    """On CUDA the one-pass head's logits are the GEMM's FP32 accumulator (a fresh tensor a
    block): its BF16 head's loss and gradients are the recomputing head's."""
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(3000, 256, generator=g) / 2).bfloat16()
    w = torch.randn(50000, 256, generator=g) / 16
    t = torch.randint(0, 50000, (3000,), generator=g)
    t[::7] = -100
    results = []
    for ahead in ("hw", ""):
        hc, wc = h.to(CUDA).requires_grad_(), w.to(CUDA).requires_grad_()
        picked, lse = torch.ops.amp.head_stats(hc, wc, None, t.to(CUDA), "", -100, False, False, "", ahead, 0.0)[:2]
        valid = t.to(CUDA) != -100
        loss = torch.where(valid, lse - picked, 0.0).sum() / valid.sum()
        loss.backward()
        results.append((loss.item(), hc.grad.float(), wc.grad))
    (loss, dh, dw), (ref, ref_dh, ref_dw) = results
    assert loss == pytest.approx(ref, rel=1e-5)
    for got, want in ((dh, ref_dh), (dw, ref_dw)):
        assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.9999


def test_decoder_export_generates_on_ort_cuda(tmp_path):
    """The BF16 decoder export on ONNX Runtime's CUDA provider (no CPU fallback): greedy
    tokens generated there and compared with PyTorch FP32's."""
    ort = pytest.importorskip("onnxruntime")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu is not installed")
    from helpers import tiny_llama

    from amp_compiler import export_decoder

    report = export_decoder(tiny_llama(seed=0).eval(), str(tmp_path / "d.onnx"), target="cuda", new_tokens=16)
    assert report.parity["method"].startswith("ORT CUDAExecutionProvider")
    assert report.generation["new_tokens"] == 16 and "skipped" not in report.generation
