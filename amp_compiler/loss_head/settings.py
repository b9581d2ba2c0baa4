"""The fused loss head's tunables, in one object.

``settings()`` is the one in force; ``tuned(...)`` puts some changed for a block of code (a
test's small blocks, a benchmark's other threshold) and puts the old back after it. The
setting is process-wide, as the head's ops run wherever autograd runs them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator


@dataclasses.dataclass(frozen=True)
class HeadSettings:
    # Logits per block (16 MiB in FP32); backward holds about three such buffers at once
    block_elements: int = 1 << 22
    # Tokens per block at most: the weight's gradient is a GEMM over this many tokens
    max_rows: int = 8192
    # A GPU's blocks are 16x larger (256 MiB of FP32 logits): per block the op pays a few kernel
    # launches and a compiled call's guards, which at CPU-sized blocks made the head of a 50k
    # vocabulary decoder (8 x 1024 tokens) 12x slower than unfused on an H200; 16x fewer
    # blocks (and 4x the tokens): 4.6x faster, still 0.72x of the unfused head's memory
    gpu_scale: int = 16
    min_cols: int = 256
    # Below this many classes the logits are small beside the model's other activations
    min_vocab: int = 8192

    # Where oneDNN runs FP32 GEMMs' products in BF16 (AMX), the exact head's GEMMs may run
    # split: three BF16 GEMMs for one FP32, plus a pass over each block to split it. "auto"
    # times one block both ways at the head's width, once per width a process uses, and splits
    # where that is ``split_gain`` x faster (a narrow head's BF16 GEMMs may not repay the pass;
    # no AMX figures yet); True always splits there, False never
    split_onednn: bool | str = "auto"
    split_gain: float = 1.1
    # Tokens x vocabulary entries of the block timed: a one-pass head's row block, a block's columns
    split_timed_block: tuple[int, int] = (1024, 4096)

    # The one-pass head (``ahead``) holds a row block's logits over the whole vocabulary, since
    # no gradient is known before the row's log-sum-exp: this many bytes of them, 4x on a GPU
    # (whose logits are FP32), but at least ``ahead_min_rows`` tokens, as each row block adds
    # the weight's whole FP32 gradient once more (a 32k-vocabulary step on a 2-core CPU, against
    # the head as written: 1.04x at 2 row blocks, 1.07x at 4; peak memory 0.84x and 0.74x)
    ahead_bytes: int = 64 << 20
    ahead_gpu_scale: int = 4
    ahead_min_rows: int = 1024
    # With AMX the GEMMs run ~6x faster and that addition weighs more: by bytes against GEMM
    # rate ~30% of the head's GEMM time per 1024-token row block (~4% on AVX512-BF16); a
    # judgement, not measured on AMX yet
    ahead_min_rows_amx: int = 2048
    # Logits per block of the one-pass head: fewer, larger blocks than the recomputing head's,
    # as it holds them anyway (a 50k-vocabulary decoder's step on a 2-core CPU: 4M blocks 1.02x
    # the head as written, 8M 0.99x)
    ahead_block_elements: int = 1 << 23
    # How far the loss's gradient may stray from a multiple of the one computed ahead (FP32
    # rounding of the loss's own ops) and still be that multiple
    ahead_rtol: float = 1e-5

    # Compiles each block function may make: one per chain, flag set and logit dtype a process
    # uses. Past Dynamo's default of 8 a fullgraph compile raises, and the head would run its
    # blocks as ATen calls from then on.
    kernel_recompiles: int = 64

    # What the machine is taken to do; None: probed (``device.cpu_has_amx``,
    # ``device.bf16_products_native``)
    amx: bool | None = None
    bf16_products: bool | None = None
    # Per head width, (split, FP32) milliseconds of one block's GEMM: the timings the exact
    # head decides by (``exact.exact_products``), and records new ones into; None: this
    # process's own record
    split_ms: dict | None = None


_current = HeadSettings()


def settings() -> HeadSettings:
    """The settings in force."""
    return _current


@contextlib.contextmanager
def tuned(**changes) -> Iterator[HeadSettings]:
    """``settings()`` with ``changes`` (``HeadSettings``' fields) inside the block."""
    global _current
    before, _current = _current, dataclasses.replace(_current, **changes)
    try:
        yield _current
    finally:
        _current = before
