"""The fused loss head: per-token statistics of ``softmax(chain(h @ w.T + b))``, in blocks.

A language model's loss reads three numbers per token of its logits: the target's
logit, the log-sum-exp and (label smoothing only) the sum over the vocabulary; RL and
fine-tuning trainers log three more (``EXTRAS``: the entropy, the log of the sum of squared
probabilities, whether the target is the first argmax). One
opaque op, ``amp::head_stats``, computes them block by block (a block: up to
``MAX_ROWS`` tokens x as many vocabulary entries as make ``BLOCK_ELEMENTS`` logits, 16x
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
which AMX runs, where ``SPLIT_ONEDNN`` chooses it: by default where one block times faster
so), else in FP32.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import statistics
import time

import torch

from .device import cpu_has_amx, native_dtypes
from .upstream.torch_private import private

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


# A term exp(x) with x below this (x: a logit less the row's running max or log-sum-exp)
# counts as 0. Near FP32's smallest normal (x ~ -87) ATen's exp takes a slow path (6.6x on a
# block of init-time logits, ~16 apart), and such a p times the loss's weight (1/tokens) is
# a denormal, whose arithmetic made the gradient kernel 1.75x slower (3.4 against 1.9 ms a
# 2048 x 2048 block, 2-core AVX512-BF16 CPU). e^-60 = 9e-27 keeps p x any ordinary weight
# normal; what it drops is under 1e-21 of a row's sum or gradient over a 150k vocabulary.
P_FLOOR = -60.0


def _exp_above_floor(x: torch.Tensor) -> torch.Tensor:
    """exp(x), 0 where x < P_FLOOR (the exp never sees such an x)."""
    return torch.where(x < P_FLOOR, 0.0, torch.exp(x.clamp_min(P_FLOOR)))


# Per-token statistics beyond the loss's, by name: the entropy (differentiable), log(sum p^2)
# and whether the target is the first argmax (neither differentiable)
EXTRAS = ("entropy", "log_sum_sq", "top1")
# No index is ignored (gather's semantics: every out-of-range target is an error)
NO_IGNORE = -(1 << 62)


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


@functools.lru_cache(maxsize=16)
def parse_extras(extras: str) -> tuple[bool, bool, bool]:
    """``"entropy,top1"``: which of ``EXTRAS`` to compute, as flags in ``EXTRAS``' order."""
    names = set(filter(None, extras.split(",")))
    if unknown := names - set(EXTRAS):
        raise ValueError(f"amp::head_stats: unknown statistics {sorted(unknown)}; choose from {EXTRAS}")
    return tuple(name in names for name in EXTRAS)


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
    """Whether the exact head's FP32 products run as split BF16 ones on ``device`` through
    GEMMs of BF16 matrices that write FP32 (CUDA sm_80+; on CPU a 16-bit GEMM rounds its
    output to 16 bit, which would defeat the split)."""
    return "bf16" in native_dtypes(device)[0] and _writes_fp32(device, torch.bfloat16)


@contextlib.contextmanager
def _bf16_products():
    """oneDNN runs the FP32 GEMMs inside with their products in BF16 (``fpmath_mode`` bf16),
    accumulating and writing FP32. The setting is process-wide: an FP32 GEMM another thread
    runs meanwhile takes it too."""
    matmul = torch.backends.mkldnn.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "bf16"
    try:
        yield
    finally:
        matmul.fp32_precision = before


_BF16_PRODUCTS: dict[str, bool] = {}


def bf16_products_native(device: torch.device) -> bool:
    """Whether ``_bf16_products`` takes effect on this CPU: oneDNN implements it with AMX (on
    an AVX512-BF16 CPU without AMX it computes in FP32, as torch 2.13's build does here).
    Probed once: ``1 + 2^-10`` is no BF16, so a BF16 product of it gives 32, an FP32 one 32.03."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if "cpu" not in _BF16_PRODUCTS:
        ok = "bf16" in native_dtypes(device)[0]
        if ok:
            try:  # on real tensors, even where a compile's fake mode is active
                with private("torch._subclasses.fake_tensor.unset_fake_temporarily")(), _bf16_products():
                    a = torch.full((32, 32), 1 + 2**-10)
                    ok = torch.mm(a, torch.ones(32, 32))[0, 0].item() == 32.0
            except (RuntimeError, AttributeError):
                ok = False
        _BF16_PRODUCTS["cpu"] = ok
    return _BF16_PRODUCTS["cpu"]


def _bf16_bits(x: torch.Tensor, nearest: bool) -> torch.Tensor:
    """FP32 ``x`` cut to a BF16 value (still FP32), by its bits: truncated, or rounded to
    nearest even. By bits because Inductor folds a cast to BF16 and back into nothing."""
    bits = x.view(torch.int32)
    if nearest:
        bits = bits + (0x7FFF + ((bits >> 16) & 1))
    return (bits & -65536).view(torch.float32)


def _split_into(hi: torch.Tensor, lo: torch.Tensor, x: torch.Tensor) -> None:
    """FP32 ``x`` as ``hi + lo``, both BF16 values (written into BF16 or FP32 tensors): ``hi``
    its leading 8 bits, truncated (no overflow near FP32's largest), ``lo`` the rest rounded,
    16 of FP32's 24 mantissa bits in all (relative error under 2^-16)."""
    top = _bf16_bits(x, False)
    hi.copy_(top)
    lo.copy_(_bf16_bits(x - top, True))


# Where oneDNN runs FP32 GEMMs' products in BF16 (AMX), the exact head's GEMMs may run split:
# three BF16 GEMMs for one FP32, plus a pass over each block to split it. "auto" times one
# block both ways at the head's width, once per width a process uses, and splits where that
# is SPLIT_GAIN x faster (a narrow head's BF16 GEMMs may not repay the pass; no AMX figures
# yet); True always splits there, False never
SPLIT_ONEDNN: bool | str = "auto"
SPLIT_GAIN = 1.1
# Tokens x vocabulary entries of the block timed: a one-pass head's row block, a block's columns
SPLIT_TIMED_BLOCK = (1024, 4096)
_SPLIT_MS: dict[int, tuple[float, float]] = {}
UNDECIDED = "split-onednn-if-faster"


def exact_products(device: torch.device, width: int | None = None, measure: bool = True) -> str:
    """How the exact head's GEMMs run on ``device`` for a head ``width`` wide: "split" (three
    BF16 GEMMs writing FP32), "split-onednn" (the same as FP32 GEMMs whose products oneDNN
    runs in BF16, where it honours that and ``SPLIT_ONEDNN`` chooses it) or "fp32". Under
    "auto" the first call for a width times the two (``split_timings``); ``UNDECIDED`` where
    it may not measure (no width, ``measure`` False, or inside a compile); "fp32" where
    ``torch.use_deterministic_algorithms`` is on (a timing could choose differently next run)."""
    if _split_native(device):
        return "split"
    if SPLIT_ONEDNN is False or not bf16_products_native(device):
        return "fp32"
    if SPLIT_ONEDNN is True:
        return "split-onednn"
    if torch.are_deterministic_algorithms_enabled():
        return "fp32"
    if width not in _SPLIT_MS:
        if width is None or not measure or torch.compiler.is_compiling():
            return UNDECIDED
        _SPLIT_MS[width] = _time_split(int(width))
        _log.info("exact loss head, width %d: split %.1f ms, FP32 %.1f ms a block", width, *_SPLIT_MS[width])
    split_ms, fp32_ms = _SPLIT_MS[width]
    return "split-onednn" if fp32_ms > SPLIT_GAIN * split_ms else "fp32"


def split_timings() -> dict[int, tuple[float, float]]:
    """Per head width timed so far: (split, FP32) milliseconds of one block's GEMM."""
    return dict(_SPLIT_MS)


def _time_split(width: int, reps: int = 3) -> tuple[float, float]:
    """Milliseconds of one block's ``dl @ w`` (``SPLIT_TIMED_BLOCK`` x ``width``): split (both
    operands' halves written, three GEMMs under BF16 products) and one FP32 GEMM; medians of
    interleaved runs, after one of each (the split's kernel compiles)."""
    rows, cols = SPLIT_TIMED_BLOCK
    with private("torch._subclasses.fake_tensor.unset_fake_temporarily")():
        g = torch.Generator().manual_seed(0)
        dl, w = torch.randn(rows, cols, generator=g), torch.randn(cols, width, generator=g)
        into = {}
        runs = {
            "split": lambda: exact_mm(dl, w, into=into, kind="split-onednn"),
            "fp32": lambda: exact_mm(dl, w, kind="fp32"),
        }
        times = {name: [] for name in runs}
        for _ in range(reps + 1):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
    return tuple(statistics.median(t[1:]) * 1e3 for t in times.values())


class _Split(tuple):
    """An operand of the split product, ``(hi, lo)`` as its GEMMs take them: BF16 ("split"),
    or BF16 values held in FP32 ("split-onednn"). Split once, it serves several products."""

    def t(self) -> _Split:
        return _Split(part.t() for part in self)


def split_operand(x: torch.Tensor, kind: str, into: dict | None = None, role: str = "") -> torch.Tensor | _Split:
    """``x`` ready for ``exact_mm`` under ``kind`` (``exact_products``): FP32, or its halves,
    written by a generated kernel into ``into[role]``'s storage where given (a call's blocks
    reuse it: fresh block-sized halves are page faults, and eager ATen passes, which made
    a 2048 x 4096 block's split 20x slower, 55 against 2.8 ms on a 2-core CPU). An operand
    already split is returned as it is."""
    if isinstance(x, _Split):
        return x
    x = x.float()
    if kind == "fp32":
        return x
    if x.dim() == 2 and not x.is_contiguous() and x.t().is_contiguous():  # a weight's .t()
        return split_operand(x.t(), kind, into, role).t()
    dtype = torch.bfloat16 if kind == "split" else torch.float32
    hi, lo = _storage(into, role, x.shape, dtype, x.device)
    _kernel(_split_into)(hi, lo, x)
    return _Split((hi, lo))


def _storage(into: dict | None, role: str, shape, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two tensors of ``shape`` on ``into[role]``'s storage, grown (or first made) as needed."""
    n = math.prod(shape)
    pair = None if into is None else into.get(role)
    if pair is None or pair[0].numel() < n or pair[0].dtype != dtype:
        pair = tuple(torch.empty(n, dtype=dtype, device=device) for _ in range(2))
        if into is not None:
            into[role] = pair
    return tuple(part[:n].view(shape) for part in pair)


def exact_mm(a, b, out: torch.Tensor | None = None, into: dict | None = None, kind: str | None = None) -> torch.Tensor:
    """``a @ b`` to FP32's accuracy for the loss head (``a``, ``b``: tensors, or operands
    ``split_operand`` already split under ``kind``, which defaults to ``exact_products``' for a
    head as wide as the product's inner dimension). Where BF16 GEMMs write FP32 it is three of
    them over the split operands, ``ah bh + ah bl + al bh`` (the dropped ``al bl`` and the
    split's remainders are ~2^-16 of each term: a relative error near 1e-5, far under the
    head's 1e-3 nats). On a CPU whose oneDNN runs FP32 GEMMs' products in BF16, the same three
    products as FP32 GEMMs of the halves (each exactly a BF16 value: the products are those of
    BF16 GEMMs), into ``out`` where given; elsewhere one FP32 GEMM. Operands it splits go to
    ``into``'s storage (``split_operand``)."""
    if kind is None:
        first = a[0] if isinstance(a, _Split) else a
        kind = exact_products(first.device, first.shape[-1])
    a, b = split_operand(a, kind, into, "a"), split_operand(b, kind, into, "b")
    if kind == "fp32":
        return torch.mm(a, b, out=out)
    (ah, al), (bh, bl) = a, b
    if kind == "split":
        return _mm32(ah, bh).add_(_mm32(ah, bl)).add_(_mm32(al, bh))
    with _bf16_products():
        z = torch.mm(ah, bh, out=out)
        return z.addmm_(ah, bl).addmm_(al, bh)


def _project(h, w, b: torch.Tensor | None, exact: _Exact | None, out=None) -> torch.Tensor:
    """``h @ w.T + b`` as the GEMM wrote it (FP32 where exact or where the GEMM writes FP32),
    into ``out`` where given (``_block_buffer``)."""
    if exact:
        z = exact.mm(h, w.t(), out)
        return z if b is None else z.add_(b)
    w = w.to(h.dtype)
    if _writes_fp32(h.device, h.dtype):  # the logits are never rounded to 16 bit
        z = _mm32(h, w.t())
        return z if b is None else z.add_(b)
    if b is None:
        return torch.mm(h, w.t(), out=out)
    return torch.addmm(b.to(h.dtype), h, w.t(), out=out)


def _projection_allocates(h: torch.Tensor, exact: bool) -> bool:
    """Whether ``_project`` writes a fresh tensor rather than into the buffer it is given
    (split products on a GPU, or a GEMM writing its FP32 accumulator)."""
    return (exact and _split_native(h.device)) or (not exact and _writes_fp32(h.device, h.dtype))


def _block_buffer(h: torch.Tensor, vocab: int, exact: bool, dtype: torch.dtype | None = None):
    """Storage for one block, which every block of a call reuses (``_in``), or None where the
    GEMM allocates its own output (split or FP32-writing products). A fresh block a time is
    a fresh 8-16 MiB allocation, which glibc maps and unmaps: its page faults made the block
    kernels ~1.6x slower and the backward 11% slower (2048 x 50257 head, 2-core CPU)."""
    if dtype is None:
        if _projection_allocates(h, exact):
            return None
        dtype = torch.float32 if exact else h.dtype
    rows, cols = block_shape(h.shape[0], vocab, h.device.type)
    return torch.empty(rows * cols, dtype=dtype, device=h.device)


def _in(buffer: torch.Tensor | None, rows: slice, cols: slice) -> torch.Tensor | None:
    """The block ``rows`` x ``cols`` of a ``_block_buffer`` (contiguous), None without one."""
    if buffer is None:
        return None
    n, m = rows.stop - rows.start, cols.stop - cols.start
    return buffer[: n * m].view(n, m)


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
def _stats_block(z, stats, at, chain, with_sum, want):
    """Fold one block of logits into its rows' running statistics (``_start``'s seven);
    log-sum-exp online, the extras ``want`` asks for (``parse_extras``) online beside it."""
    top, sum_exp, picked, total, s1, s2, first = stats
    z, _ = _chain(z.float(), chain)
    block_top = z.amax(1)
    new_top = torch.maximum(top, block_top)
    scale = torch.exp(top - new_top)
    e = _exp_above_floor(z - new_top[:, None])
    sum_exp = sum_exp * scale + e.sum(1)
    picked = picked + torch.where(_hit(z, at), z, 0.0).sum(1)
    if with_sum:
        total = total + z.sum(1)
    entropy, sq, top1 = want
    if entropy:  # sum of exp(z - top) * z: the mean logit under p, for H = lse - E_p[z]
        s1 = s1 * scale + (e * z).sum(1)
    if sq:
        s2 = s2 * scale * scale + _exp_above_floor(2 * (z - new_top[:, None])).sum(1)
    if top1:  # the row's first argmax moves here only where this block's max is larger
        first = torch.where(block_top > top, z.argmax(1) == at, first)
    return new_top, sum_exp, picked, total, s1, s2, first


def _start(rows: int, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Running statistics of ``rows`` rows before their first block."""
    top = like.new_full((rows,), float("-inf"), dtype=torch.float32)
    zeros = [torch.zeros_like(top) for _ in range(5)]
    return top, *zeros, torch.zeros(rows, dtype=torch.bool, device=like.device)


def _finish(stats, want) -> tuple[torch.Tensor, ...]:
    """(target logit, log-sum-exp, sum, entropy, log sum p^2, target is first argmax); the
    extras not asked for are empty."""
    top, sum_exp, picked, total, s1, s2, first = stats
    lse = sum_exp.log() + top
    entropy, sq, top1 = want
    return (
        picked,
        lse,
        total,
        lse - s1 / sum_exp if entropy else top.new_empty(0),  # fresh empties: outputs never alias
        s2.log() + 2 * (top - lse) if sq else top.new_empty(0),
        first if top1 else first.new_empty(0),
    )


def _grad_block(z, lse, g_lse, g_total, g_picked, at, chain, out_dtype, entropy=None, g_entropy=None):
    """dLoss/dlogits of one block (recomputed logits in), in ``out_dtype``. ``entropy``: the
    rows' entropies, whose gradient ``g_entropy`` adds -p (log p + H)."""
    z, tanhs = _chain(z.float(), chain)
    p = _exp_above_floor(z - lse[:, None])
    dz = p * g_lse[:, None] + g_total[:, None]
    if entropy is not None:
        dz = dz - p * (z - lse[:, None] + entropy[:, None]) * g_entropy[:, None]
    dz = dz + torch.where(_hit(z, at), g_picked[:, None], 0.0)
    for kind, value in reversed(chain):
        if kind == "m":
            dz = dz * value
        else:
            y = tanhs.pop()
            dz = dz * (1 - y * y)
    return dz.to(out_dtype)


def _grad_block_into(out, z, lse, g_lse, g_total, g_picked, at, chain, entropy=None, g_entropy=None):
    """``_grad_block`` written into ``out`` (a reused block buffer)."""
    out.copy_(_grad_block(z, lse, g_lse, g_total, g_picked, at, chain, out.dtype, entropy, g_entropy))


# Tags of the ops that read a value back to the host (a target out of the vocabulary raises;
# the one-pass backward checks the loss's gradient): Inductor keeps them out of CUDA graphs
SYNCS = tuple(tag for tag in (getattr(torch.Tag, "cudagraph_unsafe", None),) if tag is not None)

_KERNELS: dict[str, object] = {}
# Compiles each block function may make: one per chain, flag set and logit dtype a process
# uses. Past Dynamo's default of 8 a fullgraph compile raises, and the head would run its
# blocks as ATen calls from then on.
KERNEL_RECOMPILES = 64


def _compiled(fn):
    options = {"dynamic": True, "fullgraph": True}
    if "recompile_limit" in inspect.signature(torch.compile).parameters:  # torch >= 2.13
        options["recompile_limit"] = KERNEL_RECOMPILES
    return torch.compile(fn, **options)


def _kernel(fn):
    """``fn`` compiled by Inductor, or as written where Inductor cannot compile here (warned
    once), or for this call where a dispatch mode is active or a compile is under way: Dynamo
    refuses to trace there, which is no reason to give up compiling (the ops' kernels run
    with the mode popped, and after compiling; helpers such as ``split_operand`` called
    directly under a recorder or from a compiler pass do not)."""
    name = fn.__name__
    if name not in _KERNELS:
        _KERNELS[name] = _compiled(fn)
    compiled = _KERNELS[name]

    def run(*args):
        nonlocal compiled
        if (
            compiled is fn
            or private("torch.utils._python_dispatch.is_in_torch_dispatch_mode")(include_infra_modes=False)
            or torch.compiler.is_compiling()
        ):
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
    fold = _kernel(_stats_block)
    buffer = _block_buffer(h, vocab, exact)
    ex = _Exact.of(h, exact)
    out = []
    for rows, col_blocks in _blocks(n, vocab, h.device.type):
        stats = _start(rows.stop - rows.start, h)
        hc = _operand(ex, h[rows], "h")
        for cols in col_blocks:
            z = _project(hc, _operand(ex, w[cols], "w"), None if b is None else b[cols], ex, _in(buffer, rows, cols))
            stats = fold(z, stats, _in_block(safe[rows], cols), steps, with_sum, want)
        out.append(_finish(stats, want))
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
    grad = _kernel(_grad_block_into)
    z_buffer = _block_buffer(h, vocab, exact)
    dl_buffer = _block_buffer(h, vocab, exact, grad_dtype)
    ex = _Exact.of(h, exact)
    for rows, col_blocks in _blocks(n, vocab, h.device.type):
        dh_rows = torch.zeros(h[rows].shape, dtype=torch.float32, device=h.device) if dh.numel() else dh
        hc = _operand(ex, h[rows], "h")  # split once for its row block's GEMMs
        ent = (entropy[rows], g_entropy[rows]) if with_entropy else (None, None)
        for cols in col_blocks:
            wc = _operand(ex, w[cols].to(grad_dtype), "w")  # split once for the block's three GEMMs
            z = _project(hc, wc, None if b is None else b[cols], ex, _in(z_buffer, rows, cols))
            at = _in_block(safe[rows], cols)
            dl = _in(dl_buffer, rows, cols)
            grad(dl, z, lse[rows], g_lse[rows], g_total[rows], g_picked[rows], at, steps, *ent)
            del z
            _add_block_grads(dl, hc, wc, cols, dh_rows, dw, db, ex)
        if dh.numel():
            dh[rows] = dh_rows
    return dh.to(h.dtype), dw.to(w.dtype), db.to(b.dtype) if b is not None else db


class _Exact:
    """A call's exact GEMMs: how they run (``exact_products`` for its head's width, decided
    once a call) and the storage its split operands share (``split_operand``)."""

    def __init__(self, device: torch.device, width: int):
        self.kind, self.into = exact_products(device, width), {}

    @classmethod
    def of(cls, h: torch.Tensor, exact: bool) -> _Exact | None:
        return cls(h.device, h.shape[-1]) if exact else None

    def operand(self, x: torch.Tensor, role: str):
        return split_operand(x, self.kind, self.into, role)

    def mm(self, a, b, out: torch.Tensor | None = None) -> torch.Tensor:
        return exact_mm(a, b, out, self.into, self.kind)


def _operand(exact: _Exact | None, x: torch.Tensor, role: str):
    """A GEMM operand as a call's loops take it: 16-bit as given (the projection casts w's
    block); exact: FP32, or split once for all the GEMMs that use it."""
    return exact.operand(x, role) if exact else x


def _add_block_grads(dl, hc, wc, cols, dh_rows, dw, db, exact: _Exact | None, first=False) -> None:
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


# The one-pass head (``ahead``) holds a row block's logits over the whole vocabulary, since
# no gradient is known before the row's log-sum-exp: this many bytes of them, 4x on a GPU
# (whose logits are FP32), but at least AHEAD_MIN_ROWS tokens, as each row block adds the
# weight's whole FP32 gradient once more (a 32k-vocabulary step on a 2-core CPU, against the
# head as written: 1.04x at 2 row blocks, 1.07x at 4; peak memory 0.84x and 0.74x)
AHEAD_BYTES = 64 << 20
AHEAD_GPU_SCALE = 4
AHEAD_MIN_ROWS = 1024
# With AMX the GEMMs run ~6x faster and that addition weighs more: by bytes against GEMM
# rate ~30% of the head's GEMM time per 1024-token row block (~4% on AVX512-BF16); a
# judgement, not measured on AMX yet
AHEAD_MIN_ROWS_AMX = 2048
# Logits per block of the one-pass head: fewer, larger blocks than the recomputing head's, as
# it holds them anyway (a 50k-vocabulary decoder's step on a 2-core CPU: 4M blocks 1.02x the
# head as written, 8M 0.99x)
AHEAD_BLOCK_ELEMENTS = 1 << 23
# How far the loss's gradient may stray from a multiple of the one computed ahead (FP32
# rounding of the loss's own ops) and still be that multiple
AHEAD_RTOL = 1e-5


def ahead_shape(tokens: int, vocab: int, itemsize: int, device: str = "cpu") -> tuple[int, int]:
    """(tokens, vocabulary entries) of the one-pass head's blocks: a row block's logits for
    the whole vocabulary fit ``AHEAD_BYTES``, cut into blocks of ``AHEAD_BLOCK_ELEMENTS``."""
    gpu = device != "cpu"
    budget = AHEAD_BYTES * (AHEAD_GPU_SCALE if gpu else 1)
    least = AHEAD_MIN_ROWS_AMX if not gpu and cpu_has_amx() else AHEAD_MIN_ROWS
    rows = max(least, budget // max(1, vocab * itemsize))
    rows = max(1, min(rows, int(tokens), MAX_ROWS * (4 if gpu else 1)))
    rows = -(-int(tokens) // -(-int(tokens) // rows))  # as many rows in each block
    cols = max(MIN_COLS, AHEAD_BLOCK_ELEMENTS * (GPU_SCALE if gpu else 1) // rows)
    return rows, min(cols, int(vocab))


def ahead_itemsize(device: torch.device, dtype: torch.dtype, exact: bool) -> int:
    """Bytes per logit the one-pass head holds: FP32 where exact or where the GEMM writes
    its FP32 accumulator (CUDA), else the 16-bit dtype's."""
    return 4 if exact or _writes_fp32(device, dtype) else dtype.itemsize


def ahead_bytes(tokens: int, vocab: int, width: int) -> int:
    """What the one-pass head keeps for backward: FP32 gradients for h (``tokens`` rows; 0
    where h needs none) and the weight (``vocab`` rows; 0 for a frozen weight)."""
    return 4 * width * (tokens + vocab)


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
    allocates = _projection_allocates(h, exact)
    rows, cols = ahead_shape(n, vocab, ahead_itemsize(h.device, h.dtype, exact), h.device.type)
    z_buffer = None if allocates else torch.empty(rows * vocab, dtype=grad_dtype, device=h.device)
    dl_buffer = torch.empty(rows * cols, dtype=grad_dtype, device=h.device)
    dh, dw, db = _grad_outputs(h, w, b, wanted, torch.float32)  # the first row block writes dw
    db.zero_()
    fold, grad = _kernel(_stats_block), _kernel(_grad_block_into)
    ex = _Exact.of(h, exact)
    out = []
    for r in range(0, n, rows):
        rs = slice(r, min(r + rows, n))
        k, hc = rs.stop - rs.start, _operand(ex, hs[rs], "h")
        stats, held, offset = _start(k, h), [], 0
        for c in range(0, vocab, cols):
            cs = slice(c, min(c + cols, vocab))
            size = k * (cs.stop - cs.start)
            place = None if z_buffer is None else z_buffer[offset : offset + size].view(k, -1)
            offset += size
            z = _project(hc, _operand(ex, wc_all[cs], "w"), None if b is None else b[cs], ex, place)
            at = _in_block(safe[rs], cs)
            stats = fold(z, stats, at, steps, bool(smoothing), want)
            held.append((cs, z, at))
        part = _finish(stats, want)
        out.append(part)
        dh_rows = torch.zeros(hs[rs].shape, dtype=torch.float32, device=h.device) if dh.numel() else dh
        for cs, z, at in held:
            dl = dl_buffer[: z.numel()].view(z.shape)
            grad(dl, z, part[1], g_lse[rs], g_total[rs], g_picked[rs], at, steps)
            wc = _operand(ex, wc_all[cs], "w")  # again: later blocks' splits took its storage
            _add_block_grads(dl, hc, wc, cs, dh_rows, dw, db, ex, first=r == 0)
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
    tolerance = AHEAD_RTOL * abs(scale)
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
    stats = _kernel(_stats_block)(z, _start(z.shape[0], z), safe, steps, with_sum, want)
    return _finish(stats, want)


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
    return _kernel(_grad_block)(z, lse, g_lse, g_total, g_picked, safe, parse_chain(chain), z.dtype, *ent)


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
