"""The precision policy as data: which ATen ops run in low precision, which in FP32.

Tables are keyed by ``torch.ops.aten.<op>`` overload packets, so every overload of
an op (``add.Tensor``, ``add.Scalar``, ``add_``...) shares one decision. The
vocabulary is fixed: LOW, FP32, PROMOTE, PASSTHROUGH. Ops in no table are
unknown: they run in FP32 and are reported once per graph (or raise in strict
mode).

Where this differs from ``torch.autocast``: CPU autocast lets softmax, layer_norm,
exp, log and sum run in BF16 when their input is BF16. This policy is the
stricter CUDA-style one on every device: softmax, norms, reductions, range-
expanding math and losses always run in FP32.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from amp_compiler.upstream.aten import aten, present

from .upstream.torch_private import OpOverload, OpOverloadPacket


class Precision(str, enum.Enum):
    """What a node computes in."""

    LOW = "LOW"  # the low dtype of the plan (BF16 or FP16)
    FP32 = "FP32"
    PROMOTE = "PROMOTE"  # the widest floating input
    PASSTHROUGH = "PASSTHROUGH"  # whatever dtype arrives, no casts

    def __str__(self) -> str:
        return self.value


class AmpPolicyError(RuntimeError):
    """An op the policy refuses to run in mixed precision."""


# LOW: the ops that carry ~99% of the FLOPs. They accumulate in FP32 inside the
# kernel (tensor cores, oneDNN), so 16-bit inputs cost <0.1% accuracy and halve
# memory traffic. Attention variants are here because their kernels keep the
# softmax statistics in FP32 internally.
LOW_OPS = present(
    {
        aten.mm,
        aten.bmm,
        aten.addmm,
        aten.addbmm,
        aten.baddbmm,
        aten.matmul,
        aten.linear,
        aten.einsum,
        aten.mv,
        aten.addmv,
        aten.addr,
        aten.chain_matmul,
        aten.linalg_multi_dot,
        aten.tensordot,
        aten._addmm_activation,
        aten.bilinear,
        aten.conv1d,
        aten.conv2d,
        aten.conv3d,
        aten.convolution,
        aten._convolution,
        aten.conv_transpose1d,
        aten.conv_transpose2d,
        aten.conv_transpose3d,
        aten.conv_tbc,
        aten.scaled_dot_product_attention,
        aten._scaled_dot_product_flash_attention,
        aten._scaled_dot_product_efficient_attention,
        aten._scaled_dot_product_cudnn_attention,
        aten._scaled_dot_product_flash_attention_for_cpu,
        aten.lstm_cell,
        aten.gru_cell,
        aten.rnn_tanh_cell,
        aten.rnn_relu_cell,
        aten._grouped_mm,
    }
)

# FP32, normalisation and softmax: they sum over a whole row or channel and
# divide by the result; 16-bit sums lose the small terms and the statistics.
_FP32_NORMS = present(
    {
        aten.softmax,
        aten.log_softmax,
        aten._softmax,
        aten._log_softmax,
        aten._masked_softmax,
        aten._safe_softmax,
        aten.layer_norm,
        aten.native_layer_norm,
        aten.group_norm,
        aten.native_group_norm,
        aten.batch_norm,
        aten.native_batch_norm,
        aten._native_batch_norm_legit,
        aten._native_batch_norm_legit_no_training,
        aten._native_batch_norm_legit_functional,
        aten.instance_norm,
        aten.rms_norm,
        aten._fused_rms_norm,
        aten.norm,
        aten.linalg_vector_norm,
        aten.frobenius_norm,
        aten.renorm,
        aten._weight_norm,
        aten._weight_norm_interface,
        aten.linalg_norm,
        aten.linalg_matrix_norm,
        aten.nuclear_norm,
        aten.embedding_renorm,
        aten.batch_norm_stats,
        aten.cdist,
        aten.dist,
        aten.pdist,
        aten.cosine_similarity,
        aten.pairwise_distance,
    }
)
# FP32, reductions: a long 16-bit sum stops growing once the partial sum
# dwarfs each term (BF16 has 8 bits of mantissa). A global average pool is a
# reduction over the whole feature map.
_FP32_REDUCTIONS = present(
    {
        aten.sum,
        aten.mean,
        aten.var,
        aten.std,
        aten.var_mean,
        aten.std_mean,
        aten.prod,
        aten.cumsum,
        aten.cumprod,
        aten.logsumexp,
        aten.logcumsumexp,
        aten.nansum,
        aten.nanmean,
        aten.histc,
        aten.bincount,
        aten.trace,
        aten.quantile,
        aten.nanquantile,
        aten.segment_reduce,
        aten._segment_reduce_backward,
        # a bag's sum or mean over its rows (EmbeddingBag)
        aten.embedding_bag,
        aten._embedding_bag,
        aten._embedding_bag_forward_only,
        aten.adaptive_avg_pool1d,
        aten.adaptive_avg_pool2d,
        aten.adaptive_avg_pool3d,
        aten._adaptive_avg_pool2d,
    }
)
# FP32, range-expanding math: outputs span far more orders of magnitude than
# inputs (exp overflows FP16 above 11), and periodic functions need every bit
# of a large argument (rotary embeddings at position 4096).
_FP32_MATH = present(
    {
        aten.exp,
        aten.exp2,
        aten.expm1,
        aten.log,
        aten.log2,
        aten.log10,
        aten.log1p,
        aten.pow,
        aten.square,
        aten.rsqrt,
        aten.reciprocal,
        aten.erfinv,
        aten.sinh,
        aten.cosh,
        aten.tan,
        aten.acos,
        aten.asin,
        aten.sin,
        aten.cos,
        aten.lgamma,
        aten.digamma,
        aten.polygamma,
        aten.xlogy,
        aten.special_xlog1py,
        aten.logit,
        aten.logaddexp,
        aten.logaddexp2,
        aten.erfc,
        aten.special_erfcx,
        aten.atanh,
        aten.asinh,
        aten.acosh,
        aten.sinc,
        aten.i0,
        aten.special_i0e,
        aten.special_i1,
        aten.special_i1e,
        aten.mvlgamma,
        aten.special_entr,
        # dtype-dependent defaults (posinf -> the dtype's max): as the FP32 program wrote them
        aten.nan_to_num,
        # sampling from probabilities: 16-bit rounding moves them
        aten.multinomial,
    }
)
# FP32, linear algebra beyond matmul: decompositions and solves amplify rounding by
# the condition number, and CPU has no 16-bit kernels for most of them.
_FP32_LINALG = present(
    {
        aten.linalg_svd,
        aten._linalg_svd,
        aten.svd,
        aten.linalg_svdvals,
        aten.linalg_qr,
        aten.linalg_eigh,
        aten._linalg_eigh,
        aten.linalg_eigvalsh,
        aten.linalg_eig,
        aten.linalg_eigvals,
        aten.linalg_inv,
        aten.linalg_inv_ex,
        aten.inverse,
        aten.linalg_solve,
        aten._linalg_solve_ex,
        aten.linalg_solve_triangular,
        aten.triangular_solve,
        aten.linalg_lstsq,
        aten.linalg_pinv,
        aten.linalg_cholesky,
        aten.linalg_cholesky_ex,
        aten.cholesky,
        aten.cholesky_solve,
        aten.cholesky_inverse,
        aten.linalg_det,
        aten._linalg_det,
        aten.det,
        aten.logdet,
        aten.slogdet,
        aten.linalg_slogdet,
        aten._linalg_slogdet,
        aten.linalg_matrix_exp,
        aten.matrix_exp,
        aten.linalg_lu,
        aten.linalg_lu_factor,
        aten.linalg_lu_factor_ex,
        aten.linalg_lu_solve,
        aten.lu_solve,
        aten.linalg_matrix_power,
        aten.matrix_power,
        aten.linalg_matrix_rank,
        aten.linalg_cond,
    }
)
# FP32, losses: the scalar the whole backward pass starts from; log-sigmoid is
# the DPO/KTO loss.
_FP32_LOSSES = present(
    {
        aten.cross_entropy_loss,
        aten.nll_loss,
        aten.nll_loss2d,
        aten.nll_loss_nd,
        aten.mse_loss,
        aten.l1_loss,
        aten.smooth_l1_loss,
        aten.huber_loss,
        aten.kl_div,
        aten.binary_cross_entropy_with_logits,
        aten.soft_margin_loss,
        aten.multilabel_margin_loss,
        aten.multi_margin_loss,
        aten.margin_ranking_loss,
        aten.hinge_embedding_loss,
        aten.poisson_nll_loss,
        aten.cosine_embedding_loss,
        aten.triplet_margin_loss,
        aten.ctc_loss,
        aten.log_sigmoid,
        aten.log_sigmoid_forward,
    }
)
# FP32, spectral transforms: every output sums the whole signal, and no 16-bit
# FFT exists on CPU (on CUDA half only, at power-of-two sizes). FNet mixes its
# tokens with one; Autoformer finds periods with another.
_FP32_SPECTRAL = present(
    {
        aten.fft_fft,
        aten.fft_ifft,
        aten.fft_fft2,
        aten.fft_ifft2,
        aten.fft_fftn,
        aten.fft_ifftn,
        aten.fft_rfft,
        aten.fft_irfft,
        aten.fft_rfft2,
        aten.fft_irfft2,
        aten.fft_rfftn,
        aten.fft_irfftn,
        aten.fft_hfft,
        aten.fft_ihfft,
        aten._fft_r2c,
        aten._fft_c2r,
        aten._fft_c2c,
        aten.stft,
        aten.istft,
    }
)
# FP32, complex numbers built from real ones: BF16 has no complex type (complex32
# pairs FP16 halves, with few kernels), and rotary embeddings written with
# view_as_complex (Meta's Llama) turn by angles that need every bit at large positions.
_FP32_COMPLEX = present({aten.view_as_complex, aten.polar, aten.complex})
# FP32, fused layers: nn.TransformerEncoderLayer / nn.MultiheadAttention fast
# paths (eval + no_grad) compute LayerNorm and softmax inside in their input
# dtype. Capture writes them out (amp_compiler/fused_layers.py); the op itself
# is left only for nested-tensor inputs, and the policy cannot split it: FP32.
_FP32_FUSED = present({aten._transformer_encoder_layer_fwd, aten._native_multi_head_attention})
FP32_OPS = frozenset(
    _FP32_NORMS
    | _FP32_REDUCTIONS
    | _FP32_MATH
    | _FP32_LOSSES
    | _FP32_SPECTRAL
    | _FP32_LINALG
    | _FP32_COMPLEX
    | _FP32_FUSED
)

# PROMOTE: multi-input ops that must see one dtype; they take the widest
# floating input. Residual adds are here on purpose: `x + f(x)` with an FP32
# residual stream and a BF16 branch stays FP32, so the stream that carries the
# model's state through every layer never rounds to 8 bits.
PROMOTE_OPS = present(
    {
        aten.add,
        aten.sub,
        aten.rsub,
        aten.mul,
        aten.div,
        aten.true_divide,
        aten.multiply,
        aten.subtract,
        aten.divide,
        # one output per input, each in its input's dtype: one dtype for all keeps the plan exact
        aten.broadcast_tensors,
        aten.maximum,
        aten.minimum,
        aten.fmax,
        aten.fmin,
        aten.atan2,
        aten.copysign,
        aten.addcmul,
        aten.addcdiv,
        aten.lerp,
        aten.where,
        aten.dot,
        aten.vdot,
        aten.outer,
        aten.cat,
        aten.concat,
        aten.concatenate,
        aten.stack,
        aten.hstack,
        aten.vstack,
        aten.index_put,
        aten.scatter,
        aten.scatter_add,
        aten.index_add,
        aten.index_copy,
        aten.scatter_reduce,
        aten.index_reduce,
        aten.put,
        aten.masked_scatter,
        aten.grid_sampler,
        aten.grid_sampler_2d,
        aten.grid_sampler_3d,
        aten.heaviside,
        aten.prelu,
        aten._prelu_kernel,
        aten.remainder,
        aten.fmod,
        aten.floor_divide,
        aten.hypot,
        aten.cross,
        aten.linalg_cross,
        aten.kron,
        aten.block_diag,
        aten.meshgrid,
        aten.cartesian_prod,
        # the sorted boundaries and the values must share a dtype
        aten.searchsorted,
        aten.bucketize,
        # functional forms of in-place writes (export functionalizes copy_ and slice assignment)
        aten.copy,
        aten.slice_scatter,
        aten.select_scatter,
        aten.diagonal_scatter,
        aten.as_strided_scatter,
    }
)

# PASSTHROUGH: ops that are exact or bounded in any dtype, so they run in the
# dtype that arrives and never cost a cast. Views, shape and data movement,
# comparisons and selection are exact. Activations are here too: pointwise with
# output no larger than input, so a Linear -> GELU -> Linear chain stays 16-bit
# end to end (kernels compute them in FP32 registers anyway).
# ATen's resizing ops (ONNX's Resize, for the export's kernel table too)
RESIZE_OPS = present(
    {
        aten.upsample_nearest1d,
        aten.upsample_nearest2d,
        aten.upsample_nearest3d,
        aten._upsample_nearest_exact1d,
        aten._upsample_nearest_exact2d,
        aten._upsample_nearest_exact3d,
        aten.upsample_linear1d,
        aten.upsample_bilinear2d,
        aten.upsample_bicubic2d,
        aten.upsample_trilinear3d,
        aten._upsample_bilinear2d_aa,
        aten._upsample_bicubic2d_aa,
    }
)

PASSTHROUGH_OPS = present(
    {
        # views and shape
        aten.view,
        aten.reshape,
        aten._unsafe_view,
        aten.permute,
        aten.transpose,
        aten.t,
        aten.expand,
        aten.expand_as,
        aten.squeeze,
        aten.unsqueeze,
        aten.flatten,
        aten.unflatten,
        aten.slice,
        aten.select,
        aten.narrow,
        aten.split,
        aten.split_with_sizes,
        aten.chunk,
        aten.unbind,
        aten.alias,
        aten.numpy_T,
        aten.movedim,
        aten.unfold,
        aten.as_strided,
        aten.view_as,
        aten.reshape_as,
        aten.broadcast_to,
        aten.swapaxes,
        aten.diagonal,
        aten.rot90,
        aten.diag,
        aten.diag_embed,
        aten.view_copy,
        aten.permute_copy,
        aten.transpose_copy,
        aten.t_copy,
        aten.expand_copy,
        aten.squeeze_copy,
        aten.unsqueeze_copy,
        aten.slice_copy,
        aten.select_copy,
        aten.split_copy,
        aten.split_with_sizes_copy,
        aten.unbind_copy,
        aten.narrow_copy,
        aten.alias_copy,
        aten.as_strided_copy,
        aten.diagonal_copy,
        aten.unfold_copy,
        aten.resolve_conj,
        aten.resolve_neg,
        aten.conj,
        # data movement and construction
        aten.contiguous,
        aten.clone,
        aten.detach,
        aten.detach_,
        aten.lift_fresh_copy,
        aten.lift_fresh,
        aten.repeat,
        aten.repeat_interleave,
        aten.tile,
        aten.roll,
        aten.flip,
        aten.tril,
        aten.triu,
        aten.pad,
        aten.constant_pad_nd,
        aten.index_select,
        aten.im2col,
        aten.col2im,
        aten.take_along_dim,
        aten.index_fill,
        aten.pixel_unshuffle,
        aten.reflection_pad1d,
        aten.reflection_pad2d,
        aten.reflection_pad3d,
        aten.replication_pad1d,
        aten.replication_pad2d,
        aten.replication_pad3d,
        aten._pad_circular,
        aten.combinations,
        aten.empty_strided,
        aten.new_empty_strided,
        aten.gather,
        aten.embedding,
        aten.masked_fill,
        aten.masked_select,
        aten.index,
        aten._unsafe_index,
        aten.take,
        aten.pixel_shuffle,
        aten.channel_shuffle,
        aten.zeros_like,
        aten.ones_like,
        aten.empty_like,
        aten.full_like,
        aten.rand_like,
        aten.randn_like,
        aten.new_zeros,
        aten.new_ones,
        aten.new_empty,
        aten.new_full,
        aten.zeros,
        aten.ones,
        aten.full,
        aten.empty,
        aten.arange,
        aten.scalar_tensor,
        aten.one_hot,
        aten.fill,
        aten.copy_,
        aten.fill_,
        aten.zero_,
        aten.item,
        aten._local_scalar_dense,
        aten.sym_size,
        aten._assert_tensor_metadata,
        aten._assert_async,
        aten._assert_scalar,
        # dropout: a mask and a scale
        aten.dropout,
        aten.native_dropout,
        aten.feature_dropout,
        aten.alpha_dropout,
        aten.bernoulli,
        # activations and bounded pointwise math
        aten.relu,
        aten.gelu,
        aten.silu,
        aten.sigmoid,
        aten.tanh,
        aten.leaky_relu,
        aten.elu,
        aten.selu,
        aten.celu,
        aten.mish,
        aten.softplus,
        aten.hardtanh,
        aten.hardswish,
        aten.hardsigmoid,
        aten.relu6,
        aten.glu,
        aten.neg,
        aten.abs,
        aten.sign,
        aten.clamp,
        aten.clamp_min,
        aten.clamp_max,
        aten.clip,
        aten.floor,
        aten.ceil,
        aten.round,
        aten.trunc,
        aten.frac,
        aten.erf,
        aten.sqrt,
        aten.atan,
        aten.threshold,
        aten.hardshrink,
        aten.softshrink,
        aten.rrelu,
        aten.rrelu_with_noise,
        aten.deg2rad,
        aten.rad2deg,
        aten.sgn,
        # pooling over small fixed windows (a max is exact)
        aten.max_pool1d,
        aten.max_pool2d,
        aten.max_pool3d,
        aten.max_pool2d_with_indices,
        aten.adaptive_max_pool2d,
        aten.avg_pool1d,
        aten.avg_pool2d,
        aten.avg_pool3d,
        aten.adaptive_max_pool1d,
        aten.adaptive_max_pool3d,
        aten.max_pool3d_with_indices,
        aten.max_unpool2d,
        aten.max_unpool3d,
        # resizing: a copy (nearest) or a weighted average of a few neighbours (linear, cubic)
        *RESIZE_OPS,
        # comparisons and selection: exact
        aten.eq,
        aten.ne,
        aten.lt,
        aten.le,
        aten.gt,
        aten.ge,
        aten.logical_not,
        aten.logical_and,
        aten.logical_or,
        aten.argmax,
        aten.argmin,
        aten.max,
        aten.min,
        aten.amax,
        aten.amin,
        aten.topk,
        aten.sort,
        aten.argsort,
        aten.all,
        aten.any,
        aten.aminmax,
        aten.cummax,
        aten.cummin,
        aten.kthvalue,
        aten.median,
        aten.nanmedian,
        aten.mode,
        aten.msort,
        aten.isnan,
        aten.isinf,
        aten.isfinite,
        aten.isposinf,
        aten.isneginf,
        aten.signbit,
        aten.nonzero,
        aten.nonzero_static,
        aten.count_nonzero,
        aten.unique_consecutive,
        aten._unique2,
        aten.unique_dim,
        aten.logical_xor,
    }
)

# FP16 only: FP16 tops out at 65504 where BF16 reaches 3e38, so ops whose
# output can grow past the input's range move to FP32 under FP16 and stay
# PASSTHROUGH / PROMOTE under BF16. Division by a small norm or temperature,
# and activations with an exp() inside, overflow FP16 first.
FP16_EXTRA_FP32_OPS = present(
    {
        aten.div,
        aten.true_divide,
        aten.divide,
        aten.softplus,
        aten.elu,
        aten.selu,
        aten.celu,
        aten.mish,
    }
)

# Refused outright, with the fix. binary_cross_entropy takes probabilities, so
# a sigmoid in 16 bit has already rounded them to 0 or 1 and log() gives -inf.
BANNED_OPS: Mapping[object, str] = {
    aten.binary_cross_entropy: (
        "torch.nn.functional.binary_cross_entropy (and nn.BCELoss) is unsafe in mixed "
        "precision: the probabilities it takes round to 0 or 1 in 16 bit and log() "
        "gives -inf. Pass logits to torch.nn.functional.binary_cross_entropy_with_logits "
        "(or nn.BCEWithLogitsLoss) instead; it fuses the sigmoid and is safe."
    ),
}

# Ops outside ATen that popular model code emits, keyed by qualified name so
# the library need not be installed. transformers' MoE layers call this
# grouped matmul when torch's own is unavailable. amp's own logits statistics read logits in
# any dtype and compute in FP32 inside (what TRL's head is traced to).
EXTERNAL_OPS: Mapping[str, Precision] = {
    "transformers::grouped_mm_fallback": Precision.LOW,
    "amp::logits_stats": Precision.PASSTHROUGH,
}
# Ops whose outputs have the same dtypes whatever dtype their inputs arrive in
FIXED_OUTPUT_OPS = frozenset({"amp::logits_stats"})
_EXTERNAL_WHY = {
    "transformers::grouped_mm_fallback": "grouped matmul: 16-bit inputs",
    "amp::logits_stats": "softmax statistics computed in FP32 inside, logits read as they arrive",
}

TABLES: Mapping[Precision, frozenset] = {
    Precision.LOW: LOW_OPS,
    Precision.FP32: FP32_OPS,
    Precision.PROMOTE: PROMOTE_OPS,
    Precision.PASSTHROUGH: PASSTHROUGH_OPS,
}

LOW_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_op(op: object) -> OpOverloadPacket:
    """Turn "aten.mm", "mm", torch.ops.aten.mm or torch.ops.aten.mm.default into a packet."""
    if isinstance(op, OpOverload):
        return op.overloadpacket
    if isinstance(op, OpOverloadPacket):
        return op
    if isinstance(op, str):
        text = op.removeprefix("torch.ops.").replace("::", ".")
        namespace, _, name = text.rpartition(".") if text.count(".") == 1 else ("aten", "", text)
        if text.count(".") == 2:  # "aten.mm.default"
            namespace, name = text.split(".")[:2]
        packet = getattr(getattr(torch.ops, namespace or "aten", None), name, None) if name else None
        if isinstance(packet, OpOverloadPacket):
            return packet
        raise ValueError(
            f"no ATen op named {op!r}; write it as 'aten.<name>' (e.g. 'aten.mm'), "
            "'<namespace>::<name>' for a custom op, or pass torch.ops.aten.<name>"
        )
    raise TypeError(f"expected an ATen op name or torch.ops.aten packet, got {op!r}")


@dataclass(frozen=True)
class Policy:
    """The tables for one low dtype, after user overrides.

    ``overrides`` maps a precision to ops forced into that table (and out of
    every other); ``removed`` ops leave all tables and become unknown.
    """

    low_dtype: torch.dtype = torch.bfloat16
    overrides: Mapping[Precision, frozenset] = field(default_factory=dict)
    removed: frozenset = frozenset()
    reasons: Mapping[object, str] = field(default_factory=dict)  # why an override was made

    def __post_init__(self) -> None:
        tables = {p: set(ops) for p, ops in TABLES.items()}
        if self.low_dtype == torch.float16:
            for p in (Precision.PASSTHROUGH, Precision.PROMOTE):
                tables[p] -= FP16_EXTRA_FP32_OPS
            tables[Precision.FP32] |= FP16_EXTRA_FP32_OPS
        for precision, ops in self.overrides.items():
            for p in tables:
                tables[p] -= set(ops)
            tables[precision] |= set(ops)
        lookup = {}
        for p, ops in tables.items():
            for op in ops:
                if op not in self.removed:
                    lookup[op] = p
        object.__setattr__(self, "_lookup", lookup)

    def decide(self, packet: object) -> Precision | None:
        """The table an op belongs to, or None when it is unknown.

        In-place variants (``aten.add_``) share their functional op's entry.
        """
        if packet not in self._lookup:
            packet = _functional(packet)
        if packet in BANNED_OPS and packet not in self._lookup:
            raise AmpPolicyError(BANNED_OPS[packet])
        if packet not in self._lookup and packet not in self.removed:
            return EXTERNAL_OPS.get(getattr(packet, "_qualified_op_name", None))
        return self._lookup.get(packet)

    def with_fp32(self, pins: Mapping[object, str]) -> Policy:
        """This policy with ``pins`` (op -> reason) forced to FP32, unless the user already
        chose FP32 for them (their own reason then stands)."""
        user_fp32 = self.overrides.get(Precision.FP32, frozenset())
        new = {op: why for op, why in pins.items() if op not in user_fp32}
        overrides = {p: ops - set(new) for p, ops in self.overrides.items()}
        overrides[Precision.FP32] = user_fp32 | set(new)
        return Policy(self.low_dtype, {p: o for p, o in overrides.items() if o}, self.removed, {**self.reasons, **new})

    @classmethod
    def build(
        cls,
        low_dtype: torch.dtype,
        *,
        low_ops: Iterable = (),
        fp32_ops: Iterable = (),
        promote_ops: Iterable = (),
        passthrough_ops: Iterable = (),
        remove_ops: Iterable = (),
        reasons: Mapping[object, str] | None = None,
    ) -> Policy:
        overrides = {
            Precision.LOW: frozenset(map(resolve_op, low_ops)),
            Precision.FP32: frozenset(map(resolve_op, fp32_ops)),
            Precision.PROMOTE: frozenset(map(resolve_op, promote_ops)),
            Precision.PASSTHROUGH: frozenset(map(resolve_op, passthrough_ops)),
        }
        seen: dict = {}
        for precision, ops in overrides.items():
            for op in ops:
                if op in seen:
                    raise ValueError(
                        f"aten.{op.__name__} is overridden into both {seen[op]} and {precision}; "
                        "name each op in one table"
                    )
                seen[op] = precision
        return cls(
            low_dtype,
            {p: o for p, o in overrides.items() if o},
            frozenset(map(resolve_op, remove_ops)),
            {resolve_op(k): v for k, v in (reasons or {}).items()},
        )


# One line of "why" per group, shown on every node the group decides.
_GROUP_WHY = [
    (LOW_OPS, "matmul/conv/attention: 16-bit inputs, FP32 accumulation in the kernel"),
    (_FP32_NORMS, "softmax/normalization sums a whole row: FP32"),
    (_FP32_REDUCTIONS, "reduction: FP32 so small terms are not lost"),
    (_FP32_MATH, "range-expanding math: FP32"),
    (_FP32_LOSSES, "loss: FP32"),
    (_FP32_SPECTRAL, "FFT sums the whole signal (no 16-bit FFT on CPU): FP32"),
    (_FP32_LINALG, "decomposition/solve amplifies rounding by the condition number: FP32"),
    (_FP32_COMPLEX, "complex numbers: no BF16 complex type, FP32 in"),
    (_FP32_FUSED, "fused layer with LayerNorm/softmax inside: FP32 (cannot be split)"),
    (PROMOTE_OPS, "multi-input op: takes the widest floating input"),
    (PASSTHROUGH_OPS, "dtype-agnostic (view, data movement, activation): runs in the dtype that arrives"),
]
_WHY = {op: why for ops, why in reversed(_GROUP_WHY) for op in ops}
_FP16_WHY = "can overflow FP16's 65504: FP32 under fp16 (BF16 has FP32's range)"


def why(packet: object, precision: Precision, policy: Policy) -> str:
    """The human reason a table gives for an op (an in-place variant: its functional op's)."""
    if packet not in policy._lookup and packet not in policy.reasons:
        packet = _functional(packet)
    if packet in policy.reasons:
        return policy.reasons[packet]
    for p, ops in policy.overrides.items():
        if packet in ops:
            return f"user override: in {p.value.lower()}_ops"
    if policy.low_dtype == torch.float16 and packet in FP16_EXTRA_FP32_OPS:
        return _FP16_WHY
    if getattr(packet, "_qualified_op_name", None) in EXTERNAL_OPS:
        return f"known {packet._qualified_op_name}: {_EXTERNAL_WHY[packet._qualified_op_name]}"
    return _WHY.get(packet, f"{precision.value} table")


def _functional(packet: object) -> object:
    """``aten.add_`` -> ``aten.add``: an in-place variant is decided like its functional op."""
    name = getattr(packet, "__name__", "")
    if isinstance(packet, OpOverloadPacket) and name.endswith("_") and not name.startswith("_"):
        return getattr(torch.ops.aten, name[:-1], packet)
    return packet
