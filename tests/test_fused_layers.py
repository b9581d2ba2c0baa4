"""nn.TransformerEncoderLayer / nn.MultiheadAttention fast paths (eval, no_grad) written out
as their ops: oracle = the fused ops themselves, in FP32; then planned in BF16 end to end."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from helpers import OpRecorder, recording_backend

from amp_compiler import AmpBackend
from amp_compiler.fused_layers import native_multi_head_attention, transformer_encoder_layer_fwd

aten = torch.ops.aten


def masks(b, t):
    padding = torch.zeros(b, t, dtype=torch.bool)
    padding[0, -3:] = True  # the first sequence is padded
    causal = torch.ones(t, t, dtype=torch.bool).triu(1)
    return {"none": (None, None), "padding": (None, padding), "causal": (causal, None)}


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("mask", ["none", "padding", "causal"])
def test_encoder_layer_matches_the_fused_op(norm_first, activation, mask):
    """The arguments nn.TransformerEncoderLayer's fast path passes, to both."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, activation=activation, batch_first=True, norm_first=norm_first).eval()
    x = torch.randn(3, 10, 32)
    attn_mask, padding = masks(3, 10)[mask]
    merged, mask_type = layer.self_attn.merge_masks(attn_mask, padding, x)
    a = layer.self_attn
    args = (
        x,
        a.embed_dim,
        a.num_heads,
        a.in_proj_weight,
        a.in_proj_bias,
        a.out_proj.weight,
        a.out_proj.bias,
        activation == "gelu",
        norm_first,
        layer.norm1.eps,
        layer.norm1.weight,
        layer.norm1.bias,
        layer.norm2.weight,
        layer.norm2.bias,
        layer.linear1.weight,
        layer.linear1.bias,
        layer.linear2.weight,
        layer.linear2.bias,
        merged,
        mask_type,
    )
    with torch.no_grad():
        fused = torch._transformer_encoder_layer_fwd(*args)
        ours = transformer_encoder_layer_fwd(*args)
    torch.testing.assert_close(ours, fused, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("need_weights, average", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("mask", ["none", "padding", "causal"])
def test_multi_head_attention_matches_the_fused_op(need_weights, average, mask):
    torch.manual_seed(0)
    a = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    x = torch.randn(3, 10, 32)
    attn_mask, padding = masks(3, 10)[mask]
    merged, mask_type = a.merge_masks(attn_mask, padding, x)
    args = (
        x,
        x,
        x,
        a.embed_dim,
        a.num_heads,
        a.in_proj_weight,
        a.in_proj_bias,
        a.out_proj.weight,
        a.out_proj.bias,
        merged,
        need_weights,
        average,
        mask_type,
    )
    with torch.no_grad():
        fused = torch._native_multi_head_attention(*args)
        ours = native_multi_head_attention(*args)
    torch.testing.assert_close(ours[0], fused[0], rtol=1e-5, atol=1e-5)
    if need_weights:
        torch.testing.assert_close(ours[1], fused[1], rtol=1e-5, atol=1e-6)


def test_a_fully_masked_sequence_gives_what_the_fused_op_gives():
    torch.manual_seed(0)
    a = nn.MultiheadAttention(16, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    padding = torch.zeros(2, 5, dtype=torch.bool)
    padding[1] = True  # every key of the second sequence masked
    merged, mask_type = a.merge_masks(None, padding, x)
    args = (
        x,
        x,
        x,
        16,
        2,
        a.in_proj_weight,
        a.in_proj_bias,
        a.out_proj.weight,
        a.out_proj.bias,
        merged,
        True,
        True,
        mask_type,
    )
    with torch.no_grad():
        fused, ours = torch._native_multi_head_attention(*args), native_multi_head_attention(*args)
    assert torch.isfinite(fused[0][0]).all() and torch.isnan(fused[0][1]).all()  # NaN, as in eager
    torch.testing.assert_close(ours, fused, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_encoder_inference_runs_bf16_matmuls_with_fp32_norms_and_softmax():
    """End to end: eval + no_grad TransformerEncoder planned like any model, not one FP32 op."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 12, 32)
    dynamo_ops = []

    def look(gm, example_inputs):
        dynamo_ops.extend(n.target for n in gm.graph.nodes)
        return gm.forward

    with torch.no_grad():
        torch.compile(model, backend=look)(x)
    assert torch._transformer_encoder_layer_fwd in dynamo_ops  # the fast path is what Dynamo sees
    torch._dynamo.reset()
    rec = OpRecorder()
    backend = AmpBackend(dtype="bf16", inner=recording_backend(rec))
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(x)
        ref = model(x)
    ops = {p for p, _ in rec.calls}
    assert not {aten._transformer_encoder_layer_fwd, aten._native_multi_head_attention} & ops
    matmuls = rec.dtypes_of(aten.mm, aten.addmm, aten.bmm, aten.linear, aten.matmul)
    assert matmuls and all(d and set(d) == {torch.bfloat16} for d in matmuls), matmuls
    norms = rec.dtypes_of(aten.native_layer_norm, aten.layer_norm, aten._masked_softmax, aten._softmax, aten.softmax)
    assert norms and all(d[0] == torch.float32 for d in norms), norms
    torch.testing.assert_close(out, ref, rtol=5e-2, atol=5e-2)
    assert not backend.plan().summary()["unknown_ops"]
