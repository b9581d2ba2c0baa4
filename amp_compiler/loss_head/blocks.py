"""How the loss head cuts its work into blocks: their shapes (the recomputing head's and the
one-pass head's), the projection of one block into reused storage, and one block's share of
the gradients."""

from __future__ import annotations

import torch

from ..device import cpu_has_amx, gemm_writes_fp32, mm_fp32_out
from .exact import Exact, split_native
from .settings import settings


def block_shape(tokens: int | None, vocab: int, device: str = "cpu") -> tuple[int | None, int | None]:
    """(tokens, vocabulary entries) of a block; None where ``tokens`` is not known."""
    if tokens is None:
        return None, None
    s, gpu = settings(), device != "cpu"
    rows = max(1, min(int(tokens), s.max_rows * (4 if gpu else 1)))
    cols = max(s.min_cols, s.block_elements * (s.gpu_scale if gpu else 1) // rows)
    return rows, min(cols, int(vocab))


def block_grid(n: int, vocab: int, device: str = "cpu"):
    """(token rows, vocabulary columns) of every block, rows outermost."""
    rows, cols = block_shape(n, vocab, device)
    for r in range(0, n, rows):
        yield slice(r, min(r + rows, n)), [slice(c, min(c + cols, vocab)) for c in range(0, vocab, cols)]


def in_block(target: torch.Tensor, cols: slice) -> torch.Tensor:
    """Each row's target's column in ``cols``, or -1 where it falls outside them."""
    inside = (target >= cols.start) & (target < cols.stop)
    return torch.where(inside, target - cols.start, -1)


def project(h, w, b: torch.Tensor | None, exact: Exact | None, out=None) -> torch.Tensor:
    """``h @ w.T + b`` as the GEMM wrote it (FP32 where exact or where the GEMM writes FP32),
    into ``out`` where given (``block_buffer``)."""
    if exact:
        z = exact.mm(h, w.t(), out)
        return z if b is None else z.add_(b)
    w = w.to(h.dtype)
    if gemm_writes_fp32(h.device, h.dtype):  # the logits are never rounded to 16 bit
        z = mm_fp32_out(h, w.t())
        return z if b is None else z.add_(b)
    if b is None:
        return torch.mm(h, w.t(), out=out)
    return torch.addmm(b.to(h.dtype), h, w.t(), out=out)


def projection_allocates(h: torch.Tensor, exact: bool) -> bool:
    """Whether ``project`` writes a fresh tensor rather than into the buffer it is given
    (split products on a GPU, or a GEMM writing its FP32 accumulator)."""
    return (exact and split_native(h.device)) or (not exact and gemm_writes_fp32(h.device, h.dtype))


def block_buffer(h: torch.Tensor, vocab: int, exact: bool, dtype: torch.dtype | None = None):
    """Storage for one block, which every block of a call reuses (``in_buffer``), or None where the
    GEMM allocates its own output (split or FP32-writing products). A fresh block a time is
    a fresh 8-16 MiB allocation, which glibc maps and unmaps: its page faults made the block
    kernels ~1.6x slower and the backward 11% slower (2048 x 50257 head, 2-core CPU)."""
    if dtype is None:
        if projection_allocates(h, exact):
            return None
        dtype = torch.float32 if exact else h.dtype
    rows, cols = block_shape(h.shape[0], vocab, h.device.type)
    return torch.empty(rows * cols, dtype=dtype, device=h.device)


def in_buffer(buffer: torch.Tensor | None, rows: slice, cols: slice) -> torch.Tensor | None:
    """The block ``rows`` x ``cols`` of a ``block_buffer`` (contiguous), None without one."""
    if buffer is None:
        return None
    n, m = rows.stop - rows.start, cols.stop - cols.start
    return buffer[: n * m].view(n, m)


def add_block_grads(dl, hc, wc, cols, dh_rows, dw, db, exact: Exact | None, first=False) -> None:
    """Add one block's share of the gradients: ``dl`` (dLoss/dlogits of rows ``hc`` x
    vocabulary entries ``cols``) times the weight's rows ``wc`` into ``dh_rows``, times ``hc``
    into the weight's gradient rows ``cols`` (written, not added, where ``first``), and its
    column sums into the bias's (``db``, empty without one). The sums are a GEMV: as a
    reduction over the rows in the generated kernel (or ATen's ``sum(0)``) they made it 5x
    slower (18.6 against 3.8 ms a 2048 x 4096 block, 2-core CPU; the GEMV 2.7). Exact: ``dl``
    is split once for both of its products (the callers split ``hc`` and ``wc`` once for all
    of theirs)."""
    if db.numel():
        db[cols] += torch.mv(dl.t(), dl.new_ones(dl.shape[0]))
    mm = exact.mm if exact else torch.mm
    if exact:
        dl = exact.operand(dl, "dl")
    if dh_rows.numel():
        dh_rows.add_(mm(dl, wc))
    if not dw.numel():
        return
    if first:
        dw[cols] = mm(dl.t(), hc)
    else:
        dw[cols] += mm(dl.t(), hc)  # this block's rows of the gradient, over these tokens


def ahead_shape(tokens: int, vocab: int, itemsize: int, device: str = "cpu") -> tuple[int, int]:
    """(tokens, vocabulary entries) of the one-pass head's blocks: a row block's logits for
    the whole vocabulary fit ``ahead_bytes``, cut into blocks of ``ahead_block_elements``."""
    s, gpu = settings(), device != "cpu"
    budget = s.ahead_bytes * (s.ahead_gpu_scale if gpu else 1)
    amx = s.amx if s.amx is not None else cpu_has_amx()
    least = s.ahead_min_rows_amx if not gpu and amx else s.ahead_min_rows
    rows = max(least, budget // max(1, vocab * itemsize))
    rows = max(1, min(rows, int(tokens), s.max_rows * (4 if gpu else 1)))
    rows = -(-int(tokens) // -(-int(tokens) // rows))  # as many rows in each block
    cols = max(s.min_cols, s.ahead_block_elements * (s.gpu_scale if gpu else 1) // rows)
    return rows, min(cols, int(vocab))


def ahead_itemsize(device: torch.device, dtype: torch.dtype, exact: bool) -> int:
    """Bytes per logit the one-pass head holds: FP32 where exact or where the GEMM writes
    its FP32 accumulator (CUDA), else the 16-bit dtype's."""
    return 4 if exact or gemm_writes_fp32(device, dtype) else dtype.itemsize


def ahead_bytes(tokens: int, vocab: int, width: int) -> int:
    """What the one-pass head keeps for backward: FP32 gradients for h (``tokens`` rows; 0
    where h needs none) and the weight (``vocab`` rows; 0 for a frozen weight)."""
    return 4 * width * (tokens + vocab)
