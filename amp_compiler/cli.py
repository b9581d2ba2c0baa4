"""``amp-compiler``: see the precision plan, find where precision hurts, run the demo.

    amp-compiler inspect pkg.module:factory [--format table|json|dot|html] [-o FILE]
    amp-compiler inspect path/to/file.py:factory --input 2x128:int64
    amp-compiler inspect model.onnx --ep cuda
    amp-compiler doctor pkg.module:factory
    amp-compiler demo

Bad arguments, a missing file or a failing factory exit with status 2 and one
line on stderr; ``--traceback`` shows the full error instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from .options import AmpOptionsError
from .target import TargetError


class CliError(Exception):
    """A user error: one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + line
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        raise SystemExit(2)


def write_output(text: str, path: str | None) -> None:
    """Write to ``path`` atomically (a temp file renamed into place), or to stdout."""
    if path is None:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CliError(f"cannot write {path!r}: folder {folder!r} does not exist")
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".amp-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _options(args) -> dict:
    return {"fp32_modules": args.fp32_module} if getattr(args, "fp32_module", None) else {}


def cmd_inspect(args) -> int:
    if args.target.endswith(".onnx"):
        return _inspect_onnx(args)
    from .explain import trace
    from .render import to_dot, to_html
    from .target import load_target

    model, margs, mkwargs = load_target(args.target, args.input)
    backend = trace(model, *margs, dtype=args.dtype, options=_options(args), **mkwargs)
    plan = backend.plan()
    if args.format == "json":
        text = json.dumps(plan.to_dict(), indent=2)
    elif args.format == "dot":
        text = to_dot(backend.records)
    elif args.format == "html":
        text = to_html(backend.records, plan, f"amp plan: {args.target}")
    else:
        s = plan.summary()
        mib = "n/a (dynamic shapes)" if s["cast_bytes"] is None else f"{s['cast_bytes'] / 2**20:.3f} MiB"
        text = "\n".join([
            plan.format_table(), "",
            "nodes per precision: " + ", ".join(f"{k} {v}" for k, v in s["nodes"].items()),
            f"casts inserted: {s['casts']}; bytes cast per step: {mib}",
            f"unknown ops: {s['unknown_ops'] or 'none'}",
        ])
    write_output(text, args.output)
    return 0


def _inspect_onnx(args) -> int:
    from .ort_coverage import inspect_onnx

    if not os.path.isfile(args.target):
        raise CliError(f"no such file: {args.target!r}")
    try:
        report = inspect_onnx(args.target, args.ep)
    except Exception as e:
        raise CliError(f"cannot read {args.target!r} as ONNX: {type(e).__name__}: {e}") from None
    text = json.dumps(report.to_dict(), indent=2) if args.format == "json" else report.format()
    write_output(text, args.output)
    return 0


def cmd_doctor(args) -> int:
    from .doctor import diagnose, diagnosis_to_dict, format_diagnosis
    from .target import load_target

    model, margs, mkwargs = load_target(args.target, args.input)
    diagnosis = diagnose(model, margs, mkwargs, dtypes=tuple(args.dtype), options=_options(args))
    if args.format == "json":
        text = json.dumps(diagnosis_to_dict(diagnosis), indent=2)
    else:
        text = f"doctor: {args.target}\n" + format_diagnosis(diagnosis, top=args.top)
    write_output(text, args.output)
    return 0


def cmd_demo(args) -> int:
    from .demo import print_demo

    print_demo(steps=args.steps, dtype=args.dtype, inner=args.inner)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="amp-compiler", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traceback", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def target_args(p):
        p.add_argument("target", help="pkg.module:factory or path/to/file.py:factory; the factory "
                       "returns a model or (model, example_inputs)")
        p.add_argument("--input", action="append", metavar="SHAPE[:DTYPE]",
                       help="example input, e.g. 2x128:int64 or 4x3x32x32 (repeatable)")
        p.add_argument("--fp32-module", action="append", metavar="REGEX",
                       help="pin modules matching REGEX to FP32 (repeatable)")
        p.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")

    p = sub.add_parser("inspect", help="show the precision plan: per node precision, reason, casts",
                       description="Show the precision plan of a model (or an ONNX file's dtypes).")
    target_args(p)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--format", choices=["table", "json", "dot", "html"], default="table")
    p.add_argument("--ep", choices=["cpu", "cuda"], default="cuda",
                   help="ONNX Runtime provider whose kernels to check (ONNX targets)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("doctor", help="run FP32 and amp side by side; find and pin what overflows",
                       description="Compare FP32 and amp node by node in BF16 and FP16; report the "
                       "largest errors, the first Inf/NaN or out-of-FP16-range output, and propose pins.")
    target_args(p)
    p.add_argument("--dtype", action="append", choices=["bf16", "fp16"],
                   help="dtypes to run (default both)")
    p.add_argument("--format", choices=["text", "json"], default="text")
    p.add_argument("--top", type=int, default=5, help="how many worst nodes to list")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("demo", help="train a small built-in model in FP32 and with amp, side by side",
                       description="Train a small transformer with FP32 and with the amp training "
                       "step; print losses, the plan summary and the speed ratio.")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--dtype", choices=["bf16", "fp16", "auto"], default="bf16")
    p.add_argument("--inner", choices=["inductor", "aot_eager", "eager"], default="inductor")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "dtype", None) is None and args.command == "doctor":
        args.dtype = ["bf16", "fp16"]
    try:
        return args.func(args)
    except (CliError, TargetError, AmpOptionsError) as e:
        if args.traceback:
            raise
        sys.stderr.write(f"amp-compiler: error: {e}\n")
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if args.traceback:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        sys.stderr.write(f"amp-compiler: error: {type(e).__name__}: {first} (run with --traceback for details)\n")
        return 1
