"""Numbers: the exported graph run on ONNX Runtime against the model and the amp plan.

On a CUDA machine the real graph on the CUDA provider (CPU fallback disabled); on CPU an
emulated copy where every 16-bit value is rounded through Cast pairs, with a negative
control (the unrounded copy must differ).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from typing import Any

import torch
from torch.export.graph_signature import InputKind

from ..upstream.torch_private import pytree
from .base import ANSI, ExportError
from .emulation import emulate_low
from .kernels import value_types
from .structure import LOW_ONNX_OPS

log = logging.getLogger("amp_compiler")


def _flat_user_inputs(ep, args, kwargs, names=None) -> dict[str, torch.Tensor]:
    """ONNX input name -> tensor, in the exported program's input order (``names``: the
    names the export gave the inputs, where it named them)."""
    flat = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    user = names or [s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
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


_RANDOM_ONNX_OPS = {
    "RandomUniform",
    "RandomUniformLike",
    "RandomNormal",
    "RandomNormalLike",
    "Multinomial",
    "Bernoulli",
}


def _ort_failure(e: Exception, provider: str) -> str:
    said = ANSI.sub("", str(e)).strip()
    return (
        f"ONNX Runtime's {provider} could not run the exported graph: {said}. Nothing was "
        "written; `amp-compiler inspect <file>.onnx --ep cpu|cuda` on an export made with "
        "check=False (--no-check) lists the nodes the provider has no kernel for"
    )


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
            "file unchecked"
        )


def _inner_control(model, feeds: dict, limit: int = 64) -> str:
    """The rounding control on up to ``limit`` 16-bit MatMul/Gemm/Conv outputs, in words.

    Raises when those exist and rounding changes none of them: then the
    emulation, not the model, is broken.
    """
    from onnx import TensorProto, helper

    types = value_types(model)
    low = (TensorProto.BFLOAT16, TensorProto.FLOAT16)
    names = [o for n in model.graph.node if n.op_type in LOW_ONNX_OPS for o in n.output if types.get(o) in low][:limit]
    if not names:
        return "outputs insensitive to rounding and no 16-bit matmul/conv in the graph: nothing to control"
    runs = []
    for round_values in (True, False):
        m = emulate_low(model, round_values=round_values)
        m.graph.output.extend(helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in names)
        runs.append(_ort_run(m, feeds, ["CPUExecutionProvider"], disable_opt=True)[-len(names) :])
    diff = _max_err(runs[0], [torch.as_tensor(p) for p in runs[1]])[0]
    if diff == 0.0:
        raise ExportError(
            "parity check is not measuring BF16: rounded and unrounded runs agree "
            f"on the outputs and on {len(names)} 16-bit matmul/conv values inside"
        )
    return (
        f"outputs insensitive to BF16 rounding; rounding measured on {len(names)} 16-bit "
        f"matmul/conv values inside (max diff {diff:.3g})"
    )


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


def ort_cuda() -> bool:
    """Whether ONNX Runtime's CUDA provider and a CUDA device are both here."""
    try:
        import onnxruntime as ort
    except ImportError:
        return False
    return "CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available()


def check_parity(path, ep, args, kwargs, reference, dtype, target, tolerance=None, names=None) -> dict:
    """Run the export and compare with PyTorch in FP32 and with the amp plan in PyTorch.

    For OpenVINO: the real graph on its CPU plugin (``_openvino_parity``). On a CUDA machine
    with onnxruntime-gpu: the real graph on the CUDA provider, CPU fallback disabled.
    Otherwise, for BF16: the emulated copy on ORT CPU (``emulate_low``), plus a negative
    control showing the rounding is real.
    """
    feeds = _flat_user_inputs(ep, args, kwargs, names)
    want = [t for t in pytree.tree_leaves(reference) if isinstance(t, torch.Tensor)]
    with torch.no_grad():
        amp_out = [t.float() for t in pytree.tree_leaves(ep.module()(*args, **kwargs)) if isinstance(t, torch.Tensor)]
    tol = tolerance if tolerance is not None else {"bf16": 0.05, "fp16": 0.01, "fp32": 1e-4}[dtype]
    result: dict[str, Any] = {}
    if target == "openvino":  # needs no ONNX Runtime
        got = _openvino_parity(path, feeds, dtype, result)
        return _judged(result, got, want, amp_out, dtype, tol)
    import onnx

    cuda = ort_cuda()
    emulate = dtype == "bf16" and not (cuda and target == "cuda")
    model = onnx.load(path, load_external_data=emulate)  # the weights only where ORT runs a copy
    _refuse_random(model)
    if emulate:
        got = _ort_run(emulate_low(model), feeds, ["CPUExecutionProvider"], disable_opt=True)
        plain = _ort_run(
            emulate_low(model, round_values=False),
            feeds,
            ["CPUExecutionProvider"],
            disable_opt=True,
        )
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
    return _judged(result, got, want, amp_out, dtype, tol)


def _judged(result: dict, got: list, want: list, amp_out: list, dtype: str, tol: float) -> dict:
    result["vs_fp32_max_abs"], result["vs_fp32_max_rel"] = _max_err(got, want)
    result["vs_amp_torch_max_abs"], result["vs_amp_torch_max_rel"] = _max_err(got, amp_out)
    result["tolerance_rel"] = tol
    if result["vs_fp32_max_rel"] > tol:
        raise ExportError(
            f"export differs from the FP32 model by {result['vs_fp32_max_rel']:.3g} "
            f"(relative to the largest output), above {tol} for {dtype}"
        )
    return result


def _openvino_parity(path: str, feeds: dict, dtype: str, result: dict) -> list:
    """The real graph on OpenVINO's CPU plugin, executed precision read back per node.

    Negative control: an FP32 copy (the same BF16-valued weights, no 16-bit values) must
    give different numbers, or OpenVINO ran the BF16 graph in FP32.
    """
    import tempfile

    import onnx

    from .openvino import compile_openvino, run_openvino

    # numpy has no BF16: a BF16 input (a decoder's cache) goes as float32, rounded back on the way in
    arrays = {k: (v.float() if v.is_floating_point() else v).detach().cpu().numpy() for k, v in feeds.items()}
    compiled, executed = compile_openvino(path)
    got = run_openvino(compiled, arrays)
    result["method"] = "OpenVINO CPU, INFERENCE_PRECISION_HINT f32 (the plan's precision per node)"
    result.update({f"executed_{k}": v for k, v in executed.items()})
    if dtype == "fp32":
        return got
    with tempfile.TemporaryDirectory() as tmp:
        control = os.path.join(tmp, "fp32-control.onnx")
        plain = emulate_low(onnx.load(path), round_values=False)
        onnx.save(plain, control, save_as_external_data=True, location="fp32-control.onnx.data")
        fp32_compiled, _ = compile_openvino(control, check=False)
        fp32_run = run_openvino(fp32_compiled, arrays)
    diff, rel = _max_err(got, [torch.as_tensor(p) for p in fp32_run])
    result["negative_control_diff"] = diff
    if rel < 1e-5:
        if not executed["low_nodes_16bit"]:
            raise ExportError(
                "OpenVINO's run of the BF16 graph matches an FP32 run of it and no node ran in "
                "16 bit: the BF16 plan was not executed"
            )
        result["negative_control"] = "outputs insensitive to BF16 rounding; 16-bit nodes checked as executed"
    return got
