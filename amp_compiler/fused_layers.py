"""PyTorch's fused Transformer fast paths, written out as the ops they compute.

In eval mode under ``no_grad``, ``nn.TransformerEncoderLayer`` and
``nn.MultiheadAttention`` call one fused op (``_transformer_encoder_layer_fwd``,
``_native_multi_head_attention``) that does LayerNorm, softmax and every matmul in
its input dtype. The policy cannot split an opaque op, so it ran in FP32: inference
of an ``nn.TransformerEncoder`` then cost what FP32 costs (150 ms against 76 ms
under eager autocast, 4 layers, d=512, 8x128 tokens, 2 cores). Capturing the graph
with these decompositions gives the policy linears, layer norms and a masked
softmax to place like any other (matmuls LOW; norms and softmax FP32).

They follow ATen's CPU implementation (``aten/src/ATen/native/transformers``):
q, k, v projected by one ``qkv_weight``, q scaled by ``1/sqrt(head_dim)``, the
scores through ``_masked_softmax`` with the same mask and mask type (a fully masked
sequence gives NaN, as the fused op does), ``need_weights`` averaging over heads; the
encoder layer's norm-first / norm-after order, residuals, and ReLU or exact GELU.
Nested-tensor inputs (``src_key_padding_mask`` under ``enable_nested_tensor``) are
left to the fused op, which then stays FP32 as before. Tested against the fused ops.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

aten = torch.ops.aten


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    b, t, d = x.shape
    return x.view(b, t, heads, d // heads).transpose(1, 2)


def native_multi_head_attention(
    query,
    key,
    value,
    embed_dim,
    num_head,
    qkv_weight,
    qkv_bias,
    proj_weight,
    proj_bias,
    mask=None,
    need_weights=True,
    average_attn_weights=True,
    mask_type=None,
):
    if query.is_nested or key.is_nested or value.is_nested or query.dim() != 3:
        return NotImplemented
    wq, wk, wv = qkv_weight.chunk(3)
    bq, bk, bv = qkv_bias.chunk(3)
    q = _heads(F.linear(query, wq, bq), num_head) / math.sqrt(embed_dim // num_head)
    k, v = _heads(F.linear(key, wk, bk), num_head), _heads(F.linear(value, wv, bv), num_head)
    scores = q @ k.transpose(-2, -1)
    if mask is not None:
        mask = mask if mask.dtype == torch.bool else mask.to(torch.bool)
        weights = aten._masked_softmax(scores, mask, scores.dim() - 1, mask_type)
    else:
        weights = torch.softmax(scores, -1)
    context = (weights @ v).transpose(1, 2).flatten(2)
    out = F.linear(context, proj_weight, proj_bias)
    if not need_weights:
        return out, query.new_empty(0)
    return out, (weights.mean(1) if average_attn_weights else weights)


def transformer_encoder_layer_fwd(
    src,
    embed_dim,
    num_heads,
    qkv_weight,
    qkv_bias,
    proj_weight,
    proj_bias,
    use_gelu,
    norm_first,
    eps,
    norm_weight_1,
    norm_bias_1,
    norm_weight_2,
    norm_bias_2,
    ffn_weight_1,
    ffn_bias_1,
    ffn_weight_2,
    ffn_bias_2,
    mask=None,
    mask_type=None,
):
    if src.is_nested or src.dim() != 3:
        return NotImplemented

    def norm1(x):
        return F.layer_norm(x, (embed_dim,), norm_weight_1, norm_bias_1, eps)

    def norm2(x):
        return F.layer_norm(x, (embed_dim,), norm_weight_2, norm_bias_2, eps)

    x = norm1(src) if norm_first else src
    x = (
        native_multi_head_attention(
            x, x, x, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask, False, True, mask_type
        )[0]
        + src
    )
    if not norm_first:
        x = norm1(x)
    residual = x
    if norm_first:
        x = norm2(x)
    hidden = F.linear(x, ffn_weight_1, ffn_bias_1)
    hidden = F.gelu(hidden) if use_gelu else F.relu(hidden)
    x = F.linear(hidden, ffn_weight_2, ffn_bias_2) + residual
    return x if norm_first else norm2(x)


DECOMPOSITIONS = {
    aten._native_multi_head_attention.default: native_multi_head_attention,
    aten._transformer_encoder_layer_fwd.default: transformer_encoder_layer_fwd,
}
