"""``amp-compiler`` / ``python -m amp_compiler``: command-line entry."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    def progress(name, step, loss):
        if step % 20 == 0 or step == args.steps - 1:
            print(f"  [{name}] step {step:4d}  loss {loss:.4f}", flush=True)

    print(f"Training a small transformer for {args.steps} steps, FP32 vs amp ({args.dtype}), "
          f"inner compiler: {args.inner}")
    out = run_demo(steps=args.steps, dtype=args.dtype, inner=args.inner, progress=progress)
    print("\nPrecision plan:", out["plan"].format_summary())
    print(f"\n{'run':<10} {'final loss':>10} {'accuracy':>9} {'ms/step':>8}")
    for r in out["results"]:
        print(f"{r.name:<10} {r.loss:>10.4f} {r.accuracy:>9.3f} {r.seconds_per_step * 1e3:>8.1f}")
    print(f"\namp speed vs FP32: {out['speedup']:.2f}x (same process, side by side); "
          f"parameters FP32: {out['params_fp32']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="amp-compiler", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small built-in model in FP32 and with amp, side by side")
    demo.add_argument("--steps", type=int, default=100)
    demo.add_argument("--dtype", choices=["bf16", "fp16", "auto"], default="bf16")
    demo.add_argument("--inner", choices=["inductor", "aot_eager", "eager"], default="inductor")
    demo.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
