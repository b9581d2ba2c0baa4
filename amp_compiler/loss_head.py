"""The fused loss head: per-token statistics of ``softmax(chain(h @ w.T + b))`` in chunks.

A language model's loss reads three numbers per token of its logits: the target's
logit, the log-sum-exp and (label smoothing only) the sum over the vocabulary. One
opaque op, ``amp::head_stats``, computes them over chunks of tokens, so the logits
(tokens x vocabulary, the largest activation of the model) exist one chunk at a time
and are never saved: backward recomputes each chunk's logits from ``h`` and ``w``.
What the loss does with the three numbers (ignore_index, smoothing, reduction) stays
ordinary graph ops that the compiler sees.

Precision: the projection runs in ``h``'s dtype (16 bit, FP32 accumulation; its output
rounded to 16 bit as the unfused 16-bit head rounds it, except on CUDA where the GEMM
writes FP32), the chain (scale, soft-cap), log-sum-exp and gather in FP32. ``w`` is the
FP32 master weight, cast per call: no 16-bit copy of it is kept for backward, and its
gradient is accumulated over the chunks in FP32 and returned as such. ``exact``: the
projection in FP32.
"""

from __future__ import annotations

import functools

import torch

# Rows per chunk: a chunk's FP32 logits hold about this many elements (16 MiB); backward
# holds about 2.5 such buffers at once
CHUNK_ELEMENTS = 1 << 22
MIN_ROWS = 16
# Below this many classes the logits are small beside the model's other activations
MIN_VOCAB = 8192


def chunk_rows(vocab: int, tokens: int | None = None) -> int:
    rows = max(MIN_ROWS, CHUNK_ELEMENTS // max(int(vocab), 1))
    return rows if tokens is None else max(1, min(rows, int(tokens)))


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


_FP32_OUT_MM: dict[str, bool] = {}


def _project(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, exact: bool) -> torch.Tensor:
    """``h @ w.T + b`` as FP32 logits; ``w`` and ``b`` already in the projection's dtype."""
    if exact:
        z = h.float() @ w.t()
        return z if b is None else z.add_(b)
    kind = h.device.type
    if kind != "cpu" and _FP32_OUT_MM.get(kind, True):
        try:  # the GEMM writes its FP32 accumulator: the logits are never rounded to 16 bit
            z = torch.mm(h, w.t(), out_dtype=torch.float32)
            _FP32_OUT_MM[kind] = True
            return z if b is None else z.add_(b)
        except (RuntimeError, TypeError, NotImplementedError):
            _FP32_OUT_MM[kind] = False
    return (h @ w.t() if b is None else torch.addmm(b, h, w.t())).float()


def _operands(h, w, b, exact):
    dtype = torch.float32 if exact else h.dtype
    return w.to(dtype), None if b is None else b.to(dtype)


def _chain_forward(z: torch.Tensor, chain) -> tuple[torch.Tensor, list[torch.Tensor]]:
    tanhs = []  # tanh outputs, for backward (copies: later steps work in place)
    for kind, value in chain:
        if kind == "m":
            z = z.mul_(value)
        else:
            z = z.tanh_()
            tanhs.append(z.clone())
    return z, tanhs


def _check_targets(target: torch.Tensor, vocab: int, ignore_index: int) -> torch.Tensor:
    valid = target != ignore_index
    bad = valid & ((target < 0) | (target >= vocab))
    if bool(bad.any()):
        first = int(target[bad][0])
        raise IndexError(f"Target {first} is out of bounds: the vocabulary has {vocab} entries")
    return valid


@torch.library.custom_op("amp::head_stats", mutates_args=())
def head_stats(
    h: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    target: torch.Tensor,
    chain: str,
    ignore_index: int,
    chunk: int,
    exact: bool,
    with_sum: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target logit, log-sum-exp, sum of logits) per row of ``h`` [N, d], all FP32."""
    steps = parse_chain(chain)
    n, vocab = h.shape[0], w.shape[0]
    valid = _check_targets(target, vocab, ignore_index)
    safe = torch.where(valid, target, 0)
    wc, bc = _operands(h, w, b, exact)
    picked = h.new_empty(n, dtype=torch.float32)
    lse = h.new_empty(n, dtype=torch.float32)
    total = h.new_zeros(n, dtype=torch.float32)
    for start in range(0, n, chunk):
        rows = slice(start, min(start + chunk, n))
        z, _ = _chain_forward(_project(h[rows], wc, bc, exact), steps)
        picked[rows] = z.gather(1, safe[rows, None]).squeeze(1)
        if with_sum:
            total[rows] = z.sum(1)
        top = z.amax(1, keepdim=True)  # log-sum-exp in place: no second chunk-sized buffer
        lse[rows] = z.sub_(top).exp_().sum(1).log_().add_(top.squeeze(1))
    return picked, lse, total


@head_stats.register_fake
def _(h, w, b, target, chain, ignore_index, chunk, exact, with_sum):
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
    chunk: int,
    exact: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients for h, w and b (an empty tensor without bias), logits recomputed per chunk."""
    steps = parse_chain(chain)
    n, vocab = h.shape[0], w.shape[0]
    valid = target != ignore_index
    safe = torch.where(valid, target, 0)
    g_picked = g_picked * valid
    wc, bc = _operands(h, w, b, exact)
    dh = torch.empty_like(h)
    dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)  # accumulated in FP32
    db = torch.zeros(vocab, dtype=torch.float32, device=w.device) if b is not None else h.new_empty(0)
    for start in range(0, n, chunk):
        rows = slice(start, min(start + chunk, n))
        hc = h[rows].float() if exact else h[rows]
        z, tanhs = _chain_forward(_project(hc, wc, bc, exact), steps)
        dz = z.sub_(lse[rows, None]).exp_().mul_(g_lse[rows, None])  # softmax x dL/dlse
        dz.add_(g_total[rows, None])
        dz.scatter_add_(1, safe[rows, None], g_picked[rows, None])
        for kind, value in reversed(steps):
            if kind == "m":
                dz.mul_(value)
            else:
                y = tanhs.pop()
                dz.mul_(1 - y * y)
        if b is not None:
            db += dz.sum(0)
        dl = dz if exact else dz.to(h.dtype)
        del z, dz
        dh[rows] = (dl @ wc).to(h.dtype)
        dw.add_(dl.t() @ hc)
    return dh, dw.to(w.dtype), db.to(b.dtype) if b is not None else db


@head_stats_backward.register_fake
def _(g_picked, g_lse, g_total, h, w, b, target, lse, chain, ignore_index, chunk, exact):
    return torch.empty_like(h), torch.empty_like(w), torch.empty_like(b) if b is not None else h.new_empty(0)


def _setup_context(ctx, inputs, output):
    h, w, b, target, chain, ignore_index, chunk, exact, _ = inputs
    ctx.save_for_backward(h, w, b, target, output[1])
    ctx.args = (chain, ignore_index, chunk, exact)
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
    return dh, dw, db if ctx.has_bias else None, None, None, None, None, None, None


head_stats.register_autograd(_backward, setup_context=_setup_context)
