"""Time one block of the fused loss head's math (no GEMM): generated kernels vs ATen calls.

    python tools/head_block.py [--size 2048] [--std 2,16] [--reps 15]

The ATen side is the same math as in-place eager calls (what the op ran before its block
math was compiled). BF16 logits in, as a 16-bit projection writes them: no 16-bit
arithmetic is timed, so the figures hold on CPUs that emulate BF16 GEMMs too.
"""

from __future__ import annotations

import argparse
import time

import torch

from amp_compiler.loss_head import kernels


def eager_forward(z, top, sum_exp, at):
    z = z.float()
    new_top = torch.maximum(top, z.amax(1))
    picked = z.gather(1, at.clamp(0)[:, None]).squeeze(1)
    sum_exp.mul_((top - new_top).exp_()).add_(z.sub_(new_top[:, None]).clamp_min_(kernels.P_FLOOR).exp_().sum(1))
    return new_top, sum_exp, picked


def eager_backward(z, lse, g, at):
    dz = z.float().sub_(lse[:, None]).clamp_min_(kernels.P_FLOOR).exp_().mul_(g[:, None])
    dz.scatter_add_(1, at.clamp(0)[:, None], g[:, None])
    return dz.to(z.dtype)


def measure(size: int, std: float, reps: int) -> dict[str, float]:
    """Best-of-``reps`` milliseconds of each variant, interleaved."""
    g = torch.Generator().manual_seed(0)
    z32 = torch.randn(size, size, generator=g) * std
    z = z32.bfloat16()
    top, zeros = torch.full((size,), float("-inf")), torch.zeros(size)
    at = torch.randint(-1, size, (size,), generator=g)
    lse, grad = torch.logsumexp(z32, 1), torch.rand(size, generator=g)
    fold, dlogits = kernels.kernel(kernels.stats_block), kernels.kernel(kernels.grad_block)
    cases = {
        "forward, ATen calls": lambda: eager_forward(z, top, zeros.clone(), at),
        "forward, generated": lambda: fold(z, kernels.start_stats(size, z), at, (), False, (False, False, False)),
        "backward, ATen calls": lambda: eager_backward(z, lse, grad, at),
        "backward, generated": lambda: dlogits(z, lse, grad, zeros, grad, at, (), torch.bfloat16),
    }
    for run in cases.values():
        run(), run()
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(reps):
        for name, run in cases.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=2048, help="block rows = columns (default 2048)")
    parser.add_argument("--std", default="2,16", help="logit standard deviations, comma-separated")
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args(argv)
    print(f"one {args.size} x {args.size} block, BF16 logits, {torch.get_num_threads()} threads, best of {args.reps}")
    for std in map(float, args.std.split(",")):
        cells = ", ".join(f"{k} {v:.2f} ms" for k, v in measure(args.size, std, args.reps).items())
        print(f"logit std {std:g}: {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
