"""Serving a BF16 export on OpenVINO Runtime (CPU) with the plan's precision as executed.

OpenVINO's CPU plugin runs each op in the precision of its inputs when its
``INFERENCE_PRECISION_HINT`` is ``f32``; with its default (``bf16`` on a CPU with native
BF16) it lowers the plan's FP32 islands (LayerNorm, softmax) too. So the settings are part
of the artifact: written beside the file and used by ``compile_openvino``, which also reads
back, from the compiled model, the precision each node executes in. A decoder exported for
generation is served under the BF16 hint instead, as a model of its own whose FP32 nodes
are marked to stay f32 (``write_served``).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from collections import Counter
from typing import Any

import numpy as np
import torch

from .base import ExportError
from .kernels import value_types
from .structure import FP32_ONNX_OPS, LOW_ONNX_OPS

# Session settings that keep the plan: OpenVINO computes each op in its inputs' precision.
SETTINGS = {"INFERENCE_PRECISION_HINT": "f32"}
# Runtime layer types that must execute in FP32 whatever the ONNX node's name became
# (LayerNormalization turns into MVN under a new name).
FP32_RUNTIME_TYPES = frozenset({"MVN", "Softmax", "LogSoftmax", "NormalizeL2", "Reduce", "RMS"})
# fused norms whose kernels load BF16 as f32, compute in f32 and round only what they write
F32_MATH_RUNTIME_TYPES = frozenset({"RMS", "MVN"})
# layers of a pinned model (``write_served``) that may read and write BF16 where the plan has
# FP32 values: those norms, rotary (its kernel computes in f32 too), and a fused elementwise
# Subgraph, which reports its inputs' precision
PINNED_ROUNDED_IO = F32_MATH_RUNTIME_TYPES | {"RoPE", "Subgraph"}
GEMM_RUNTIME_TYPES = frozenset({"FullyConnected", "MatMul", "Convolution", "Deconvolution"})
# attention fused whole (its softmax in f32 inside the kernel), with or without the cache
ATTENTION_RUNTIME_TYPES = frozenset({"ScaledDotProductAttention", "ScaledDotProductAttentionWithKVCache"})
# rotary fused whole: reported, its precision the plan's (``widen_first``)
COUNTED_RUNTIME_TYPES = FP32_RUNTIME_TYPES | GEMM_RUNTIME_TYPES | ATTENTION_RUNTIME_TYPES | {"RoPE"}  # in the report
LOW_PRECISIONS = frozenset({"bf16", "f16"})


def settings_path(path: str) -> str:
    """``model.onnx`` -> ``model.openvino.json``: the settings OpenVINO serves it with."""
    return os.path.splitext(path)[0] + ".openvino.json"


def write_settings(path: str) -> str:
    settings = dict(SETTINGS)
    cache = _cache_precision(path)
    if cache:  # OpenVINO's default stores a fused attention's cache as u8, whatever the hint
        settings["KV_CACHE_PRECISION"] = cache
    dest = settings_path(path)
    with open(dest, "w") as f:
        json.dump(settings, f, indent=2)
        f.write("\n")
    return dest


def _cache_precision(path: str) -> str | None:
    """The precision of a decoder's cache inputs (``past_key_values.*``) in OpenVINO's
    words, or None where the graph has none."""
    import onnx

    words = {onnx.TensorProto.FLOAT: "f32", onnx.TensorProto.BFLOAT16: "bf16", onnx.TensorProto.FLOAT16: "f16"}
    graph = onnx.load(path, load_external_data=False).graph
    past = [i for i in graph.input if i.name.startswith("past_key_values.")]
    return words.get(past[0].type.tensor_type.elem_type) if past else None


def _core():
    try:
        import openvino
    except ImportError as e:
        raise ExportError(
            "target='openvino' needs OpenVINO Runtime: pip install 'amp-compiler[openvino]' "
            "(never beside onnxruntime-openvino's own copy in one environment)"
        ) from e
    return openvino.Core()


def native_bf16(core=None) -> bool:
    """Whether OpenVINO's CPU plugin computes BF16 natively here (AVX512-BF16 or AMX)."""
    core = core or _core()
    return "BF16" in core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")


def refuse_without_native_bf16(core=None, doing: str = "serve a BF16 export") -> None:
    core = core or _core()
    if native_bf16(core):
        return
    caps = ", ".join(core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"))
    raise ExportError(
        f"cannot {doing} on this CPU: it has no native BF16 (OpenVINO's CPU plugin offers {caps}), "
        "so OpenVINO would convert the BF16 graph and run it in FP32. Serve it on a CPU with "
        "AVX512-BF16 or AMX; on this one, export dtype='fp32' with target='cpu' (ONNX Runtime) "
        "or target='openvino'; or write the BF16 file unchecked here (check=False, --no-check) "
        "and check it on the serving machine with compile_openvino(path)"
    )


def _low_onnx_nodes(model) -> tuple[list[str], list[str], set[str]]:
    """Names of the 16-bit MatMul/Gemm/Conv nodes, of the nodes the policy keeps FP32, and
    of every node that reads a 16-bit value."""
    from onnx import TensorProto

    types = value_types(model)
    low = (TensorProto.BFLOAT16, TensorProto.FLOAT16)
    low_names, fp32_names, reads_low = [], [], set()
    for node in model.graph.node:
        ins = [types.get(x) for x in node.input if x]
        if any(t in low for t in ins):
            reads_low.add(node.name)
        if node.op_type in LOW_ONNX_OPS and ins and all(t in low for t in ins):
            low_names.append(node.name)
        elif node.op_type in FP32_ONNX_OPS:
            fp32_names.append(node.name)
    return low_names, fp32_names, reads_low


def _fp32_onnx_values(model) -> dict[str, str]:
    """Name -> op type of the nodes that write a float32 value."""
    from onnx import TensorProto

    types = value_types(model)
    return {n.name: n.op_type for n in model.graph.node if n.output and types.get(n.output[0]) == TensorProto.FLOAT}


def _silu_nodes(model) -> set[str]:
    """Names of the ``Mul(x, Sigmoid(x))`` nodes: OpenVINO's CPU plugin runs each as its own
    SiLU layer, computing in f32 on what it loads, writing its inputs' precision."""
    sigmoid_of = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "Sigmoid"}
    return {
        n.name
        for n in model.graph.node
        if n.op_type == "Mul" and len(n.input) == 2 and any(sigmoid_of.get(a) == b for a, b in (n.input, n.input[::-1]))
    }


def executed_precision(compiled, onnx_model, nodes=None, pinned: bool = False) -> dict[str, Any]:
    """The precision each planned node runs in, read from OpenVINO's compiled (runtime) model.

    A 16-bit MatMul/Gemm/Conv must run in a 16-bit precision; no GEMM layer may run in f32
    under the name of a node that reads 16-bit values; a node the plan keeps FP32, and every
    normalisation/softmax/reduction layer, runs in f32. Raises ExportError otherwise.
    ``nodes``: ``_low_onnx_nodes(onnx_model)`` where the caller has it (shape inference).
    ``pinned`` (``write_served``'s model): every FP32 value of the plan is written in f32,
    but for the layers OpenVINO makes whose kernels compute in f32 on what they load and
    write their inputs' precision (fused norms, rotary, SiLU; counted in
    ``fp32_math_16bit_io``, rotary by type in ``layers``); the logits layer is reported
    (``logits``: its type, the precision it computes in and the one it writes).
    """
    low_names, fp32_names, reads_low = nodes or _low_onnx_nodes(onnx_model)
    attention_low = any(n.op_type == "Attention" and n.name in low_names for n in onnx_model.graph.node)
    ran: dict[str, tuple[str, str]] = {}  # ONNX node name -> (layer type, runtime precision)
    computed: dict[str, list[str]] = {}  # ONNX node name -> precisions of its GEMM/attention layers
    by_type: Counter = Counter()
    wrote: dict[str, list[str]] = {}  # ONNX node name -> precisions its first layer writes
    problems, rounded_io = [], 0
    runtime = compiled.get_runtime_model()
    for op in runtime.get_ordered_ops():
        info = op.get_rt_info()
        kind = info["layerType"].astype(str)
        precision = info["runtimePrecision"].astype(str) if "runtimePrecision" in info else "?"
        names = info["originalLayersNames"].astype(str).split(",")
        writes = info["outputPrecisions"].astype(str).split(",") if "outputPrecisions" in info else []
        for name in names:
            ran.setdefault(name, (kind, precision))
            wrote.setdefault(name, writes)
            if kind in GEMM_RUNTIME_TYPES or kind in ATTENTION_RUNTIME_TYPES:
                computed.setdefault(name, []).append(precision)
        if kind in FP32_RUNTIME_TYPES and precision in LOW_PRECISIONS:
            if pinned and kind in F32_MATH_RUNTIME_TYPES:
                rounded_io += 1
            else:
                problems.append(f"{kind} {op.get_friendly_name()} runs in {precision}; the plan keeps it FP32")
        if kind in ATTENTION_RUNTIME_TYPES and precision == "f32" and attention_low:
            problems.append(f"{kind} {op.get_friendly_name()} runs in f32; the plan's attention is 16-bit")
        if kind in GEMM_RUNTIME_TYPES and precision == "f32" and reads_low.intersection(names):
            problems.append(f"{kind} {op.get_friendly_name()} ({', '.join(names[:3])}) runs in f32 on 16-bit values")
        if kind in COUNTED_RUNTIME_TYPES and precision in ("f32", *LOW_PRECISIONS):
            by_type[f"{kind} {precision}"] += 1

    # judged by the GEMM/attention layers that carry its name (an Attention's name can stay on
    # its mask's u8 layer while OpenVINO names the attention its own way: unnamed, then)
    low_ok = [n for n in low_names if any(p in LOW_PRECISIONS for p in computed.get(n, []))]
    wrong = [n for n in low_names if n in computed and n not in low_ok]
    problems += [f"{n} (16-bit in the plan) runs as {ran[n][0]} in {ran[n][1]}" for n in wrong]
    if low_names and not low_ok:
        problems.append(f"none of the plan's {len(low_names)} 16-bit matmuls/convolutions runs in 16 bit")
    # A fused elementwise Subgraph reports its inputs' precision, not the one inside it
    # (where the plan's casts to FP32 are): only FP32 nodes that kept a layer of their own count.
    own = [n for n in fp32_names if n in ran and ran[n][0] != "Subgraph"]
    problems += [
        f"{n} (FP32 in the plan) runs as {ran[n][0]} in {ran[n][1]}"
        for n in own
        if ran[n][1] in LOW_PRECISIONS and not (pinned and ran[n][0] in F32_MATH_RUNTIME_TYPES)
    ]
    if pinned:  # every FP32 value of the plan that keeps a layer of its own is written in f32
        silu = _silu_nodes(onnx_model)  # OpenVINO's own SiLU op, which the mark does not reach
        fp32_values = _fp32_onnx_values(onnx_model)
        rounded = [n for n in fp32_values if n in ran and "f32" not in wrote[n]]
        rounded_io += sum(1 for n in rounded if n in silu)
        problems += [  # a GEMM the plan keeps FP32 (``fp32_modules``) computed in 16 bit
            f"{n} (an FP32 GEMM in the plan) runs in {'/'.join(computed[n])}"
            for n, op_type in fp32_values.items()
            if op_type in LOW_ONNX_OPS and any(p in LOW_PRECISIONS for p in computed.get(n, []))
        ]
        problems += [
            f"{n} (FP32 in the plan) runs as {ran[n][0]}, writing {'/'.join(wrote[n])}"
            for n in rounded
            if ran[n][0] not in PINNED_ROUNDED_IO and n not in silu
        ]
    if problems:
        raise ExportError(
            f"OpenVINO does not run the plan's precision ({len(problems)} nodes): " + "; ".join(problems[:5])
        )
    return {
        "low_nodes_16bit": len(low_ok),  # found by name, running in 16 bit
        "low_nodes": len(low_names),
        # folded away (constant inputs) or renamed after a node fused into them (a scale Mul);
        # no GEMM layer runs in f32 on 16-bit values, checked above
        "low_nodes_unnamed": len(low_names) - len(low_ok),
        "fp32_nodes_f32": len(own),  # by name; every norm/softmax/reduce layer is checked by type
        "layers": ", ".join(f"{k} x{v}" for k, v in sorted(by_type.items())),
        **({"fp32_math_16bit_io": rounded_io, "logits": _logits_layer(compiled)} if pinned else {}),
    }


def _logits_layer(compiled) -> str:
    """The layer that writes ``logits``: its type, the precision it computes in and writes."""
    index = next(i for i, port in enumerate(compiled.outputs) if "logits" in port.get_names())
    result = compiled.get_runtime_model().outputs[index].get_node()
    info = result.input_value(0).get_node().get_rt_info()
    return " ".join(info[k].astype(str) for k in ("layerType", "runtimePrecision", "outputPrecisions"))


def _settings_for(path: str) -> dict:
    beside = settings_path(path)
    if not os.path.isfile(beside):
        return dict(SETTINGS)
    with open(beside) as f:
        settings = json.load(f)
    if settings.get("INFERENCE_PRECISION_HINT") != "f32":
        raise ExportError(
            f"{beside} sets INFERENCE_PRECISION_HINT={settings.get('INFERENCE_PRECISION_HINT')!r}: OpenVINO "
            "would lower the plan's FP32 islands too; the plan is served with 'f32' (each op in its "
            "inputs' precision)"
        )
    return settings


def compile_openvino(path: str, *, threads: int | None = None, check: bool = True):
    """The export at ``path`` compiled by OpenVINO for this CPU, with the settings beside it.

    Returns ``(compiled_model, executed)``: ``executed`` says which precision the planned
    nodes run in (``check`` raises ExportError where it is not the plan's). A BF16 file is
    refused on a CPU without native BF16.
    """
    return _compiled(path, threads, check, lambda core: core.read_model(path))


def _compiled(path: str, threads: int | None, check: bool, read, pinned: bool = False) -> tuple[Any, dict]:
    """The OpenVINO model ``read(core)`` makes of ``path``, compiled with the file's settings
    (``pinned``: under the BF16 hint, its FP32 nodes marked precise), and the precision its
    planned nodes run in (checked unless ``check`` is False)."""
    core = _core()
    onnx_model, nodes, config = _to_serve(path, threads, core)
    if pinned:
        config["INFERENCE_PRECISION_HINT"] = "bf16"
    compiled = core.compile_model(read(core), "CPU", config)
    executed = executed_precision(compiled, onnx_model, nodes, pinned=pinned) if check else {}
    return compiled, executed


def _to_serve(path: str, threads: int | None, core) -> tuple[Any, tuple, dict]:
    """(the ONNX graph, its planned nodes, OpenVINO's settings) for serving ``path`` here;
    refused where it holds 16-bit matmuls and this CPU has no native BF16."""
    import onnx

    if not os.path.isfile(path):
        raise ExportError(f"no such file: {path!r}")
    onnx_model = onnx.load(path, load_external_data=False)
    nodes = _low_onnx_nodes(onnx_model)
    if nodes[0]:  # 16-bit matmuls: BF16 arithmetic must be native here
        refuse_without_native_bf16(core)
    config = _settings_for(path)
    if threads:
        config["INFERENCE_NUM_THREADS"] = threads
    return onnx_model, nodes, config


def run_openvino(compiled, feeds: dict) -> list:
    """Outputs, in the model's order, for ``feeds`` (ONNX input name -> numpy array)."""
    result = compiled.create_infer_request().infer(openvino_feeds(compiled, feeds))
    return [as_float32(result[port], port) for port in compiled.outputs]


def openvino_feeds(compiled, feeds: dict) -> dict:
    """``feeds`` for ``compiled``'s inputs: numpy has no BF16, so a BF16 input (a decoder's
    16-bit cache) takes a float32 array rounded to BF16 (to nearest, ties to even)."""
    import openvino

    out = {}
    for port in compiled.inputs:
        name = next((n for n in port.get_names() if n in feeds), None)
        if name is None:
            continue
        value = feeds[name]
        if port.get_element_type() == openvino.Type.bf16 and not isinstance(value, openvino.Tensor):
            rounded = torch.as_tensor(np.asarray(value, dtype=np.float32)).to(torch.bfloat16)
            bits = rounded.view(torch.int16).numpy().view(np.uint16)
            value = openvino.Tensor(bits, list(bits.shape), openvino.Type.bf16)
        out[name] = value
    return out


def as_float32(array: np.ndarray, port) -> np.ndarray:
    """An output as float32: OpenVINO hands BF16 values over as float16-typed bits."""
    import openvino

    if port.get_element_type() != openvino.Type.bf16:
        return array
    bits = torch.from_numpy(np.ascontiguousarray(array).view(np.int16))
    return bits.view(torch.bfloat16).float().numpy()


def stateful_model(path: str, layout):
    """An exported decoder (``generation.export_decoder``) as a stateful OpenVINO model: the
    cache held inside it (OpenVINO's MakeStateful pairs each ``past_key_values.*`` input with
    its ``present.*`` output), reordered along the batch by an int32 ``beam_idx`` input (beam
    search keeps the beams' caches), starting empty for the batch ``input_ids`` brings."""
    from openvino import opset13 as ops
    from openvino._offline_transformations import apply_make_stateful_transformation

    model = _core().read_model(path)
    beam_idx = ops.parameter([-1], np.int32, name="beam_idx")
    beam_idx.output(0).set_names({"beam_idx"})
    for name in layout.past_names:
        cache = model.input(name)
        readers = list(cache.get_target_inputs())
        reordered = ops.gather(cache, beam_idx, ops.constant(0))
        for reader in readers:
            reader.replace_source_output(reordered.output(0))
    model.add_parameters([beam_idx])
    apply_make_stateful_transformation(model, dict(zip(layout.past_names, layout.present_names)))
    # each state starts as [batch of input_ids, heads, 0, head_dim] zeros
    batch = ops.gather(ops.shape_of(model.input("input_ids"), output_type="i64"), ops.constant([0]), ops.constant(0))
    for op in model.get_ops():
        if op.get_type_name() == "ReadValue":
            dims = [ops.constant(np.array([d], np.int64)) for d in (layout.kv_heads, 0, layout.head_dim)]
            shape = ops.concat([batch, *dims], axis=0)
            op.set_arguments([ops.broadcast(ops.constant(0.0, dtype=op.get_output_element_type(0)), shape)])
    model.validate_nodes_and_infer_types()
    return model


def compile_stateful(path: str, layout, *, threads: int | None = None, check: bool = True):
    """The decoder at ``path`` compiled stateful for this CPU: the model ``write_served``
    left beside it where there is one (``served_path``), else ``stateful_model`` with the
    settings beside the file. Returns ``(compiled_model, executed)`` as ``compile_openvino``
    does."""
    served = served_path(path)
    if not os.path.isfile(served):
        return _compiled(path, threads, check, lambda core: stateful_model(path, layout))
    model = _read_served(_core(), path, served)
    try:
        return _compiled(path, threads, check, lambda core: model, pinned=True)
    except ExportError as e:
        raise ExportError(
            f"{e}. {served} is served under OpenVINO's BF16 hint: delete it and its .bin to serve "
            f"{path} under hint f32 (the plan node by node)"
        ) from e


# A 16-bit decoder is served under OpenVINO's BF16 hint: its LLM kernels run only there (the
# MLP fused whole, the logits layer writing the FP32 sums of its BF16 GEMM). That hint lowers
# every FP32 node too, so each node the plan keeps FP32 is marked "precise" (OpenVINO's
# DisableFP16Compression, which its CPU plugin honours for BF16 as well); only the IR format
# carries that mark from Python, hence a second file.
PRECISE = "precise"
_NOT_COMPUTED = frozenset({"Constant", "Parameter", "Result", "ReadValue", "Assign"})


def served_path(path: str) -> str:
    """``decoder.onnx`` -> ``decoder.openvino.xml`` (and ``.bin``): the stateful model served."""
    return os.path.splitext(path)[0] + ".openvino.xml"


def remove_served(path: str) -> None:
    """Remove the served model beside ``path`` (its .xml and .bin), where there is one."""
    served = served_path(path)
    for made in (served, os.path.splitext(served)[0] + ".bin"):
        if os.path.exists(made):
            os.remove(made)


def write_served(path: str, layout) -> str:
    """Write the 16-bit decoder at ``path`` as the stateful OpenVINO model it is served as
    (``served_path``): the plan's FP32 nodes marked precise; the GEMM that makes the logits,
    16-bit in the plan and widened to FP32 after it, written in FP32 on its widened inputs
    (exact BF16 values: OpenVINO runs it as the same BF16 GEMM and keeps its FP32 sums instead
    of rounding them to BF16 first); the cache precision in the model's runtime options."""
    import openvino
    from openvino._offline_transformations import apply_moc_transformations

    model = stateful_model(path, layout)
    widened = _logits_from_wide_matmul(model)
    # OpenVINO's own fusions first (a sigmoid-times-x becomes one Swish): an op they make
    # does not inherit the mark, so what is marked is what they leave
    apply_moc_transformations(model, cf=False)
    keep = {
        (op.get_friendly_name(), op.get_type_name())
        for op in model.get_ops()
        if _computes_fp32(op) and (op.get_friendly_name(), op.get_type_name()) not in widened
    }
    cache = _cache_precision(path)
    if cache:
        model.set_rt_info(cache, ["runtime_options", "KV_CACHE_PRECISION"])
    model.set_rt_info(_digest(path), ["amp", "source"])
    dest = served_path(path)
    openvino.save_model(model, dest, compress_to_fp16=False)
    _mark_precise(dest, keep)
    return dest


def _computes_fp32(op) -> bool:
    """Whether ``op`` computes a float32 value. A 16-bit value widened to FP32 is exact, not
    computed: left unmarked, OpenVINO widens it where an f32 reader needs it (a reorder,
    faster than its reference Convert: 4% of a token here), and a widened weight stays the
    GEMM's compressed weight."""
    import openvino

    if op.get_type_name() in _NOT_COMPUTED:
        return False
    if op.get_type_name() == "Convert" and op.get_input_element_type(0).to_string() in LOW_PRECISIONS:
        return False
    return any(op.get_output_element_type(i) == openvino.Type.f32 for i in range(op.get_output_size()))


def _logits_from_wide_matmul(model) -> set[tuple[str, str]]:
    """Rewrite ``logits = Convert<f32>(MatMul<bf16>(x, w))`` as ``MatMul(Convert<f32>(x),
    Convert<f32>(w))``; returns the (name, type) of the ops it made (left unmarked)."""
    import openvino
    from openvino import opset13 as ops

    result = next((r for r in model.get_results() if "logits" in r.input_value(0).get_names()), None)
    widen = result.input_value(0).get_node() if result is not None else None
    if widen is None or widen.get_type_name() != "Convert" or widen.get_output_element_type(0) != openvino.Type.f32:
        return set()
    matmul = widen.input_value(0).get_node()
    if matmul.get_type_name() != "MatMul" or matmul.get_output_element_type(0).to_string() not in LOW_PRECISIONS:
        return set()
    flags = matmul.get_attributes()
    inputs = [ops.convert(matmul.input_value(i), "f32") for i in range(2)]
    wide = ops.matmul(*inputs, flags["transpose_a"], flags["transpose_b"])
    wide.set_friendly_name(matmul.get_friendly_name())
    wide.output(0).set_names(widen.output(0).get_names())
    widen.output(0).replace(wide.output(0))
    model.validate_nodes_and_infer_types()
    return {(n.get_friendly_name(), n.get_type_name()) for n in (wide, *inputs)}


def _mark_precise(xml: str, keep: set[tuple[str, str]]) -> None:
    """Mark the IR's layers named in ``keep`` (name, type) precise, in place."""
    import xml.etree.ElementTree as ElementTree

    tree = ElementTree.parse(xml)
    for layer in tree.getroot().iter("layer"):
        if (layer.get("name"), layer.get("type")) in keep:
            info = layer.find("rt_info")
            if info is None:
                info = ElementTree.SubElement(layer, "rt_info")
            ElementTree.SubElement(info, "attribute", {"name": PRECISE, "version": "0"})
    tree.write(xml, encoding="utf-8", xml_declaration=True)


def _digest(path: str) -> str:
    """The ONNX graph's file (its weights beside it are not read): what the served model was made from."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _read_served(core, path: str, served: str):
    model = core.read_model(served)
    made_from = model.get_rt_info(["amp", "source"]).astype(str) if model.has_rt_info(["amp", "source"]) else None
    if made_from != _digest(path):
        raise ExportError(
            f"{served} was not made from {path} (the files come from different exports): export "
            "again with export_decoder, or delete the .openvino.xml/.bin pair to serve the ONNX file"
        )
    return model


# ops that move values without computing on them: exact in any dtype
_MOVES = frozenset({"Unsqueeze", "Squeeze", "Expand", "Reshape", "Transpose"})


def fold_round_trips(graph) -> None:
    """A 16-bit value widened to FP32, only moved (the grouped-query repeat of a 16-bit cache:
    Unsqueeze, Expand, Reshape) and cast back to the same 16 bits moves in 16 bit instead: the
    same values, and the cache then feeds attention directly, as OpenVINO's fusion needs."""
    import onnx_ir as ir

    sixteen_bits = (ir.DataType.BFLOAT16, ir.DataType.FLOAT16)
    for back in list(graph):
        if back.op_type != "Cast" or back.graph is None or back.outputs[0].is_graph_output():
            continue
        chain, value = [], back.inputs[0]
        while value.producer() is not None and value.producer().op_type in _MOVES and len(value.uses()) == 1:
            chain.append(value.producer())
            value = value.producer().inputs[0]
        widen = value.producer()
        if widen is None or widen.op_type != "Cast" or len(value.uses()) != 1:
            continue
        source = widen.inputs[0]
        exact = source.dtype in sixteen_bits and widen.outputs[0].dtype == ir.DataType.FLOAT
        if not exact or source.dtype != back.outputs[0].dtype:
            continue
        if chain:
            chain[-1].replace_input_with(0, source)
            for node in chain:
                node.outputs[0].dtype = source.dtype
            back.outputs[0].replace_all_uses_with(back.inputs[0])
        else:
            back.outputs[0].replace_all_uses_with(source)
        graph.remove([back, widen], safe=True)


# exact as well, on their data inputs (input 0; every input of a Concat)
_EXACT = _MOVES | {"Slice", "Neg", "Concat"}


def widen_first(graph) -> None:
    """A 16-bit value widened to FP32 after exact ops (rotary's rotate-half: Slice, Neg,
    Concat) whose sources are widened already elsewhere is computed from those widened
    values instead: the same values, one Convert fewer for each, and FP32 rotary then reads
    as the pattern OpenVINO fuses into one RoPE layer. No Cast is added: where a source has
    no widening of its own, the graph stays as it is. Casts to the dtype they read are dropped."""
    import onnx_ir as ir

    for cast in list(graph):
        if cast.op_type == "Cast" and cast.graph is not None and not cast.outputs[0].is_graph_output():
            to = cast.attributes.get("to")
            if to is not None and cast.inputs[0].dtype is not None and cast.inputs[0].dtype.value == to.value:
                cast.outputs[0].replace_all_uses_with(cast.inputs[0])
                graph.remove(cast, safe=True)
    changed = False
    for cast in list(graph):
        if cast.op_type != "Cast" or cast.graph is None or cast.outputs[0].dtype != ir.DataType.FLOAT:
            continue
        source = cast.inputs[0]
        if source.dtype not in (ir.DataType.BFLOAT16, ir.DataType.FLOAT16) or source.producer() is None:
            continue
        if source.producer().op_type not in _EXACT:
            continue
        made: list = []
        wide = _widened(source, cast, made, {})
        if wide is not None:
            graph.insert_before(cast, made)
            cast.outputs[0].replace_all_uses_with(wide)
            graph.remove(cast, safe=True)
            changed = True
    if changed:
        graph.sort()  # a reused widening may come later in the file than its new consumers


def _widened(value, cast, made: list, memo: dict):
    """``value`` in FP32 from exact ops over widenings the graph has (not ``cast``), or None."""
    import onnx_ir as ir

    if value in memo:
        return memo[value]
    for use in value.uses():
        node = use[0]
        if node is not cast and node.op_type == "Cast" and node.outputs[0].dtype == ir.DataType.FLOAT:
            memo[value] = node.outputs[0]
            return memo[value]
    producer = value.producer()
    if producer is None or producer.op_type not in _EXACT or len(producer.outputs) != 1:
        return None
    data = range(len(producer.inputs)) if producer.op_type == "Concat" else (0,)
    inputs = list(producer.inputs)
    for i in data:
        inputs[i] = _widened(inputs[i], cast, made, memo)
        if inputs[i] is None:
            return None
    node = ir.Node(producer.domain, producer.op_type, inputs, list(producer.attributes.values()))
    node.outputs[0].dtype, node.outputs[0].shape = ir.DataType.FLOAT, producer.outputs[0].shape
    made.append(node)
    memo[value] = node.outputs[0]
    return memo[value]


def _additive_masks(graph) -> None:
    """Each Attention's boolean mask as the additive one it means (0 where attended, the
    dtype's lowest where not): OpenVINO's fused attention takes a slow path on a boolean
    mask (a 512-token prompt: 26 ms a layer against 5.7). The lowest finite value, not -inf:
    a row masked whole (a left pad's) stays finite, so no NaN reaches what attends to it."""
    import onnx_ir as ir

    made = {}
    for node in list(graph):
        mask = node.inputs[3] if node.op_type == "Attention" and len(node.inputs) > 3 else None
        if mask is None or mask.dtype != ir.DataType.BOOL:
            continue
        dtype = node.inputs[0].dtype.numpy()
        if (mask, dtype) not in made:
            zero, lowest = (
                ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.tensor(np.array(v, dtype)))])
                for v in (0, np.finfo(dtype).min)
            )
            where = ir.Node("", "Where", [mask, zero.outputs[0], lowest.outputs[0]])
            graph.insert_before(node, [zero, lowest, where])
            made[mask, dtype] = where.outputs[0]
        node.replace_input_with(3, made[mask, dtype])


@functools.cache
def attention_fuses_here() -> bool:
    """Whether a decoder's attention can be exported for OpenVINO to fuse with its stateful
    cache: this OpenVINO reads ONNX's Attention (opset 23) as its own ScaledDotProductAttention,
    and onnx_ir and onnxscript have what ``fusable_attention`` rewrites with."""
    try:
        import onnx_ir.passes.common  # noqa: F401
        from onnxscript.rewriter.rules.common import collapse_slice_rule  # noqa: F401
    except ImportError:  # older releases: attention is written out instead
        return False
    from onnx import TensorProto, helper

    shape = [1, 2, 3, 8]
    qkv = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in "qkv"]
    graph = helper.make_graph(
        [helper.make_node("Attention", ["q", "k", "v"], ["y"])],
        "attention",
        qkv,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    try:
        read = _core().read_model(model.SerializeToString(), b"")
    except Exception:  # noqa: BLE001 - an older OpenVINO: attention stays MatMul/Softmax
        return False
    return any(op.get_type_name() == "ScaledDotProductAttention" for op in read.get_ops())


def fusable_attention(path: str) -> None:
    """Rewrite the decoder at ``path`` in place so OpenVINO's CPU plugin fuses each attention
    with its stateful cache (ReadValue -> Gather(beam_idx) -> Concat -> [grouped-query
    broadcast] -> ScaledDotProductAttention): the exporter's no-op Slices (``x[:, :, None]``'s
    full slices) and Identities (clones) sit inside that chain and stop the match; a boolean
    mask slows the fused kernel."""
    from onnx_ir.passes.common import IdentityEliminationPass
    from onnxscript import rewriter
    from onnxscript.rewriter.rules.common import collapse_slice2_rule, collapse_slice_rule

    def simplified(model):
        model = rewriter.rewrite(model, pattern_rewrite_rules=[collapse_slice_rule, collapse_slice2_rule])
        IdentityEliminationPass()(model)
        fold_round_trips(model.graph)
        widen_first(model.graph)
        _additive_masks(model.graph)
        return model

    _rewrite_in_place(path, simplified)


def fewer_conversions(path: str) -> None:
    """Rewrite a 16-bit export for OpenVINO in place with ``widen_first`` (its rotary fused
    in FP32, one Convert fewer each); left as written where onnx_ir lacks what it needs."""
    try:
        import onnx_ir.passes.common  # noqa: F401
    except ImportError:
        return

    def widened(model):
        widen_first(model.graph)
        return model

    _rewrite_in_place(path, widened)


def _rewrite_in_place(path: str, rewrite) -> None:
    """``path`` read as onnx_ir, ``rewrite(model)``, unused nodes dropped, written back; its
    weights stay beside it (``name.data``) where they were."""
    import onnx_ir as ir
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    name, folder = os.path.basename(path), os.path.dirname(os.path.abspath(path))
    external = os.path.exists(os.path.join(folder, name + ".data"))
    model = rewrite(ir.load(path))
    RemoveUnusedNodesPass()(model)
    # written beside, then moved over: the model still reads its weights from the old file
    beside = tempfile.mkdtemp(dir=folder, prefix=".amp-simplify-")
    try:
        ir.save(model, os.path.join(beside, name), external_data=name + ".data" if external else None)
        del model
        for f in (name, name + ".data") if external else (name,):
            os.replace(os.path.join(beside, f), os.path.join(folder, f))
    finally:
        shutil.rmtree(beside, ignore_errors=True)
