"""The loss head's custom ops, with their fake kernels and autograd: ``amp::head_stats`` (and
its two backward ops) from the hidden states and the weight, ``amp::logits_stats`` (and its
backward) from logits a graph already holds."""

from __future__ import annotations

import functools
import logging

import torch

from .blocks import (
    add_block_grads,
    ahead_itemsize,
    ahead_shape,
    block_buffer,
    block_grid,
    in_block,
    in_buffer,
    project,
    projection_allocates,
)
from .exact import Exact, operand
from .kernels import (
    SYNCS,
    finish_stats,
    grad_block,
    grad_block_into,
    kernel,
    parse_chain,
    parse_extras,
    start_stats,
    stats_block,
)
from .settings import settings

_log = logging.getLogger("amp_compiler")


def _check_targets(target: torch.Tensor, vocab: int, ignore_index: int) -> torch.Tensor:
    valid = target != ignore_index
    bad = valid & ((target < 0) | (target >= vocab))
    if bool(bad.any()):
        first = int(target[bad][0])
        raise IndexError(f"Target {first} is out of bounds: the vocabulary has {vocab} entries")
    return valid


@torch.library.custom_op("amp::head_stats", mutates_args=(), tags=SYNCS)
def head_stats(
    h: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    target: torch.Tensor,
    chain: str,
    ignore_index: int,
    exact: bool,
    with_sum: bool,
    extras: str = "",
    ahead: str = "",
    smoothing: float = 0.0,
) -> tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
]:
    """Per row of ``h`` [N, d]: (target logit, log-sum-exp, sum of logits, entropy, log of the
    sum of squared probabilities, whether the target is the first argmax); the last three
    where ``extras`` names them (empty otherwise). FP32 but the last (bool).

    ``ahead`` (``"h"``, ``"w"`` or ``"hw"``): also these gradients (FP32; ``"w"``: w's and b's)
    of the cross-entropy ``sum_i valid_i (lse_i - (1 - smoothing) picked_i - smoothing / V total_i)``,
    computed while each block's logits are at hand (``ahead_grads``); backward only scales them
    where the loss's gradient is that one's times a number, as a mean or sum of the loss makes
    it. Empty where not asked for."""
    if ahead:
        if extras:
            raise ValueError("amp::head_stats: ahead computes the cross-entropy's gradient; extras have none")
        return ahead_grads(h, w, b, target, chain, ignore_index, exact, smoothing, _grads(ahead))
    steps, want = parse_chain(chain), parse_extras(extras)
    n, vocab = h.shape[0], w.shape[0]
    safe = torch.where(_check_targets(target, vocab, ignore_index), target, 0)
    fold = kernel(stats_block)
    buffer = block_buffer(h, vocab, exact)
    ex = Exact.of(h, exact)
    out = []
    for rows, col_blocks in block_grid(n, vocab, h.device.type):
        stats = start_stats(rows.stop - rows.start, h)
        hc = operand(ex, h[rows], "h")
        for cols in col_blocks:
            bias = None if b is None else b[cols]
            z = project(hc, operand(ex, w[cols], "w"), bias, ex, in_buffer(buffer, rows, cols))
            stats = fold(z, stats, in_block(safe[rows], cols), steps, with_sum, want)
        out.append(finish_stats(stats, want))
    stats = out[0] if len(out) == 1 else tuple(torch.cat(parts) for parts in zip(*out))
    return (*stats, *_grad_outputs(h, w, b, (False, False), torch.float32))


def _fake_stats(n: int, like: torch.Tensor, extras: str):
    want = parse_extras(extras)
    fp32 = [like.new_empty(n if i < 3 or want[i - 3] else 0, dtype=torch.float32) for i in range(5)]
    return (*fp32, like.new_empty(n if want[2] else 0, dtype=torch.bool))


@head_stats.register_fake
def _(h, w, b, target, chain, ignore_index, exact, with_sum, extras="", ahead="", smoothing=0.0):
    stats = _fake_stats(h.shape[0], h, extras)
    return (*stats, *_grad_outputs(h, w, b, _grads(ahead) if ahead else (False, False), torch.float32))


def _grads(which: str) -> tuple[bool, bool]:
    """``"hw"``: whether h's gradient and w's (with b's) are wanted."""
    if not which or set(which) - {"h", "w"}:
        raise ValueError(f"amp::head_stats: gradients {which!r}: name 'h', 'w' or both")
    return "h" in which, "w" in which


def _grad_outputs(h, w, b, wanted: tuple[bool, bool], dtype=None):
    """Empty tensors for h's, w's and b's gradients (in ``dtype``, else the inputs' own),
    of no elements where not ``wanted`` (b's: also without a bias)."""
    want_h, want_w = wanted
    none = h.new_empty(0, dtype=dtype or h.dtype)
    return (
        h.new_empty(h.shape, dtype=dtype or h.dtype) if want_h else none,
        w.new_empty(w.shape, dtype=dtype or w.dtype) if want_w else none.clone(),
        b.new_empty(b.shape, dtype=dtype or b.dtype) if want_w and b is not None else none.clone(),
    )


@torch.library.custom_op("amp::head_stats_backward", mutates_args=())
def head_stats_backward(
    g_picked: torch.Tensor,
    g_lse: torch.Tensor,
    g_total: torch.Tensor,
    g_entropy: torch.Tensor,
    h: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    target: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    chain: str,
    ignore_index: int,
    exact: bool,
    grads: str = "hw",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients for h, w and b (empty without bias, or where ``grads`` does not name them:
    ``"h"``, ``"w"`` or ``"hw"``), logits recomputed per block; ``g_entropy`` and ``entropy``
    empty where no entropy gradient flows."""
    steps = parse_chain(chain)
    n, vocab = h.shape[0], w.shape[0]
    safe, g_picked = _ignored(target, ignore_index, g_picked)
    with_entropy = entropy.numel() > 0
    grad_dtype = torch.float32 if exact else h.dtype
    dh, dw, db = _grad_outputs(h, w, b, _grads(grads), torch.float32)
    dw.zero_(), db.zero_()
    grad = kernel(grad_block_into)
    z_buffer = block_buffer(h, vocab, exact)
    dl_buffer = block_buffer(h, vocab, exact, grad_dtype)
    ex = Exact.of(h, exact)
    for rows, col_blocks in block_grid(n, vocab, h.device.type):
        dh_rows = torch.zeros(h[rows].shape, dtype=torch.float32, device=h.device) if dh.numel() else dh
        hc = operand(ex, h[rows], "h")  # split once for its row block's GEMMs
        ent = (entropy[rows], g_entropy[rows]) if with_entropy else (None, None)
        for cols in col_blocks:
            wc = operand(ex, w[cols].to(grad_dtype), "w")  # split once for the block's three GEMMs
            z = project(hc, wc, None if b is None else b[cols], ex, in_buffer(z_buffer, rows, cols))
            at = in_block(safe[rows], cols)
            dl = in_buffer(dl_buffer, rows, cols)
            grad(dl, z, lse[rows], g_lse[rows], g_total[rows], g_picked[rows], at, steps, *ent)
            del z
            add_block_grads(dl, hc, wc, cols, dh_rows, dw, db, ex)
        if dh.numel():
            dh[rows] = dh_rows
    return dh.to(h.dtype), dw.to(w.dtype), db.to(b.dtype) if b is not None else db


def _ahead_row_grads(valid: torch.Tensor, smoothing: float, vocab: int):
    """dLoss/d(log-sum-exp, target logit, sum) per row for ``sum_i valid_i loss_i``."""
    v = valid.float()
    return v, v * -(1.0 - smoothing), v * (-smoothing / vocab)


def ahead_grads(h, w, b, target, chain: str, ignore_index: int, exact: bool, smoothing: float, wanted=(True, True)):
    """``head_stats(ahead=...)``: each row block's logits projected once and held (over
    the whole vocabulary, ``ahead_shape``) until its log-sum-exp is known, then turned into
    dLoss/dlogits block by block and multiplied out into the ``wanted`` gradients (h's, w's
    and b's), as ``head_stats_backward`` does from recomputed logits: three GEMMs per block
    instead of four (two instead of three for a frozen weight)."""
    steps, want = parse_chain(chain), (False, False, False)
    n, vocab = h.shape[0], w.shape[0]
    valid = _check_targets(target, vocab, ignore_index)
    safe = torch.where(valid, target, 0)
    g_lse, g_picked, g_total = _ahead_row_grads(valid, smoothing, vocab)
    grad_dtype = torch.float32 if exact else h.dtype
    wc_all = w.to(grad_dtype)  # one copy a call, not one a block
    hs = h.float() if exact else h
    allocates = projection_allocates(h, exact)
    rows, cols = ahead_shape(n, vocab, ahead_itemsize(h.device, h.dtype, exact), h.device.type)
    z_buffer = None if allocates else torch.empty(rows * vocab, dtype=grad_dtype, device=h.device)
    dl_buffer = torch.empty(rows * cols, dtype=grad_dtype, device=h.device)
    dh, dw, db = _grad_outputs(h, w, b, wanted, torch.float32)  # the first row block writes dw
    db.zero_()
    fold, grad = kernel(stats_block), kernel(grad_block_into)
    ex = Exact.of(h, exact)
    out = []
    for r in range(0, n, rows):
        rs = slice(r, min(r + rows, n))
        k, hc = rs.stop - rs.start, operand(ex, hs[rs], "h")
        stats, held, offset = start_stats(k, h), [], 0
        for c in range(0, vocab, cols):
            cs = slice(c, min(c + cols, vocab))
            size = k * (cs.stop - cs.start)
            place = None if z_buffer is None else z_buffer[offset : offset + size].view(k, -1)
            offset += size
            z = project(hc, operand(ex, wc_all[cs], "w"), None if b is None else b[cs], ex, place)
            at = in_block(safe[rs], cs)
            stats = fold(z, stats, at, steps, bool(smoothing), want)
            held.append((cs, z, at))
        part = finish_stats(stats, want)
        out.append(part)
        dh_rows = torch.zeros(hs[rs].shape, dtype=torch.float32, device=h.device) if dh.numel() else dh
        for cs, z, at in held:
            dl = dl_buffer[: z.numel()].view(z.shape)
            grad(dl, z, part[1], g_lse[rs], g_total[rs], g_picked[rs], at, steps)
            wc = operand(ex, wc_all[cs], "w")  # again: later blocks' splits took its storage
            add_block_grads(dl, hc, wc, cs, dh_rows, dw, db, ex, first=r == 0)
        held.clear()
        if dh.numel():
            dh[rs] = dh_rows
    stats = out[0] if len(out) == 1 else tuple(torch.cat(parts) for parts in zip(*out))
    return (*stats, dh, dw, db)


def _ahead_scale(g_picked, g_lse, g_total, target, ignore_index: int, smoothing: float, vocab: int) -> float | None:
    """The number that turns the gradients computed ahead into the loss's, None where the
    loss's gradient is not theirs times one number (per-token weights, an entropy term)."""
    valid = target != ignore_index
    g_lse_ahead, g_picked_ahead, g_total_ahead = _ahead_row_grads(valid, smoothing, vocab)
    count = g_lse_ahead.sum()
    scale = (g_lse * g_lse_ahead).sum() / count.clamp_min(1)
    strays = [(g - scale * ahead).abs().max() for g, ahead in ((g_lse, g_lse_ahead), (g_picked, g_picked_ahead))]
    strays.append((g_total - scale * g_total_ahead).abs().max())
    scale, *strays = torch.stack([scale, *strays]).tolist()
    tolerance = settings().ahead_rtol * abs(scale)
    return scale if all(stray <= tolerance for stray in strays) else None  # NaN strays: recomputed


@functools.cache
def _warn_recomputed() -> None:
    _log.warning(
        "amp::head_stats: a loss's gradient reached the fused loss head in a form other than the "
        "cross-entropy's it computed in forward (a per-token weight or another term on its "
        "statistics?); its gradient was recomputed, which costs the head's forward again. "
        "loss_head='off' keeps such a head as written"
    )


@torch.library.custom_op("amp::head_stats_backward_ahead", mutates_args=(), tags=SYNCS)
def head_stats_backward_ahead(
    g_picked: torch.Tensor,
    g_lse: torch.Tensor,
    g_total: torch.Tensor,
    h: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    target: torch.Tensor,
    lse: torch.Tensor,
    dh: torch.Tensor,
    dw: torch.Tensor,
    db: torch.Tensor,
    chain: str,
    ignore_index: int,
    exact: bool,
    smoothing: float,
    grads: str = "hw",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients for h, w and b (those ``grads`` names, else empty): the ones ``head_stats``
    computed ahead, times the loss's scale (its mean's 1/tokens, a sum's 1); recomputed per
    block (``head_stats_backward``, warned once) where the loss's gradient is not a multiple
    of theirs."""
    scale = _ahead_scale(g_picked, g_lse, g_total, target, ignore_index, smoothing, w.shape[0])
    if scale is None:
        _warn_recomputed()
        none = lse.new_empty(0)  # no entropy gradient
        args = (h, w, b, target, lse, none, chain, ignore_index, exact, grads)
        return head_stats_backward(g_picked, g_lse, g_total, none, *args)
    dh, dw, db = ((g * scale).to(like.dtype) for g, like in zip((dh, dw, db), (h, w, w if b is None else b)))
    return dh, dw, db


@head_stats_backward_ahead.register_fake
def _(g_picked, g_lse, g_total, h, w, b, target, lse, dh, dw, db, chain, ignore_index, exact, smoothing, grads="hw"):
    return _grad_outputs(h, w, b, _grads(grads))


@head_stats_backward.register_fake
def _(g_picked, g_lse, g_total, g_entropy, h, w, b, target, lse, entropy, chain, ignore_index, exact, grads="hw"):
    return _grad_outputs(h, w, b, _grads(grads))


def _ignored(target: torch.Tensor, ignore_index: int, g_picked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets safe to index with (0 where ignored), and the target logits' gradient there zeroed."""
    valid = target != ignore_index
    return torch.where(valid, target, 0), g_picked * valid


def _row_grads(lse, entropy, g_picked, g_lse, g_total, g_entropy):
    """The statistics' incoming gradients, zeros where none flowed, and the entropies the
    backward needs (both empty where no entropy gradient flowed)."""
    zeros = lse.new_zeros(lse.shape)
    pick = [zeros if g is None else g for g in (g_picked, g_lse, g_total)]
    if g_entropy is None or entropy.numel() == 0:
        return (*pick, lse.new_empty(0), lse.new_empty(0))
    return (*pick, g_entropy, entropy)


def _setup_context(ctx, inputs, output):
    h, w, b, target, chain, ignore_index, exact, _, _, ahead, smoothing = inputs
    ctx.ahead, ctx.has_bias = ahead, b is not None
    if ahead:  # the gradients computed in forward, and what recomputing them would need
        ctx.save_for_backward(h, w, b, target, output[1], *output[6:])
        ctx.args = (chain, ignore_index, exact, smoothing, ahead)
    else:
        ctx.save_for_backward(h, w, b, target, output[1], output[3])
        ctx.args = (chain, ignore_index, exact)
    ctx.mark_non_differentiable(*output[4:])


def _backward(ctx, g_picked, g_lse, g_total, g_entropy, *_):
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    if ctx.ahead:
        h, w, b, target, lse, dh, dw, db = ctx.saved_tensors
        grads = _row_grads(lse, lse.new_empty(0), g_picked, g_lse, g_total, None)[:3]
        dh, dw, db = torch.ops.amp.head_stats_backward_ahead(
            *grads, h, w, b if ctx.has_bias else None, target, lse, dh, dw, db, *ctx.args
        )
    else:
        h, w, b, target, lse, entropy = ctx.saved_tensors
        *grads, g_entropy, entropy = _row_grads(lse, entropy, g_picked, g_lse, g_total, g_entropy)
        wanted = "h" * need_h + "w" * (need_w or need_b)
        dh, dw, db = torch.ops.amp.head_stats_backward(
            *grads, g_entropy, h, w, b if ctx.has_bias else None, target, lse, entropy, *ctx.args, wanted or "hw"
        )
    return dh if need_h else None, dw if need_w else None, db if need_b else None, *(None,) * 8


head_stats.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("amp::logits_stats", mutates_args=(), tags=SYNCS)
def logits_stats(
    z: torch.Tensor, target: torch.Tensor, chain: str, ignore_index: int, with_sum: bool, extras: str = ""
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``head_stats``' statistics of logits ``z`` [N, V] a graph already holds: one generated
    kernel over all of it (no FP32 copy of the logits in memory). The loss-head pass replaces
    it with ``head_stats`` on the projection's input where it can fuse the projection."""
    steps, want = parse_chain(chain), parse_extras(extras)
    safe = torch.where(_check_targets(target, z.shape[1], ignore_index), target, 0)
    stats = kernel(stats_block)(z, start_stats(z.shape[0], z), safe, steps, with_sum, want)
    return finish_stats(stats, want)


@logits_stats.register_fake
def _(z, target, chain, ignore_index, with_sum, extras=""):
    return _fake_stats(z.shape[0], z, extras)


@torch.library.custom_op("amp::logits_stats_backward", mutates_args=())
def logits_stats_backward(
    g_picked: torch.Tensor,
    g_lse: torch.Tensor,
    g_total: torch.Tensor,
    g_entropy: torch.Tensor,
    z: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    chain: str,
    ignore_index: int,
) -> torch.Tensor:
    """dLoss/dz in ``z``'s dtype (``g_entropy`` and ``entropy`` empty where no entropy gradient flows)."""
    safe, g_picked = _ignored(target, ignore_index, g_picked)
    ent = (entropy, g_entropy) if entropy.numel() else (None, None)
    return kernel(grad_block)(z, lse, g_lse, g_total, g_picked, safe, parse_chain(chain), z.dtype, *ent)


@logits_stats_backward.register_fake
def _(g_picked, g_lse, g_total, g_entropy, z, target, lse, entropy, chain, ignore_index):
    return torch.empty_like(z)


def _logits_setup_context(ctx, inputs, output):
    z, target, chain, ignore_index, _, _ = inputs
    ctx.save_for_backward(z, target, output[1], output[3])
    ctx.args = (chain, ignore_index)
    ctx.mark_non_differentiable(output[4], output[5])


def _logits_backward(ctx, g_picked, g_lse, g_total, g_entropy, *_):
    z, target, lse, entropy = ctx.saved_tensors
    *grads, g_entropy, entropy = _row_grads(lse, entropy, g_picked, g_lse, g_total, g_entropy)
    dz = torch.ops.amp.logits_stats_backward(*grads, g_entropy, z, target, lse, entropy, *ctx.args)
    return dz, None, None, None, None, None


logits_stats.register_autograd(_logits_backward, setup_context=_logits_setup_context)
