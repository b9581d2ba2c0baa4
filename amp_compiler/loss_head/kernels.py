"""The per-block math of the loss head, compiled: one generated kernel a pass over a block.

The statistics (target logit, log-sum-exp online across a row's blocks, the extras) and the
gradient of the logits, in FP32 from the logits the GEMM wrote (never copied to FP32 in
memory); the chain (scale, soft-cap) ``parse_chain`` reads. The GEMMs stay calls into the
BLAS (``blocks``).
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch

from ..upstream.torch_private import private
from .settings import settings

_log = logging.getLogger("amp_compiler")

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
def stats_block(z, stats, at, chain, with_sum, want):
    """Fold one block of logits into its rows' running statistics (``start_stats``'s seven);
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


def start_stats(rows: int, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Running statistics of ``rows`` rows before their first block."""
    top = like.new_full((rows,), float("-inf"), dtype=torch.float32)
    zeros = [torch.zeros_like(top) for _ in range(5)]
    return top, *zeros, torch.zeros(rows, dtype=torch.bool, device=like.device)


def finish_stats(stats, want) -> tuple[torch.Tensor, ...]:
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


def grad_block(z, lse, g_lse, g_total, g_picked, at, chain, out_dtype, entropy=None, g_entropy=None):
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


def grad_block_into(out, z, lse, g_lse, g_total, g_picked, at, chain, entropy=None, g_entropy=None):
    """``grad_block`` written into ``out`` (a reused block buffer)."""
    out.copy_(grad_block(z, lse, g_lse, g_total, g_picked, at, chain, out.dtype, entropy, g_entropy))


# Tags of the ops that read a value back to the host (a target out of the vocabulary raises;
# the one-pass backward checks the loss's gradient): Inductor keeps them out of CUDA graphs
SYNCS = tuple(tag for tag in (getattr(torch.Tag, "cudagraph_unsafe", None),) if tag is not None)

_KERNELS: dict[str, object] = {}


def _compiled(fn):
    options = {"dynamic": True, "fullgraph": True}
    if "recompile_limit" in inspect.signature(torch.compile).parameters:  # torch >= 2.13
        options["recompile_limit"] = settings().kernel_recompiles
    return torch.compile(fn, **options)


def kernel(fn):
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
