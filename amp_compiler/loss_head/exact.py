"""The exact head's GEMMs: to FP32's accuracy, as split BF16 products where the machine has
such a GEMM (CUDA's ``mm`` with ``out_dtype``; on CPU oneDNN's FP32 GEMM with its products in
BF16, which AMX runs, where ``split_onednn`` chooses it), else in FP32; and how a head of a
given width runs them here, timed once per width."""

from __future__ import annotations

import logging
import math
import statistics
import time

import torch

from ..device import bf16_products, bf16_products_native, gemm_writes_fp32, mm_fp32_out, native_dtypes
from ..upstream.torch_private import private
from .kernels import kernel
from .settings import settings

_log = logging.getLogger("amp_compiler")


def split_native(device: torch.device) -> bool:
    """Whether the exact head's FP32 products run as split BF16 ones on ``device`` through
    GEMMs of BF16 matrices that write FP32 (CUDA sm_80+; on CPU a 16-bit GEMM rounds its
    output to 16 bit, which would defeat the split)."""
    return "bf16" in native_dtypes(device)[0] and gemm_writes_fp32(device, torch.bfloat16)


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


# this process's timings, per head width (``HeadSettings.split_ms``)
_SPLIT_MS: dict[int, tuple[float, float]] = {}
UNDECIDED = "split-onednn-if-faster"


def _timings() -> dict[int, tuple[float, float]]:
    given = settings().split_ms
    return _SPLIT_MS if given is None else given


def takes_bf16_products(device: torch.device) -> bool:
    """Whether the exact head takes oneDNN to run FP32 GEMMs' products in BF16 here: the
    probe's answer (``device.bf16_products_native``), or the setting's where it gives one."""
    taken = settings().bf16_products
    return bf16_products_native(device) if taken is None else taken and device.type == "cpu"


def exact_products(device: torch.device, width: int | None = None, measure: bool = True) -> str:
    """How the exact head's GEMMs run on ``device`` for a head ``width`` wide: "split" (three
    BF16 GEMMs writing FP32), "split-onednn" (the same as FP32 GEMMs whose products oneDNN
    runs in BF16, where it honours that and ``split_onednn`` chooses it) or "fp32". Under
    "auto" the first call for a width times the two (``split_timings``); ``UNDECIDED`` where
    it may not measure (no width, ``measure`` False, or inside a compile); "fp32" where
    ``torch.use_deterministic_algorithms`` is on (a timing could choose differently next run)."""
    s, timings = settings(), _timings()
    if split_native(device):
        return "split"
    if s.split_onednn is False or not takes_bf16_products(device):
        return "fp32"
    if s.split_onednn is True:
        return "split-onednn"
    if torch.are_deterministic_algorithms_enabled():
        return "fp32"
    if width not in timings:
        if width is None or not measure or torch.compiler.is_compiling():
            return UNDECIDED
        timings[width] = _time_split(int(width))
        _log.info("exact loss head, width %d: split %.1f ms, FP32 %.1f ms a block", width, *timings[width])
    split_ms, fp32_ms = timings[width]
    return "split-onednn" if fp32_ms > s.split_gain * split_ms else "fp32"


def split_timings() -> dict[int, tuple[float, float]]:
    """Per head width timed so far: (split, FP32) milliseconds of one block's GEMM."""
    return dict(_timings())


def _time_split(width: int, reps: int = 3) -> tuple[float, float]:
    """Milliseconds of one block's ``dl @ w`` (``split_timed_block`` x ``width``): split (both
    operands' halves written, three GEMMs under BF16 products) and one FP32 GEMM; medians of
    interleaved runs, after one of each (the split's kernel compiles)."""
    rows, cols = settings().split_timed_block
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
    kernel(_split_into)(hi, lo, x)
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
        return mm_fp32_out(ah, bh).add_(mm_fp32_out(ah, bl)).add_(mm_fp32_out(al, bh))
    with bf16_products():
        z = torch.mm(ah, bh, out=out)
        return z.addmm_(ah, bl).addmm_(al, bh)


class Exact:
    """A call's exact GEMMs: how they run (``exact_products`` for its head's width, decided
    once a call) and the storage its split operands share (``split_operand``)."""

    def __init__(self, device: torch.device, width: int):
        self.kind, self.into = exact_products(device, width), {}

    @classmethod
    def of(cls, h: torch.Tensor, exact: bool) -> Exact | None:
        return cls(h.device, h.shape[-1]) if exact else None

    def operand(self, x: torch.Tensor, role: str):
        return split_operand(x, self.kind, self.into, role)

    def mm(self, a, b, out: torch.Tensor | None = None) -> torch.Tensor:
        return exact_mm(a, b, out, self.into, self.kind)


def operand(exact: Exact | None, x: torch.Tensor, role: str):
    """A GEMM operand as a call's loops take it: 16-bit as given (the projection casts w's
    block); exact: FP32, or split once for all the GEMMs that use it."""
    return exact.operand(x, role) if exact else x
