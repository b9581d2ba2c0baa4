"""``export_onnx``: a BF16 inference graph for ONNX Runtime, from the same plan as training.

    torch.export (ATen, the tables' vocabulary) -> the amp pipeline (tag, casts, fold,
    verify) -> weights read only in 16 bit stored in 16 bit -> torch.onnx.export
    -> checks -> the file appears.

Everything is written into a temporary folder beside ``path`` and moved into
place only when export and checks succeeded, so a failure leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import os
import re
import shutil
import tempfile
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export.graph_signature import InputKind, OutputKind, TensorArgument
from torch.utils import _pytree as pytree

from amp_compiler.passes import PIPELINE, PassContext, run_pipeline
from amp_compiler.passes.decompose_attention import write_out_all
from amp_compiler.passes.graph_util import is_inserted_cast, refresh_vals

from .meta import META_KEY, NodeInfo
from .options import AmpOptions
from .ort_coverage import FLOAT_NAMES, ORT_VERSION, export_fp32_pins, has_kernel, value_types
from .plan import GraphPlan
from .policy import LOW_DTYPES, Precision

log = logging.getLogger("amp_compiler")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colour codes in the exporter's and ORT's messages
TARGETS = ("cuda", "cpu")
EXPORT_DTYPES = ("bf16", "fp16", "fp32")
# ONNX ops the policy keeps in FP32: a 16-bit one in the export breaks the plan.
FP32_ONNX_OPS = frozenset({"Softmax", "LogSoftmax", "LayerNormalization", "ReduceMean", "ReduceSum",
                           "ReduceProd", "ReduceL2", "ReduceLogSumExp", "BatchNormalization",
                           "GroupNormalization", "InstanceNormalization", "Exp", "Log", "Pow",
                           "Reciprocal", "CumSum", "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"})
LOW_ONNX_OPS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Attention"})


class ExportError(RuntimeError):
    """Export or its check failed; nothing was written."""


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

    @property
    def weight_ratio(self) -> float:
        return self.weight_bytes / max(self.fp32_weight_bytes, 1)

    def format(self) -> str:
        lines = [f"wrote {self.path}" + (f" (+ {self.data_path})" if self.data_path else ""),
                 f"  {self.dtype} for ORT {self.target.upper()} (kernel table {ORT_VERSION}), opset {self.opset}",
                 f"  weights {self.weight_bytes / 2**20:.2f} MiB = {self.weight_ratio:.2f}x the FP32 export",
                 f"  plan: {self.plan.summary()['nodes']}; {self.plan.summary()['casts']} casts",
                 f"  structure: {self.structure}"]
        if self.parity:
            lines.append(f"  parity ({self.parity.get('method')}): " + ", ".join(
                f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                for k, v in self.parity.items() if k != "method"))
        return "\n".join(lines)


def export_onnx(model: torch.nn.Module, args: tuple, path: str, *, kwargs: dict | None = None,
                dtype: str = "bf16", target: str = "cuda", dynamic_shapes: Any = None,
                opset: int | None = None, check: bool = True, low_precision_io: bool = False,
                options: dict | None = None, tolerance: float | None = None) -> ExportReport:
    """Export ``model(*args, **kwargs)`` for ONNX Runtime serving (see the module docstring).

    dtype: "bf16" (default), "fp16" or "fp32". target: "cuda" or "cpu" (ORT's CPU
    provider has no BF16 arithmetic: dtype="bf16" with target="cpu" is refused).
    Inputs and outputs stay FP32 unless ``low_precision_io``. ``check`` runs the
    structure check, onnx.checker (full) and a numeric parity check.
    """
    _validate(dtype, target)
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    kwargs = _in_signature_order(model, dict(kwargs or {}))
    opset = opset or 22  # BF16 Conv needs opset 22
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ExportError(f"cannot write {path!r}: folder {folder!r} does not exist")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            reference = model(*args, **kwargs)
        ep, plan, fp32_bytes = _planned_program(model, args, kwargs, dtype, target, dynamic_shapes,
                                                options, low_precision_io)
        tmp = tempfile.mkdtemp(dir=folder, prefix=".amp-export-")
        try:
            tmp_path = os.path.join(tmp, os.path.basename(path))
            _onnx_export(ep, args, kwargs, tmp_path, opset, dynamic_shapes,
                         _library_translations(model))
            report = ExportReport(path, None, dtype, target, opset, _initializer_bytes(tmp_path),
                                  fp32_bytes, plan)
            if check:
                report.structure = check_structure(tmp_path, dtype, target, plan)
                report.parity = check_parity(tmp_path, ep, args, kwargs, reference, dtype, target,
                                             tolerance)
            report.data_path = _move_into_place(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        model.train(was_training)
    log.info("amp export: %s", report.format())
    return report


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
            "its own casts), or target='cuda' for a BF16 GPU graph."
        )


def _planned_program(model, args, kwargs, dtype, target, dynamic_shapes, options, low_io):
    """torch.export the model, run the amp pipeline on it, store 16-bit-only weights in 16 bit."""
    try:
        # torch.distributions' argument checks are Python branches on values; torch.compile
        # turns them off for the whole process, so do the same here, for this call only
        validate = torch.distributions.Distribution._validate_args
        torch.distributions.Distribution.set_default_validate_args(False)
        try:
            ep = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
        finally:
            torch.distributions.Distribution.set_default_validate_args(validate)
    except Exception as e:
        raise ExportError(f"torch.export failed: {type(e).__name__}: {str(e).splitlines()[0]}"
                          f"{_export_hint(e)}") from e
    if dtype != "fp32":
        # The exporter lowers SDPA to MatMul/Softmax/MatMul; write it out first (as the
        # backend's pass does, in the fused op's memory layout, which views after it may
        # rely on) so the policy sees the softmax and keeps it FP32. The retrace also
        # canonicalises ops (split -> split_with_sizes) for the exporter.
        write_out_all(ep.graph_module)
        ep = ep.run_decompositions({})
    fp32_bytes = sum(t.numel() * 4 for t in _lifted_tensors(ep).values() if t.is_floating_point())
    gm = ep.graph_module
    if dtype == "fp32":
        for node in gm.graph.nodes:
            node.meta[META_KEY] = NodeInfo(Precision.FP32, "fp32 export: no rewrite")
        return ep, GraphPlan.from_graph(gm, 0, "fp32", "dtype='fp32' requested"), fp32_bytes
    opts = AmpOptions.from_mapping(options, dtype=dtype, low_precision_outputs=low_io)
    policy = opts.policy(LOW_DTYPES[dtype])
    if dtype == "bf16":
        policy = policy.with_fp32(export_fp32_pins(target))
    fake_mode = torch._guards.detect_fake_mode(
        [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"])
    ctx = PassContext(policy=policy, options=opts, fake_mode=fake_mode)
    try:
        run_pipeline(gm, ctx, PIPELINE)
    except Exception as e:
        raise ExportError(f"amp pipeline failed: {e}") from e
    _store_low_weights(ep, LOW_DTYPES[dtype], fake_mode)
    _sync_output_specs(ep)
    gm.recompile()
    return ep, GraphPlan.from_graph(gm, 0, dtype, f"export for {target}"), fp32_bytes


def _export_hint(error: Exception) -> str:
    """What to change in the model or the call, for the torch.export failures users meet."""
    message = str(error)
    if "Cache" in message:
        return " (a KV cache in the outputs: pass use_cache=False in kwargs)"
    if "data-dependent" in message:
        # the model's own line: the last frame outside torch and this package
        skip = (os.path.dirname(torch.__file__), os.path.dirname(__file__))
        user = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(skip)]
        at = f" at {user[-1].filename}:{user[-1].lineno}" if user else ""
        return (f" (the model branches on a tensor's value{at}, e.g. `if mask.any():` or "
                "`.item()`; torch.export traces one program for every input, so make that "
                "branch independent of the values or write it with torch.cond)")
    return ""


def _lifted_tensors(ep) -> dict[str, torch.Tensor]:
    """Placeholder name -> tensor for parameters, buffers and constants."""
    out = {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            out[spec.arg.name] = ep.state_dict[spec.target] if spec.target in ep.state_dict \
                else ep.constants[spec.target]
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            out[spec.arg.name] = ep.constants[spec.target]
    return out


def _store_low_weights(ep, low: torch.dtype, fake_mode) -> None:
    """A weight read only through casts to ``low`` (and by embedding lookups) is stored in ``low``.

    The casts go away; an embedding lookup of a 16-bit table gets its rows cast
    back to FP32, so the FP32 residual stream is unchanged (the table's values
    are rounded once, as any BF16 weight is).
    """
    graph = ep.graph_module.graph
    specs = {s.arg.name: s for s in ep.graph_signature.input_specs
             if s.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)}
    for node in [n for n in graph.nodes if n.op == "placeholder" and n.name in specs]:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dtype != torch.float32 or not node.users:
            continue
        casts = [u for u in node.users if is_inserted_cast(u) and u.kwargs["dtype"] == low]
        lookups = [u for u in node.users if u.target is torch.ops.aten.embedding.default
                   and u.args[0] is node]
        if len(casts) + len(lookups) != len(node.users) or not casts and not lookups:
            continue
        spec = specs[node.name]
        store = ep.state_dict if spec.target in ep.state_dict else ep.constants
        store[spec.target] = store[spec.target].detach().to(low)
        if spec.kind == InputKind.PARAMETER:
            store[spec.target] = torch.nn.Parameter(store[spec.target], requires_grad=False)
        with fake_mode:
            node.meta["val"] = torch.empty_like(val, dtype=low)
        for cast in casts:
            cast.replace_all_uses_with(node)
            graph.erase_node(cast)
        for lookup in lookups:
            with graph.inserting_after(lookup):
                up = graph.call_function(torch.ops.aten._to_copy.default, (lookup,),
                                         {"dtype": torch.float32})
            lookup.replace_all_uses_with(up, delete_user_cb=lambda n, up=up: n is not up)
            up.meta[META_KEY] = NodeInfo(Precision.FP32, "embedding rows from a 16-bit table, back to fp32",
                                         inserted=True, planned=torch.float32, orig=torch.float32)
            up.meta["val"] = lookup.meta["val"]
    refresh_vals(ep.graph_module, fake_mode)
    graph.lint()


def _sync_output_specs(ep) -> None:
    """Outputs may now be casts: point the signature's user outputs at them."""
    out = next(n for n in ep.graph_module.graph.nodes if n.op == "output")
    for spec, arg in zip(ep.graph_signature.output_specs, out.args[0]):
        if spec.kind == OutputKind.USER_OUTPUT and isinstance(arg, torch.fx.Node):
            spec.arg = TensorArgument(name=arg.name)


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
    for ATen ops torchlib's translation stays the one the plan was checked against.
    """
    if not type(model).__module__.startswith("transformers."):
        return {}
    try:
        from transformers.exporters.exporter_onnx import _ONNX_TRANSLATION_TABLE as table
    except Exception:  # older transformers, or onnxscript missing: nothing to add
        return {}
    return {op: fn for op, fn in table.items()
            if getattr(op, "namespace", "aten") not in ("aten", "prims")}


def _onnx_export(ep, args, kwargs, path, opset, dynamic_shapes, translations=None) -> None:
    try:
        # optimize=False: the exporter's BatchNorm folding can write FP32 weights into a BF16 Conv.
        # Its progress lines go to stdout; keep them out of ours.
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings(), \
                _quiet("torch.onnx", "onnx_ir", "onnxscript"):
            warnings.simplefilter("ignore")
            torch.onnx.export(ep, args, path, kwargs=kwargs, dynamo=True, opset_version=opset,
                              dynamic_shapes=dynamic_shapes, optimize=False, external_data=True,
                              verbose=False, custom_translation_table=translations or None)
    except Exception as e:
        missing = re.search(r"No ONNX function found for <OpOverload\(op='([\w.]+)'", str(e))
        if missing:  # the one cause a user can act on
            raise ExportError(
                f"torch.onnx.export failed: ONNX has no translation for {missing.group(1)}, which "
                "the model computes; export a forward that does not need it (e.g. without the "
                "inputs that make the model compute its loss)") from e
        first = _ANSI.sub("", str(e).splitlines()[0])  # the exporter's colours
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
    data = None
    for name in os.listdir(tmp):
        src = os.path.join(tmp, name)
        if name == os.path.basename(path):
            continue
        dest = os.path.join(os.path.dirname(os.path.abspath(path)), name)
        os.replace(src, dest)
        data = dest
    os.replace(os.path.join(tmp, os.path.basename(path)), path)
    return data


# ---- checks ---------------------------------------------------------------------------------

def check_structure(path: str, dtype: str, target: str, plan: GraphPlan) -> dict:
    """onnx.checker (full), every node's dtypes against the plan, and the target's kernels."""
    import onnx
    from onnx import TensorProto

    try:
        onnx.checker.check_model(path, full_check=True)
    except Exception as e:
        raise ExportError(f"onnx.checker rejected the export: {str(e).splitlines()[0]}") from e
    model = onnx.load(path, load_external_data=False)
    types = value_types(model)
    low = {"bf16": TensorProto.BFLOAT16, "fp16": TensorProto.FLOAT16}.get(dtype)
    low_mm, fp32_mm, problems = 0, 0, []
    for node in model.graph.node:
        ins = [types.get(x) for x in node.input if x]
        node_dtype = FLOAT_NAMES.get(ins[0] if ins else None, "-")
        if node.op_type in LOW_ONNX_OPS:
            if low is not None and all(t == low for t in ins):
                low_mm += 1
            else:
                fp32_mm += 1
        if low is not None and node.op_type in FP32_ONNX_OPS and any(t == low for t in ins):
            problems.append(f"{node.name or node.output[0]} ({node.op_type}) takes {dtype} inputs; "
                            "the plan keeps it FP32")
        if not has_kernel(node.op_type, node_dtype, target):
            problems.append(f"{node.name or node.output[0]} ({node.op_type}, {node_dtype}) has no "
                            f"kernel on ORT {ORT_VERSION} {target.upper()}")
    planned_low = plan.summary()["nodes"]["LOW"]
    if low is not None and planned_low and not low_mm:
        problems.append(f"the plan has {planned_low} LOW ops but no MatMul/Gemm/Conv takes {dtype} inputs")
    if problems:
        raise ExportError("export does not follow the plan: " + "; ".join(problems[:5]))
    return {"low_matmul_conv": low_mm, "fp32_matmul_conv": fp32_mm, "checker": "full_check passed"}


def _in_signature_order(model, kwargs: dict) -> dict:
    """Keyword inputs in the order of ``forward``'s parameters, as torch.export lists them."""
    try:
        names = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return kwargs
    return {k: kwargs[k] for k in names if k in kwargs} | kwargs


def _flat_user_inputs(ep, args, kwargs) -> dict[str, torch.Tensor]:
    """ONNX input name -> tensor, in the exported program's input order."""
    flat = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    user = [s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    return dict(zip(user, flat))


def _ort_run(model_or_path, feeds: dict, providers: list[str], disable_opt: bool) -> list:
    import onnxruntime as ort

    so = ort.SessionOptions()
    if disable_opt:  # never let ORT remove the rounding casts
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if providers == ["CUDAExecutionProvider"]:
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    data = model_or_path if isinstance(model_or_path, str) else model_or_path.SerializeToString()
    try:
        sess = ort.InferenceSession(data, so, providers=providers)
        names = {i.name for i in sess.get_inputs()}
        return sess.run(None, {k: v.detach().cpu().numpy() for k, v in feeds.items() if k in names})
    except Exception as e:  # ORT's own exception types; none is an ExportError
        raise ExportError(_ort_failure(e, providers[0])) from e


_RANDOM_ONNX_OPS = {"RandomUniform", "RandomUniformLike", "RandomNormal", "RandomNormalLike",
                    "Multinomial", "Bernoulli"}


def _ort_failure(e: Exception, provider: str) -> str:
    said = _ANSI.sub("", str(e)).strip()
    return (f"ONNX Runtime's {provider} could not run the exported graph: {said}. Nothing was "
            "written; `amp-compiler inspect <file>.onnx --ep cpu|cuda` on an export made with "
            "check=False (--no-check) lists the nodes the provider has no kernel for")


def _refuse_random(model) -> None:
    """A forward that samples at inference has no output to compare: say so before ORT runs."""
    random = Counter(n.op_type for n in model.graph.node if n.op_type in _RANDOM_ONNX_OPS)
    if random:
        ops = ", ".join(f"{op} x{k}" for op, k in sorted(random.items()))
        raise ExportError(
            f"the exported forward draws random numbers at inference ({ops}; dropout is off in "
            "eval mode, so the model samples by itself, e.g. Informer's ProbSparse attention), so "
            "its outputs cannot be checked against PyTorch's. Make the forward deterministic in "
            "eval mode (or behind a flag), or export with check=False (--no-check) to write the "
            "file unchecked")


def _inner_control(model, feeds: dict, limit: int = 64) -> str:
    """The rounding control on up to ``limit`` 16-bit MatMul/Gemm/Conv outputs, in words.

    Raises when those exist and rounding changes none of them: then the
    emulation, not the model, is broken.
    """
    from onnx import TensorProto, helper

    types = value_types(model)
    low = (TensorProto.BFLOAT16, TensorProto.FLOAT16)
    names = [o for n in model.graph.node if n.op_type in LOW_ONNX_OPS
             for o in n.output if types.get(o) in low][:limit]
    if not names:
        return "outputs insensitive to rounding and no 16-bit matmul/conv in the graph: nothing to control"
    runs = []
    for round_values in (True, False):
        m = emulate_low(model, round_values=round_values)
        m.graph.output.extend(helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in names)
        runs.append(_ort_run(m, feeds, ["CPUExecutionProvider"], disable_opt=True)[-len(names):])
    diff = _max_err(runs[0], [torch.as_tensor(p) for p in runs[1]])[0]
    if diff == 0.0:
        raise ExportError("parity check is not measuring BF16: rounded and unrounded runs agree "
                          f"on the outputs and on {len(names)} 16-bit matmul/conv values inside")
    return (f"outputs insensitive to BF16 rounding; rounding measured on {len(names)} 16-bit "
            f"matmul/conv values inside (max diff {diff:.3g})")


def emulate_low(model, round_values: bool = True):
    """An FP32 copy of a BF16/FP16 ONNX model that ORT CPU can run.

    Every 16-bit value becomes FP32; with ``round_values`` each one is rounded
    through Cast(16-bit) -> Cast(fp32) where it is produced, so the numbers are
    those of 16-bit storage with FP32 arithmetic inside each op (what tensor
    cores do). Run it with graph optimisations off.
    """
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    types = value_types(model)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    low_types = (TensorProto.BFLOAT16, TensorProto.FLOAT16)
    g = m.graph
    for i, init in enumerate(g.initializer):
        if init.data_type in low_types:
            arr = numpy_helper.to_array(init).astype(np.float32)
            g.initializer[i].CopyFrom(numpy_helper.from_array(arr, init.name))
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.type.tensor_type.elem_type in low_types:
            vi.type.tensor_type.elem_type = TensorProto.FLOAT
    nodes = []
    for node in g.node:
        low_outs = [o for o in node.output if types.get(o) in low_types]
        for a in node.attribute:
            if node.op_type == "Cast" and a.name == "to" and a.i in low_types:
                a.i = TensorProto.FLOAT
            if node.op_type == "Constant" and a.name == "value" and a.t.data_type in low_types:
                a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float32)))
        if not round_values or not low_outs:
            nodes.append(node)
            continue
        renamed = {o: f"{o}__unrounded" for o in low_outs}
        node.output[:] = [renamed.get(o, o) for o in node.output]
        nodes.append(node)
        for o in low_outs:
            to = types[o]
            nodes.append(helper.make_node("Cast", [renamed[o]], [f"{o}__low"], to=to))
            nodes.append(helper.make_node("Cast", [f"{o}__low"], [o], to=TensorProto.FLOAT))
    del g.node[:]
    g.node.extend(nodes)
    del g.value_info[:]
    return m


def _max_err(got: list, want: list) -> tuple[float, float]:
    abs_err, rel_err = 0.0, 0.0
    for g, w in zip(got, want):
        g, w = torch.as_tensor(g).double(), w.detach().double()
        if g.shape != w.shape:
            raise ExportError(f"output shape {tuple(g.shape)} differs from PyTorch's {tuple(w.shape)}")
        err = (g - w).abs().max().item() if g.numel() else 0.0
        abs_err = max(abs_err, err)
        # relative to the output's own scale, however small (random-init MobileNetV2's logits
        # are ~1e-27: a fixed floor would pass any error there); all zeros: absolute
        scale = w.abs().max().item() if w.numel() else 0.0
        rel_err = max(rel_err, err / scale if scale > 0 else err)
    return abs_err, rel_err


def check_parity(path, ep, args, kwargs, reference, dtype, target, tolerance=None) -> dict:
    """Run the export and compare with PyTorch in FP32 and with the amp plan in PyTorch.

    On a CUDA machine with onnxruntime-gpu: the real graph on the CUDA provider,
    CPU fallback disabled. Otherwise, for BF16: the emulated copy on ORT CPU
    (``emulate_low``), plus a negative control showing the rounding is real.
    """
    import onnx
    import onnxruntime as ort

    feeds = _flat_user_inputs(ep, args, kwargs)
    want = [t for t in pytree.tree_leaves(reference) if isinstance(t, torch.Tensor)]
    with torch.no_grad():
        amp_out = [t.float() for t in pytree.tree_leaves(ep.module()(*args, **kwargs))
                   if isinstance(t, torch.Tensor)]
    tol = tolerance if tolerance is not None else {"bf16": 0.05, "fp16": 0.01, "fp32": 1e-4}[dtype]
    cuda = "CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available()
    result: dict[str, Any] = {}
    emulate = dtype == "bf16" and not (cuda and target == "cuda")
    model = onnx.load(path, load_external_data=emulate)  # the weights only where ORT runs a copy
    _refuse_random(model)
    if emulate:
        got = _ort_run(emulate_low(model), feeds, ["CPUExecutionProvider"], disable_opt=True)
        plain = _ort_run(emulate_low(model, round_values=False), feeds, ["CPUExecutionProvider"],
                         disable_opt=True)
        control = _max_err(got, [torch.as_tensor(p) for p in plain])[0]
        result["method"] = "ORT CPU, BF16 emulated by Cast rounding (optimisations off)"
        result["negative_control_diff"] = control
        if control == 0.0:
            # Outputs can be blind to rounding (a classifier at init saturates); then
            # the control is measured on the 16-bit matmul/conv outputs inside.
            result["negative_control"] = _inner_control(model, feeds)
    else:
        providers = ["CUDAExecutionProvider"] if cuda and target == "cuda" else ["CPUExecutionProvider"]
        got = _ort_run(path, feeds, providers, disable_opt=False)
        result["method"] = f"ORT {providers[0]}" + (", CPU fallback disabled" if cuda else "")
    result["vs_fp32_max_abs"], result["vs_fp32_max_rel"] = _max_err(got, want)
    result["vs_amp_torch_max_abs"], result["vs_amp_torch_max_rel"] = _max_err(got, amp_out)
    result["tolerance_rel"] = tol
    if result["vs_fp32_max_rel"] > tol:
        raise ExportError(f"export differs from the FP32 model by {result['vs_fp32_max_rel']:.3g} "
                          f"(relative to the largest output), above {tol} for {dtype}")
    return result
