"""The fused loss head: per-token statistics of ``softmax(chain(h @ w.T + b))``, in blocks.

A language model's loss reads three numbers per token of its logits: the target's
logit, the log-sum-exp and (label smoothing only) the sum over the vocabulary; RL and
fine-tuning trainers log three more (``EXTRAS``: the entropy, the log of the sum of squared
probabilities, whether the target is the first argmax). One
opaque op, ``amp::head_stats``, computes them block by block (a block: up to
``max_rows`` tokens x as many vocabulary entries as make ``block_elements`` logits, 16x
that on a GPU), the
log-sum-exp online across a row's vocabulary blocks. The logits (tokens x vocabulary,
the largest activation of the model) exist one block at a time and are never saved:
backward recomputes each block from ``h`` and ``w`` and writes that block's rows of the
weight's gradient, a GEMM over all the tokens. Where the loss is a mean or sum of the
cross-entropies its gradient is known up to one number in forward (``ahead``): the op
then holds a row block's logits over the whole vocabulary, turns them into the gradients
while they are at hand, and backward only scales those (no projection computed twice).
What the loss does with the three numbers
(ignore_index, smoothing, reduction) stays ordinary graph ops that the compiler sees.
``amp::logits_stats`` computes the same statistics from logits a graph already holds (what
TRL's head is traced to); the loss-head pass turns it into ``amp::head_stats`` where the
projection can be fused.

Precision: the projection runs in ``h``'s dtype (16 bit, FP32 accumulation; its output
rounded to 16 bit as the unfused 16-bit head rounds it, except on CUDA where the GEMM
writes FP32), the chain (scale, soft-cap), log-sum-exp and gather in FP32. ``w`` is the
FP32 master weight, cast a block at a time: no 16-bit copy of it is kept, and its gradient
is returned in FP32. ``exact``: the projection and its gradients to FP32's accuracy, as split
BF16 products (three BF16 GEMMs accumulating and writing FP32) where the machine has such a
GEMM (CUDA's ``mm`` with ``out_dtype``; on CPU oneDNN's FP32 GEMM with its products in BF16,
which AMX runs, where ``split_onednn`` chooses it: by default where one block times faster
so), else in FP32.

The package: ``settings`` (the tunables, one object), ``kernels`` (the compiled per-block
math), ``exact`` (the split GEMMs), ``blocks`` (block shapes, the projection, a block's
gradients), ``ops`` (the custom ops and their autograd).
"""

from __future__ import annotations

from .blocks import ahead_bytes, ahead_itemsize, ahead_shape, block_shape
from .exact import UNDECIDED, exact_mm, exact_products, split_operand, split_timings, takes_bf16_products
from .kernels import EXTRAS, NO_IGNORE, P_FLOOR, format_chain, parse_chain, parse_extras
from .ops import ahead_grads, head_stats, logits_stats
from .settings import HeadSettings, settings, tuned

__all__ = [
    "EXTRAS",
    "NO_IGNORE",
    "P_FLOOR",
    "UNDECIDED",
    "HeadSettings",
    "ahead_bytes",
    "ahead_grads",
    "ahead_itemsize",
    "ahead_shape",
    "block_shape",
    "exact_mm",
    "exact_products",
    "format_chain",
    "head_stats",
    "logits_stats",
    "parse_chain",
    "parse_extras",
    "settings",
    "split_operand",
    "split_timings",
    "takes_bf16_products",
    "tuned",
]
