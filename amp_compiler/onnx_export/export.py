"""``export_onnx``: plan, write into a temporary folder, check, then move into place."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..plan import GraphPlan
from .base import ANSI, EXPORT_DTYPES, TARGETS, ExportError
from .kernels import ORT_VERSION
from .openvino import fewer_conversions, refuse_without_native_bf16, write_settings
from .openvino import settings_path as openvino_settings
from .parity import check_parity
from .program import in_signature_order, planned_program
from .structure import check_structure

log = logging.getLogger("amp_compiler")


@dataclass
class ExportReport:
    path: str
    data_path: str | None
    dtype: str
    target: str
    opset: int
    weight_bytes: int
    fp32_weight_bytes: int
    plan: GraphPlan
    structure: dict = field(default_factory=dict)
    parity: dict = field(default_factory=dict)
    settings_path: str | None = None  # OpenVINO's session settings, beside the file

    @property
    def weight_ratio(self) -> float:
        return self.weight_bytes / max(self.fp32_weight_bytes, 1)

    def format(self) -> str:
        runtime = f"ORT {self.target.upper()} (kernel table {ORT_VERSION})"
        if self.target == "openvino":
            runtime = "OpenVINO CPU"
        lines = [
            f"wrote {self.path}" + (f" (+ {self.data_path})" if self.data_path else ""),
            f"  {self.dtype} for {runtime}, opset {self.opset}",
            f"  weights {self.weight_bytes / 2**20:.2f} MiB = {self.weight_ratio:.2f}x the FP32 export",
            f"  plan: {self.plan.summary()['nodes']}; {self.plan.summary()['casts']} casts",
            f"  structure: {self.structure}",
        ]
        if self.parity:
            lines.append(
                f"  parity ({self.parity.get('method')}): "
                + ", ".join(
                    f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                    for k, v in self.parity.items()
                    if k != "method"
                )
            )
        if self.settings_path:
            lines.append(
                f"  serve: openvino.Core().compile_model({self.path!r}, 'CPU', "
                f"json.load(open({self.settings_path!r})))  # or amp_compiler.compile_openvino(path)"
            )
        return "\n".join(lines)


def export_onnx(
    model: torch.nn.Module,
    args: tuple,
    path: str,
    *,
    kwargs: dict | None = None,
    dtype: str = "bf16",
    target: str = "cuda",
    dynamic_shapes: Any = None,
    opset: int | None = None,
    check: bool = True,
    low_precision_io: bool = False,
    options: dict | None = None,
    tolerance: float | None = None,
) -> ExportReport:
    """Export ``model(*args, **kwargs)`` for ONNX Runtime serving (see the module docstring).

    dtype: "bf16" (default), "fp16" or "fp32". target: "cuda" or "cpu" for ONNX Runtime's
    provider (its CPU provider has no BF16 arithmetic: dtype="bf16" with target="cpu" is
    refused), or "openvino" for OpenVINO Runtime on a CPU with native BF16: the session
    settings that keep the plan's precision are written beside the file
    (``model.openvino.json``) and the check runs the file there, reading back the
    precision each node executes in.
    Inputs and outputs stay FP32 unless ``low_precision_io``. ``check`` runs the
    structure check, onnx.checker (full) and a numeric parity check.
    """
    preflight(path, dtype, target, check)
    return export_checked(
        model,
        args,
        path,
        kwargs=kwargs,
        dtype=dtype,
        target=target,
        dynamic_shapes=dynamic_shapes,
        opset=opset,
        check=check,
        low_precision_io=low_precision_io,
        options=options,
        tolerance=tolerance,
        simplify=fewer_conversions if target == "openvino" and dtype != "fp32" else None,
    )


def export_checked(
    model: torch.nn.Module,
    args: tuple,
    path: str,
    *,
    kwargs: dict | None,
    dtype: str,
    target: str,
    dynamic_shapes: Any,
    opset: int | None,
    check: bool,
    low_precision_io: bool,
    options: dict | None,
    tolerance: float | None,
    io_names: tuple[list[str], list[str]] | None = None,
    more_checks: Callable[[str, ExportReport], None] | None = None,
    simplify: Callable[[str], None] | None = None,
    fused_attention: bool = False,
    beside: Callable[[str], None] | None = None,
) -> ExportReport:
    """``export_onnx``, with the graph's inputs and outputs named ``io_names`` (ONNX's names
    for the flattened inputs, outputs), ``simplify(file)`` rewriting the written file in place
    before the checks, ``beside(file)`` writing more files beside it (they move into place
    with it), and ``more_checks(file, report)`` run on it after the checks, before it is
    moved into place (raising ExportError keeps it out). The caller ran ``preflight``."""
    folder = os.path.dirname(os.path.abspath(path))
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    kwargs = in_signature_order(model, dict(kwargs or {}))
    opset = opset or 22  # BF16 Conv needs opset 22
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            reference = model(*args, **kwargs)
        ep, plan, fp32_bytes = planned_program(
            model,
            args,
            kwargs,
            dtype,
            target,
            dynamic_shapes,
            options,
            low_precision_io,
            fused_attention,
        )
        tmp = tempfile.mkdtemp(dir=folder, prefix=".amp-export-")
        try:
            tmp_path = os.path.join(tmp, os.path.basename(path))
            _onnx_export(
                ep,
                args,
                kwargs,
                tmp_path,
                opset,
                dynamic_shapes,
                _library_translations(model),
                io_names,
            )
            if simplify is not None:
                simplify(tmp_path)
            report = ExportReport(
                path,
                None,
                dtype,
                target,
                opset,
                _initializer_bytes(tmp_path),
                fp32_bytes,
                plan,
            )
            if target == "openvino":
                report.settings_path = write_settings(tmp_path)
            if beside is not None:
                beside(tmp_path)
            if check:
                report.structure = check_structure(tmp_path, dtype, target, plan)
                names = io_names[0] if io_names else None
                report.parity = check_parity(tmp_path, ep, args, kwargs, reference, dtype, target, tolerance, names)
                if more_checks is not None:
                    more_checks(tmp_path, report)
            report.data_path = _move_into_place(tmp, path)
            if report.settings_path:
                report.settings_path = openvino_settings(path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        model.train(was_training)
    log.info("amp export: %s", report.format())
    return report


def preflight(path: str, dtype: str, target: str, check: bool) -> None:
    """Refuse, before any work, what no export could do: a dtype/target pair that cannot be
    served, a BF16 check on a CPU that cannot run it, a folder that is not there."""
    _validate(dtype, target)
    if target == "openvino" and dtype == "bf16" and check:
        refuse_without_native_bf16(doing="check a BF16 export for OpenVINO")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ExportError(f"cannot write {path!r}: folder {folder!r} does not exist")


def _validate(dtype: str, target: str) -> None:
    if target not in TARGETS:
        raise ValueError(f"target={target!r} is not valid; use one of {TARGETS}")
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not valid for export; use one of {EXPORT_DTYPES}")
    if dtype == "bf16" and target == "cpu":
        raise ValueError(
            "ONNX Runtime's CPU provider cannot run BF16 arithmetic (MatMul, Add, Softmax... have no "
            "BF16 kernels; the session fails to load), so a BF16 graph for target='cpu' would be a "
            "broken file. Use dtype='fp32' (runs everywhere), dtype='fp16' (ORT CPU runs it through "
            "its own casts), target='openvino' (OpenVINO Runtime serves BF16 on CPUs with native "
            "BF16), or target='cuda' for a BF16 GPU graph."
        )
    if dtype == "fp16" and target == "openvino":
        raise ValueError(
            "target='openvino' serves dtype='bf16' (CPUs with AVX512-BF16 or AMX) or dtype='fp32'; "
            "OpenVINO's CPU plugin has FP16 arithmetic only on CPUs with AVX512-FP16"
        )


@contextlib.contextmanager
def _quiet(*loggers: str):
    """The exporter's own progress and signature-inference chatter is not the user's business."""
    saved = [(logging.getLogger(n), logging.getLogger(n).level) for n in loggers]
    for lg, _ in saved:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in saved:
            lg.setLevel(level)


def _library_translations(model: torch.nn.Module) -> dict:
    """ONNX translations the model's own library ships for its custom operators.

    transformers' MoE experts run as ``torch.ops.transformers.grouped_mm_fallback``, which
    only transformers knows how to write in ONNX. Only ops outside ``aten`` are taken:
    for ATen ops torchlib's translation stays the one the plan was checked against. The
    model may hold the transformers model inside a wrapper (the generation export's).
    """
    if not any(type(m).__module__.startswith("transformers.") for m in model.modules()):
        return {}
    try:
        from transformers.exporters.exporter_onnx import (
            _ONNX_TRANSLATION_TABLE as table,
        )
    except Exception:  # older transformers, or onnxscript missing: nothing to add
        return {}
    return {op: fn for op, fn in table.items() if getattr(op, "namespace", "aten") not in ("aten", "prims")}


def _onnx_export(ep, args, kwargs, path, opset, dynamic_shapes, translations=None, io_names=None) -> None:
    try:
        # optimize=False: the exporter's BatchNorm folding can write FP32 weights into a BF16 Conv.
        # Its progress lines go to stdout; keep them out of ours.
        with (
            contextlib.redirect_stdout(io.StringIO()),
            warnings.catch_warnings(),
            _quiet("torch.onnx", "onnx_ir", "onnxscript"),
        ):
            warnings.simplefilter("ignore")
            torch.onnx.export(
                ep,
                args,
                path,
                kwargs=kwargs,
                dynamo=True,
                opset_version=opset,
                dynamic_shapes=dynamic_shapes,
                optimize=False,
                external_data=True,
                verbose=False,
                custom_translation_table=translations or None,
                input_names=io_names[0] if io_names else None,
                output_names=io_names[1] if io_names else None,
            )
    except Exception as e:
        missing = re.search(r"No ONNX function found for <OpOverload\(op='([\w.]+)'", str(e))
        if missing:  # the one cause a user can act on
            raise ExportError(
                f"torch.onnx.export failed: ONNX has no translation for {missing.group(1)}, which "
                "the model computes; export a forward that does not need it (e.g. without the "
                "inputs that make the model compute its loss)"
            ) from e
        first = ANSI.sub("", str(e).splitlines()[0])  # the exporter's colours
        raise ExportError(f"torch.onnx.export failed: {type(e).__name__}: {first}") from e


def _initializer_bytes(path: str) -> int:
    import onnx

    model = onnx.load(path, load_external_data=True)
    total = 0
    for init in model.graph.initializer:
        arr = onnx.numpy_helper.to_array(init)
        total += arr.nbytes
    return total


def _move_into_place(tmp: str, path: str) -> str | None:
    """Every file beside the graph first (its weights, its settings), the graph last."""
    data = None
    for name in os.listdir(tmp):
        src = os.path.join(tmp, name)
        if name == os.path.basename(path):
            continue
        dest = os.path.join(os.path.dirname(os.path.abspath(path)), name)
        os.replace(src, dest)
        if name.endswith(".data"):
            data = dest
    os.replace(os.path.join(tmp, os.path.basename(path)), path)
    return data
