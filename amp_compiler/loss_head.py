"""The fused loss head: per-token statistics of ``softmax(chain(h @ w.T + b))``, in blocks.

A language model's loss reads three numbers per token of its logits: the target's
logit, the log-sum-exp and (label smoothing only) the sum over the vocabulary. One
opaque op, ``amp::head_stats``, computes them block by block (a block: up to
``MAX_ROWS`` tokens x as many vocabulary entries as make ``BLOCK_ELEMENTS`` logits, 16x
that on a GPU), the
log-sum-exp online across a row's vocabulary blocks. The logits (tokens x vocabulary,
the largest activation of the model) exist one block at a time and are never saved:
backward recomputes each block from ``h`` and ``w`` and writes that block's rows of the
weight's gradient, a GEMM over all the tokens. What the loss does with the three numbers
(ignore_index, smoothing, reduction) stays ordinary graph ops that the compiler sees.

Precision: the projection runs in ``h``'s dtype (16 bit, FP32 accumulation; its output
rounded to 16 bit as the unfused 16-bit head rounds it, except on CUDA where the GEMM
writes FP32), the chain (scale, soft-cap), log-sum-exp and gather in FP32. ``w`` is the
FP32 master weight, cast a block at a time: no 16-bit copy of it is kept, and its gradient
is returned in FP32. ``exact``: the projection and its gradients to FP32's accuracy, as split
BF16 products (three BF16 GEMMs writing FP32) where the GEMM writes FP32, else in FP32.
"""

from __future__ import annotations

import functools
import logging

import torch

from .device import native_dtypes

_log = logging.getLogger("amp_compiler")

# Logits per block (16 MiB in FP32); backward holds about three such buffers at once
BLOCK_ELEMENTS = 1 << 22
# Tokens per block at most: the weight's gradient is a GEMM over this many tokens
MAX_ROWS = 8192
# A GPU's blocks are 16x larger (256 MiB of FP32 logits): per block the op pays a few kernel
# launches and a compiled call's guards, which at CPU-sized blocks made the head of a 50k
# vocabulary decoder (8 x 1024 tokens) 12x slower than unfused on an H200; 16x fewer
# blocks (and 4x the tokens): 4.6x faster, still 0.72x of the unfused head's memory
GPU_SCALE = 16
MIN_COLS = 256
# Below this many classes the logits are small beside the model's other activations
MIN_VOCAB = 8192


# exp() below this underflows past FP32's smallest normal (1.2e-38), where ATen's vectorized
# exp takes a slow path (6.6x slower on a block of init-time logits, ~16 apart); clamped
# there, each such term adds at most 1.7e-38 to a sum that is at least 1
EXP_FLOOR = -87.0


def block_shape(tokens: int | None, vocab: int, device: str = "cpu") -> tuple[int | None, int | None]:
    """(tokens, vocabulary entries) of a block; None where ``tokens`` is not known."""
    if tokens is None:
        return None, None
    gpu = device != "cpu"
    rows = max(1, min(int(tokens), MAX_ROWS * (4 if gpu else 1)))
    cols = max(MIN_COLS, BLOCK_ELEMENTS * (GPU_SCALE if gpu else 1) // rows)
    return rows, min(cols, int(vocab))


@functools.lru_cache(maxsize=64)
def parse_chain(chain: str) -> tuple[tuple[str, float], ...]:
    """``"m0.5,t,m30"``: multiply by 0.5, tanh, multiply by 30 (in that order)."""
    out = []
    for part in filter(None, chain.split(",")):
        if part == "t":
            out.append(("t", 0.0))
        elif part[0] == "m":
            out.append(("m", float(part[1:])))
        else:
            raise ValueError(f"amp::head_stats: bad chain element {part!r} in {chain!r}")
    return tuple(out)


def format_chain(steps: list[tuple[str, float]]) -> str:
    return ",".join("t" if kind == "t" else f"m{value!r}" for kind, value in steps)


def _mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of 16-bit matrices, the FP32 accumulator written out unrounded."""
    return torch.mm(a, b, out_dtype=torch.float32)


_FP32_OUT_MM: dict[tuple[str, torch.dtype], bool] = {}


def _writes_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a GEMM of ``dtype`` matrices on ``device`` writes its FP32 accumulator (``mm``
    with ``out_dtype``: CUDA; torch 2.13 has no CPU kernel for it). Probed once per device."""
    key = (str(device), dtype)
    if key not in _FP32_OUT_MM:
        ok = device.type != "cpu"
        if ok:
            try:
                one = torch.ones(1, 1, dtype=dtype, device=device)
                ok = _mm32(one, one).dtype == torch.float32
            except (RuntimeError, TypeError, NotImplementedError):
                ok = False
        _FP32_OUT_MM[key] = ok
    return _FP32_OUT_MM[key]


def _split_native(device: torch.device) -> bool:
    """Whether the exact head's FP32 products run as split BF16 ones on ``device``: where BF16
    GEMMs are native and write FP32 (CUDA sm_80+; on CPU a 16-bit product rounded to 16 bit
    would defeat the split)."""
    return "bf16" in native_dtypes(device)[0] and _writes_fp32(device, torch.bfloat16)


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (FP32) as BF16 ``hi + lo``: 16 of FP32's 24 mantissa bits."""
    hi = x.to(torch.bfloat16)
    return hi, (x - hi.float()).to(torch.bfloat16)


def exact_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` to FP32's accuracy for the loss head. Where BF16 GEMMs write FP32 it is three
    of them over the split operands, ``ah bh + ah bl + al bh`` (the dropped ``al bl`` and the
    split's remainders are ~2^-16 of each term: a relative error near 1e-5, far under the
    head's 1e-3 nats); elsewhere one FP32 GEMM."""
    a, b = a.float(), b.float()
    if not _split_native(a.device):
        return a @ b
    (ah, al), (bh, bl) = _halves(a), _halves(b)
    return _mm32(ah, bh).add_(_mm32(ah, bl)).add_(_mm32(al, bh))


def _project(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, exact: bool) -> torch.Tensor:
    """``h @ w.T + b`` as the GEMM wrote it (FP32 where exact or where the GEMM writes FP32)."""
    if exact:
        z = exact_mm(h, w.t())
        return z if b is None else z.add_(b)
    w = w.to(h.dtype)
    if _writes_fp32(h.device, h.dtype):  # the logits are never rounded to 16 bit
        z = _mm32(h, w.t())
        return z if b is None else z.add_(b)
    return h @ w.t() if b is None else torch.addmm(b.to(h.dtype), h, w.t())


def _chain(z: torch.Tensor, chain) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The chain applied to FP32 logits, and its tanh outputs (for backward)."""
    tanhs = []
    for kind, value in chain:
        if kind == "m":
            z = z * value
        else:
            z = torch.tanh(z)
            tanhs.append(z)
    return z, tanhs


def _hit(z: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """Where each row's target sits in the block (``at`` is -1 where it is not in it)."""
    return torch.arange(z.shape[1], device=z.device) == at[:, None]


# The per-block math below is compiled (one generated kernel a pass over the block, the
# logits read in the GEMM's dtype and never copied to FP32 in memory); the GEMMs stay calls
# into the BLAS. Each function is traced with dynamic shapes: one compile serves every block.
def _stats_block(z, top, sum_exp, picked, total, at, chain, with_sum):
    """Fold one block of logits into its rows' running statistics; log-sum-exp online."""
    z, _ = _chain(z.float(), chain)
    new_top = torch.maximum(top, z.amax(1))
    sum_exp = sum_exp * torch.exp(top - new_top) + torch.exp((z - new_top[:, None]).clamp_min(EXP_FLOOR)).sum(1)
    picked = picked + torch.where(_hit(z, at), z, 0.0).sum(1)
    if with_sum:
        total = total + z.sum(1)
    return new_top, sum_exp, picked, total


def _grad_block(z, lse, g_lse, g_total, g_picked, at, chain, out_dtype, with_bias):
    """dLoss/dlogits of one block (recomputed logits in), in ``out_dtype``; and its column sums."""
    z, tanhs = _chain(z.float(), chain)
    dz = torch.exp((z - lse[:, None]).clamp_min(EXP_FLOOR)) * g_lse[:, None] + g_total[:, None]
    dz = dz + torch.where(_hit(z, at), g_picked[:, None], 0.0)
    for kind, value in reversed(chain):
        if kind == "m":
            dz = dz * value
        else:
            y = tanhs.pop()
            dz = dz * (1 - y * y)
    return dz.to(out_dtype), dz.sum(0) if with_bias else None


_KERNELS: dict[str, object] = {}


def _kernel(fn):
    """``fn`` compiled by Inductor, or as written where Inductor cannot compile here (warned once)."""
    name = fn.__name__
    if name not in _KERNELS:
        _KERNELS[name] = torch.compile(fn, dynamic=True, fullgraph=True)
    compiled = _KERNELS[name]

    def run(*args):
        nonlocal compiled
        if compiled is fn:
            return fn(*args)
        try:
            return compiled(*args)
        except Exception as e:  # no C++ compiler, or a backend failure: the math is the same
            _log.warning(
                "amp::head_stats: Inductor could not compile the block math (%s: %s); "
                "the head runs its blocks as eager ATen calls, slower",
                type(e).__name__,
                e,
            )
            _KERNELS[name] = compiled = fn
            return fn(*args)

    return run


def _check_targets(target: torch.Tensor, vocab: int, ignore_index: int) -> torch.Tensor:
    valid = target != ignore_index
    bad = valid & ((target < 0) | (target >= vocab))
    if bool(bad.any()):
        first = int(target[bad][0])
        raise IndexError(f"Target {first} is out of bounds: the vocabulary has {vocab} entries")
    return valid


def _blocks(n: int, vocab: int, device: str = "cpu"):
    """(token rows, vocabulary columns) of every block, rows outermost."""
    rows, cols = block_shape(n, vocab, device)
    for r in range(0, n, rows):
        yield slice(r, min(r + rows, n)), [slice(c, min(c + cols, vocab)) for c in range(0, vocab, cols)]


def _in_block(target: torch.Tensor, cols: slice) -> torch.Tensor:
    """Each row's target's column in ``cols``, or -1 where it falls outside them."""
    inside = (target >= cols.start) & (target < cols.stop)
    return torch.where(inside, target - cols.start, -1)


@torch.library.custom_op("amp::head_stats", mutates_args=())
def head_stats(
    h: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    target: torch.Tensor,
    chain: str,
    ignore_index: int,
    exact: bool,
    with_sum: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target logit, log-sum-exp, sum of logits) per row of ``h`` [N, d], all FP32."""
    steps = parse_chain(chain)
    n, vocab = h.shape[0], w.shape[0]
    safe = torch.where(_check_targets(target, vocab, ignore_index), target, 0)
    picked = h.new_empty(n, dtype=torch.float32)
    lse = h.new_empty(n, dtype=torch.float32)
    total = h.new_zeros(n, dtype=torch.float32)
    fold = _kernel(_stats_block)
    for rows, col_blocks in _blocks(n, vocab, h.device.type):
        m = rows.stop - rows.start
        top = h.new_full((m,), float("-inf"), dtype=torch.float32)
        stats = top, torch.zeros_like(top), torch.zeros_like(top), torch.zeros_like(top)
        for cols in col_blocks:
            z = _project(h[rows], w[cols], None if b is None else b[cols], exact)
            stats = fold(z, *stats, _in_block(safe[rows], cols), steps, with_sum)
        top, sum_exp, picked[rows], total[rows] = stats
        lse[rows] = sum_exp.log() + top
    return picked, lse, total


@head_stats.register_fake
def _(h, w, b, target, chain, ignore_index, exact, with_sum):
    n = h.shape[0]
    return tuple(h.new_empty(n, dtype=torch.float32) for _ in range(3))


@torch.library.custom_op("amp::head_stats_backward", mutates_args=())
def head_stats_backward(
    g_picked: torch.Tensor,
    g_lse: torch.Tensor,
    g_total: torch.Tensor,
    h: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    target: torch.Tensor,
    lse: torch.Tensor,
    chain: str,
    ignore_index: int,
    exact: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients for h, w and b (an empty tensor without bias), logits recomputed per block."""
    steps = parse_chain(chain)
    n, vocab = h.shape[0], w.shape[0]
    valid = target != ignore_index
    safe = torch.where(valid, target, 0)
    g_picked = g_picked * valid
    grad_dtype = torch.float32 if exact else h.dtype
    dh = torch.empty_like(h)
    dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    db = torch.zeros(vocab, dtype=torch.float32, device=w.device) if b is not None else h.new_empty(0)
    grad = _kernel(_grad_block)
    for rows, col_blocks in _blocks(n, vocab, h.device.type):
        hc = h[rows].float() if exact else h[rows]
        dh_rows = torch.zeros(hc.shape, dtype=torch.float32, device=h.device)
        for cols in col_blocks:
            wc = w[cols].to(grad_dtype)
            z = _project(hc, wc, None if b is None else b[cols], exact)
            at = _in_block(safe[rows], cols)
            dl, db_cols = grad(
                z, lse[rows], g_lse[rows], g_total[rows], g_picked[rows], at, steps, grad_dtype, b is not None
            )
            del z
            if b is not None:
                db[cols] += db_cols
            if exact:
                dh_rows.add_(exact_mm(dl, wc))
                dw[cols] += exact_mm(dl.t(), hc)
            else:
                dh_rows.add_(dl @ wc)
                dw[cols] += dl.t() @ hc  # this block's rows of the gradient, over these tokens
        dh[rows] = dh_rows
    return dh, dw.to(w.dtype), db.to(b.dtype) if b is not None else db


@head_stats_backward.register_fake
def _(g_picked, g_lse, g_total, h, w, b, target, lse, chain, ignore_index, exact):
    return torch.empty_like(h), torch.empty_like(w), torch.empty_like(b) if b is not None else h.new_empty(0)


def _setup_context(ctx, inputs, output):
    h, w, b, target, chain, ignore_index, exact, _ = inputs
    ctx.save_for_backward(h, w, b, target, output[1])
    ctx.args = (chain, ignore_index, exact)
    ctx.has_bias = b is not None


def _backward(ctx, g_picked, g_lse, g_total):
    h, w, b, target, lse = ctx.saved_tensors
    zeros = lse.new_zeros(lse.shape)
    dh, dw, db = torch.ops.amp.head_stats_backward(
        zeros if g_picked is None else g_picked,
        zeros if g_lse is None else g_lse,
        zeros if g_total is None else g_total,
        h,
        w,
        b if ctx.has_bias else None,
        target,
        lse,
        *ctx.args,
    )
    return dh, dw, db if ctx.has_bias else None, None, None, None, None, None


head_stats.register_autograd(_backward, setup_context=_setup_context)
