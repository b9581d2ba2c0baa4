"""``amp-compiler``: see the precision plan, find where precision hurts, run the demo.

    amp-compiler inspect pkg.module:factory [--format table|json|dot|html] [-o FILE]
    amp-compiler inspect path/to/file.py:factory --input 2x128:int64
    amp-compiler inspect model.onnx --ep cuda
    amp-compiler doctor pkg.module:factory [--policy-file amp-policy.json]
    amp-compiler calibrate pkg.module:factory -o amp-policy.json [--budget 1e-2]
    amp-compiler export pkg.module:factory -o model.onnx [--dtype bf16] [--target cuda]
    amp-compiler export pkg.module:factory -o decoder.onnx --task text-generation --target openvino
    amp-compiler demo
    amp-compiler env

Bad arguments, a missing file or a failing factory exit with status 2 and one
line on stderr; ``--traceback`` shows the full error instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .atomic import write_text
from .coverage import parameters_read
from .model_spec import ModelSpecError
from .options import AmpOptionsError


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
    try:
        write_text(path, text)
    except FileNotFoundError as e:
        raise CliError(str(e)) from None


def _options(args) -> dict:
    out = {"fp32_modules": args.fp32_module} if getattr(args, "fp32_module", None) else {}
    if getattr(args, "policy_file", None):
        out["policy_file"] = args.policy_file
    return out


def cmd_calibrate(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from .calibrate import calibrate
    from .model_spec import load_batches

    if args.batches < 1:
        raise CliError(f"--batches {args.batches}: need at least 1")
    if not args.budget > 0:
        raise CliError(f"--budget {args.budget}: must be a relative error > 0")
    if args.output and not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        raise CliError(f"cannot write {args.output!r}: its folder does not exist")
    model, batches = load_batches(args.target, args.input, args.batches)
    cal = calibrate(model, batches, dtype=args.dtype, budget=args.budget, options=_options(args))
    console = Console()
    table = Table(
        "option",
        "pattern",
        "error before",
        "error after",
        "reason",
        title=f"{args.target}: {cal.dtype}, budget {cal.budget:.1e}",
    )
    for p in cal.pins:
        table.add_row(p.option, p.pattern, f"{p.error_before:.2e}", f"{p.error_after:.2e}", p.reason)
    console.print(table)
    console.print(cal.summary())
    write_output(json.dumps(cal.to_dict(), indent=1), args.output)
    if args.output:
        console.print(f"wrote {args.output}")
    return 0


NOTHING_COMPILED = (
    "Dynamo compiled no graph of this model, so amp plans nothing: under torch.compile it runs "
    "as written, in FP32 (a forward marked torch.compiler.disable, or a graph break Dynamo "
    "gives up on; TORCH_LOGS=graph_breaks shows where)"
)


def cmd_inspect(args) -> int:
    if args.target.endswith(".onnx"):
        return _inspect_onnx(args)
    from .explain import trace
    from .model_spec import load_model
    from .render import floating, module_tree, to_dot, to_html

    model, margs, mkwargs = load_model(args.target, args.input)
    backend = trace(model, *margs, dtype=args.dtype, options=_options(args), **mkwargs)
    plan = backend.plan()
    if backend.compiled == 0 and args.format != "table":  # the table says it itself
        sys.stderr.write(f"amp-compiler: warning: {NOTHING_COMPILED}\n")
    used = parameters_read(model, margs, mkwargs) if backend.coverage.with_parameters else None
    partly = backend.coverage.parameters_outside_warning(model, used) if used is not None else None
    if partly:
        sys.stderr.write(f"amp-compiler: warning: {partly.removeprefix('amp: ')}\n")
    if args.format == "json":
        text = json.dumps(plan.to_dict(), indent=2)
    elif args.format == "dot":
        text = to_dot(backend.records)
    elif args.format == "html":
        text = to_html(backend.records, plan, f"amp plan: {args.target}")
    else:
        s = plan.summary()
        mib = "n/a (dynamic shapes)" if s["cast_bytes"] is None else f"{s['cast_bytes'] / 2**20:.3f} MiB"
        if backend.compiled == 0:
            listing = NOTHING_COMPILED
        elif args.nodes or args.all:
            listing = plan.format_table(None if args.all else floating)
        else:
            listing = _tree_text(module_tree(plan, f"amp plan: {args.target}"), args.output)
        text = "\n".join(
            [
                listing,
                "",
                "nodes per precision: " + ", ".join(f"{k} {v}" for k, v in s["nodes"].items()),
                f"casts inserted: {s['casts']}; bytes cast per step: {mib}",
                f"unknown ops: {s['unknown_ops'] or 'none'}",
            ]
        )
    write_output(text, args.output)
    return 0


def _tree_text(tree, path: str | None) -> str:
    """The tree as text: coloured for a terminal, plain for a file or a pipe."""
    import io

    from rich.console import Console

    buf = io.StringIO()
    colour = path is None and sys.stdout.isatty()
    Console(
        file=buf, force_terminal=colour, color_system="auto" if colour else None, width=None if colour else 120
    ).print(tree)
    return buf.getvalue().rstrip()


def _inspect_onnx(args) -> int:
    from .onnx_export.kernels import inspect_onnx

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
    from .model_spec import load_model

    model, margs, mkwargs = load_model(args.target, args.input)
    diagnosis = diagnose(model, margs, mkwargs, dtypes=tuple(args.dtype), options=_options(args))
    if args.format == "json":
        text = json.dumps(diagnosis_to_dict(diagnosis), indent=2)
    else:
        text = f"doctor: {args.target}\n" + format_diagnosis(diagnosis, top=args.top)
    write_output(text, args.output)
    return 0


def cmd_export(args) -> int:
    from .model_spec import load_model
    from .onnx_export import ExportError, export_decoder, export_onnx

    if not args.output.endswith(".onnx"):
        raise CliError(f"-o {args.output!r}: the output file must end in .onnx")
    model, margs, mkwargs = load_model(args.target, args.input, need_inputs=args.task == "forward")
    common = dict(dtype=args.dtype, target=args.target_ep, check=not args.no_check, opset=args.opset)
    if args.task == "text-generation":  # the model's own inputs are not used; the cache's are made
        if args.dynamic or args.low_precision_io:
            raise CliError(
                "--task text-generation makes batch and lengths dynamic itself; drop --dynamic/--low-precision-io"
            )
        export = lambda: export_decoder(model, args.output, **common, options=_options(args))  # noqa: E731
    else:
        dynamic = _dynamic_shapes(args.dynamic, margs, mkwargs) if args.dynamic else None
        export = lambda: export_onnx(  # noqa: E731
            model,
            margs,
            args.output,
            kwargs=mkwargs,
            dynamic_shapes=dynamic,
            low_precision_io=args.low_precision_io,
            options=_options(args),
            **common,
        )
    try:
        report = export()
    except ValueError as e:  # a refused dtype/target combination
        raise CliError(str(e)) from None
    except ExportError as e:
        sys.stderr.write(f"amp-compiler: export failed, nothing written: {e}\n")
        return 1
    print(report.format())
    return 0


def _dynamic_shapes(specs: list[str], args: tuple, kwargs: dict):
    """'0:batch' / '1:seq' / '1:seq:4094' (axis:name[:max]) applied to every tensor input,
    e.g. --dynamic 0:batch; the max for a model that bounds the dimension (its positions)."""
    from torch.export import Dim

    axes = {}
    for spec in specs:
        axis, _, rest = spec.partition(":")
        name, bounded, most = rest.partition(":")
        if not axis.isdigit() or not name.isidentifier() or (bounded and not most.isdigit()):
            raise CliError(f"--dynamic {spec!r}: write AXIS:NAME or AXIS:NAME:MAX, e.g. 0:batch or 1:seq:4096")
        axes[int(axis)] = Dim(name, max=int(most)) if most else Dim(name)

    def one(t):
        return {a: d for a, d in axes.items() if a < t.dim()} if hasattr(t, "dim") else None

    return tuple(one(a) for a in args) if not kwargs else {k: one(v) for k, v in kwargs.items()} if not args else None


def cmd_demo(args) -> int:
    from .demo import print_demo

    print_demo(steps=args.steps, dtype=args.dtype, inner=args.inner)
    return 0


def cmd_env(args) -> int:
    import importlib.metadata
    import platform

    import torch

    from . import upstream
    from .device import resolve_dtype
    from .upstream.aten import ABSENT
    from .version import __version__

    outside = upstream.torch_range_said()
    lines = [
        f"amp-compiler {__version__}, Python {platform.python_version()}",
        f"torch {torch.__version__} ({'outside' if outside else 'inside'} the tested range {upstream.tested_range()})",
    ]
    for name in ("transformers", "accelerate", "trl", "lightning", "onnx", "onnxruntime", "openvino"):
        try:
            lines.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            lines.append(f"{name} not installed")
    dtype, reason = resolve_dtype("auto", torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    lines.append(f'dtype="auto": {dtype} ({reason})')
    if ABSENT:
        lines.append(f"op table names this torch lacks (left out of the plan's tables): {', '.join(sorted(ABSENT))}")
    print("\n".join(lines))
    if outside:
        sys.stderr.write(f"amp-compiler: warning: {outside}\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="amp-compiler", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traceback", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in (_add_inspect, _add_doctor, _add_calibrate, _add_export, _add_demo, _add_env):
        add(sub)
    return parser


def _target_args(p) -> None:
    """What every command that loads a model takes."""
    p.add_argument(
        "target",
        help="pkg.module:factory or path/to/file.py:factory; the factory returns a model or (model, example_inputs)",
    )
    p.add_argument(
        "--input",
        action="append",
        metavar="SHAPE[:DTYPE]",
        help="example input, e.g. 2x128:int64 or 4x3x32x32 (repeatable)",
    )
    p.add_argument(
        "--fp32-module", action="append", metavar="REGEX", help="pin modules matching REGEX to FP32 (repeatable)"
    )
    p.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    p.add_argument("--policy-file", metavar="FILE", help="apply a calibrated policy file")


def _add_inspect(sub) -> None:
    p = sub.add_parser(
        "inspect",
        help="show the precision plan: per node precision, reason, casts",
        description="Show the precision plan of a model (or an ONNX file's dtypes).",
    )
    _target_args(p)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--format", choices=["table", "json", "dot", "html"], default="table")
    p.add_argument(
        "--nodes", action="store_true", help="list every node touching a floating tensor instead of the module tree"
    )
    p.add_argument("--all", action="store_true", help="list every node, integer plumbing too")
    p.add_argument(
        "--ep",
        choices=["cpu", "cuda"],
        default="cuda",
        help="ONNX Runtime provider whose kernels to check (ONNX targets)",
    )
    p.set_defaults(func=cmd_inspect)


def _add_doctor(sub) -> None:
    p = sub.add_parser(
        "doctor",
        help="run FP32 and amp side by side; find and pin what overflows",
        description="Compare FP32 and amp node by node in BF16 and FP16; report the "
        "largest errors, the first Inf/NaN or out-of-FP16-range output, and propose pins.",
    )
    _target_args(p)
    p.add_argument("--dtype", action="append", choices=["bf16", "fp16"], help="dtypes to run (default both)")
    p.add_argument("--format", choices=["text", "json"], default="text")
    p.add_argument("--top", type=int, default=5, help="how many worst nodes to list")
    p.set_defaults(func=cmd_doctor)


def _add_calibrate(sub) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure the model and write the FP32 pins it needs",
        description="Run FP32 and amp on N batches, pin (modules first) until every "
        "output is within the budget, and write the policy file.",
    )
    _target_args(p)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--budget", type=float, default=1e-2, help="largest relative output error")
    p.add_argument("--batches", type=int, default=4, help="batches drawn from the factory")
    p.set_defaults(func=cmd_calibrate)


def _add_export(sub) -> None:
    p = sub.add_parser(
        "export",
        help="export a BF16 inference graph to ONNX for ONNX Runtime or OpenVINO",
        description="Export the model through the amp plan to ONNX; checks structure, "
        "onnx.checker and numbers before the file appears.",
    )
    _target_args(p)
    p.set_defaults(output=None)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument(
        "--target",
        dest="target_ep",
        choices=["cuda", "cpu", "openvino"],
        default="cuda",
        help="runtime the graph is for: ONNX Runtime's CUDA or CPU provider, or OpenVINO "
        "Runtime on a CPU with native BF16 (settings written beside the file)",
    )
    p.add_argument(
        "--dynamic",
        action="append",
        metavar="AXIS:NAME[:MAX]",
        help="dynamic axis of every input, e.g. 0:batch or 1:seq:4096 (at most 4096; repeatable)",
    )
    p.add_argument(
        "--task",
        choices=["forward", "text-generation"],
        default="forward",
        help="forward: one call of the model as given; text-generation: a transformers causal LM "
        "with its KV cache as inputs and outputs (past_key_values.*/present.*), checked by generating",
    )
    p.add_argument("--opset", type=int, default=None)
    p.add_argument("--low-precision-io", action="store_true", help="keep inputs/outputs in 16 bit")
    p.add_argument("--no-check", action="store_true", help="skip the structure and parity checks")
    p.set_defaults(func=cmd_export)


def _add_demo(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="train a small built-in model in FP32 and with amp, side by side",
        description="Train a small transformer with FP32 and with the amp training "
        "step; print losses, the plan summary and the speed ratio.",
    )
    p.add_argument("--steps", type=int, default=100)
    p.add_argument(
        "--dtype",
        choices=["auto", "bf16", "fp16", "fp32"],
        default="auto",
        help="auto: what this machine runs fast (BF16, else FP16, else FP32)",
    )
    p.add_argument("--inner", choices=["inductor", "aot_eager", "eager"], default="inductor")
    p.set_defaults(func=cmd_demo)


def _add_env(sub) -> None:
    p = sub.add_parser(
        "env",
        help="print torch, the tested torch range and the integrations' versions",
        description="Print the versions amp runs with, whether torch is inside the tested range (a "
        "warning where it is not), the dtype 'auto' picks here, and op names this torch lacks.",
    )
    p.set_defaults(func=cmd_env)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "export" and not args.output:
        parser.error("export needs -o FILE.onnx")
    if getattr(args, "dtype", None) is None and args.command == "doctor":
        args.dtype = ["bf16", "fp16"]
    try:
        return args.func(args)
    except (CliError, ModelSpecError, AmpOptionsError) as e:
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
