"""Side-by-side training-step benchmark: FP32 vs torch.autocast vs amp, in one process.

    python tools/bench.py [--d 512] [--layers 4] [--batch 8] [--seq 128] [--steps 10]

Prints ms/step and the ratio to FP32 eager for each variant. Variants run one
after another in the same process; compare ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time

import torch

from amp_compiler import AmpBackend
from amp_compiler.demo import DemoLM, batch


def time_steps(model, fn, ids, targets, steps, autocast=False):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
    for i in range(steps + 2):
        if i == 2:
            t0 = time.perf_counter()
        with ctx():
            loss, _ = fn(ids, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return (time.perf_counter() - t0) / steps * 1e3, loss.item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args()
    torch.manual_seed(0)
    base = DemoLM(vocab=256, d=a.d, heads=8, layers=a.layers, seq=a.seq)
    ids, targets = batch(torch.Generator().manual_seed(0), a.batch, a.seq, 256)
    variants = [
        ("fp32 eager", lambda m: m, False),
        ("autocast bf16 eager", lambda m: m, True),
        ("fp32 inductor", lambda m: torch.compile(m), False),
        ("autocast bf16 inductor", lambda m: torch.compile(m), True),
        ("amp bf16 (inductor)", lambda m: torch.compile(m, backend=AmpBackend()), False),
    ]
    print(f"training step, {a.layers}-layer pre-LN transformer d={a.d}, batch {a.batch}x{a.seq}, "
          f"{torch.get_num_threads()} threads")
    ref = None
    for name, wrap, autocast in variants:
        model = copy.deepcopy(base)
        ms, loss = time_steps(model, wrap(model), ids, targets, a.steps, autocast)
        ref = ref or ms
        print(f"  {name:<24} {ms:8.1f} ms/step   {ref / ms:5.2f}x vs fp32 eager   loss {loss:.4f}",
              flush=True)


if __name__ == "__main__":
    main()
