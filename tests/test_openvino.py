"""BF16 export served by OpenVINO Runtime: the plan's precision as executed, parity, refusal."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import torch
from helpers import ConvNet, TinyLM, cli_here, tiny_llama

from amp_compiler import ExportError, compile_openvino, export_onnx
from amp_compiler.onnx_export import openvino as ov_serving

pytest.importorskip("onnx")
ov = pytest.importorskip("openvino")

NATIVE = ov_serving.native_bf16()
native_only = pytest.mark.skipif(
    not NATIVE, reason="this CPU has no native BF16: OpenVINO would run a BF16 export in FP32 (refusal tested)"
)
ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))


def runtime_layers(compiled) -> Counter:
    """(layer type, runtime precision) of OpenVINO's compiled model, read independently."""
    seen = Counter()
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        seen[(info["layerType"].astype(str), info["runtimePrecision"].astype(str))] += 1
    return seen


CASES = {
    "lm": lambda: (TinyLM(vocab=100, sdpa=True), (ids,), {}),
    "hf_llama": lambda: (tiny_llama(), (ids,), {"use_cache": False}),
    "cnn_batchnorm": lambda: (ConvNet(), (torch.randn(2, 3, 16, 16),), {}),
}


@native_only
@pytest.mark.parametrize("name", list(CASES))
def test_openvino_runs_matmuls_in_bf16_and_fp32_islands_in_f32(name, tmp_path):
    torch.manual_seed(0)
    model, args, kwargs = CASES[name]()
    path = str(tmp_path / "m.onnx")
    report = export_onnx(model, args, path, kwargs=kwargs, target="openvino")
    settings = tmp_path / "m.openvino.json"
    assert report.settings_path == str(settings)
    assert json.loads(settings.read_text()) == {"INFERENCE_PRECISION_HINT": "f32"}
    p = report.parity
    assert p["method"].startswith("OpenVINO CPU")
    assert p["executed_low_nodes"] == report.structure["low_matmul_conv"] > 0 and p["executed_low_nodes_16bit"] > 0
    assert p["vs_amp_torch_max_rel"] < 0.01 and p["vs_fp32_max_rel"] < 0.01
    assert p["negative_control_diff"] > 0
    # what OpenVINO compiled, with the settings beside the file, read here without the package
    core = ov.Core()
    compiled = core.compile_model(path, "CPU", json.loads(settings.read_text()))
    layers = runtime_layers(compiled)
    gemm = {k: v for k, v in layers.items() if k[0] in ("FullyConnected", "MatMul", "Convolution")}
    assert gemm and all(prec == "bf16" for _, prec in gemm), gemm
    islands = {k: v for k, v in layers.items() if k[0] in ("MVN", "Softmax", "RMS")}
    assert all(prec == "f32" for _, prec in islands), islands
    if name != "cnn_batchnorm":
        assert islands, layers  # LayerNorm/RMSNorm and softmax are there, and ran in FP32
    if name == "hf_llama":  # rotary in FP32, fused (``widen_first``): queries and keys, each layer
        assert layers.get(("RoPE", "f32"), 0) == 2 * model.config.num_hidden_layers, layers


@native_only
def test_openvino_default_hint_would_lower_fp32_islands_and_is_refused(tmp_path):
    """OpenVINO's own default (bf16) lowers LayerNorm and softmax: the check catches it."""
    import onnx

    path = str(tmp_path / "m.onnx")
    export_onnx(TinyLM(vocab=100), (ids,), path, target="openvino")
    compiled = ov.Core().compile_model(path, "CPU", {"INFERENCE_PRECISION_HINT": "bf16"})
    assert ("MVN", "bf16") in runtime_layers(compiled)  # the negative control is real
    with pytest.raises(ExportError, match=r"MVN .* runs in bf16; the plan keeps it FP32"):
        ov_serving.executed_precision(compiled, onnx.load(path, load_external_data=False))
    (tmp_path / "m.openvino.json").write_text(json.dumps({"INFERENCE_PRECISION_HINT": "bf16"}))
    with pytest.raises(ExportError, match="would lower the plan's FP32 islands"):
        compile_openvino(path)


@native_only
def test_compile_openvino_serves_the_file_as_checked(tmp_path):
    path = str(tmp_path / "m.onnx")
    model = TinyLM(vocab=100).eval()
    export_onnx(model, (ids,), path, target="openvino")
    compiled, executed = compile_openvino(path, threads=1)
    assert executed["low_nodes_16bit"] + executed["low_nodes_unnamed"] == executed["low_nodes"] > 0
    assert compiled.get_property("INFERENCE_NUM_THREADS") == 1
    (got,) = ov_serving.run_openvino(compiled, {compiled.inputs[0].any_name: ids.numpy()})
    with torch.no_grad():
        want = model(ids)
    assert (torch.as_tensor(got) - want).abs().max() / want.abs().max() < 0.01


@native_only
def test_openvino_fp32_export_stays_fp32(tmp_path):
    report = export_onnx(TinyLM(vocab=100), (ids,), str(tmp_path / "m.onnx"), dtype="fp32", target="openvino")
    assert report.parity["executed_low_nodes"] == 0 and report.parity["vs_fp32_max_rel"] < 1e-4
    compiled, _ = compile_openvino(str(tmp_path / "m.onnx"))
    assert not [k for k in runtime_layers(compiled) if k[1] == "bf16"]


@pytest.fixture
def no_native_bf16(monkeypatch):
    """A CPU without native BF16: this one where it is, else the CPU itself."""
    if NATIVE:
        monkeypatch.setattr(ov_serving, "native_bf16", lambda core=None: False)


def test_openvino_bf16_is_refused_without_native_bf16_and_nothing_is_written(tmp_path, no_native_bf16):
    with pytest.raises(ExportError, match=r"no native BF16.*dtype='fp32'.*check=False"):
        export_onnx(TinyLM(vocab=100), (ids,), str(tmp_path / "m.onnx"), target="openvino")
    assert list(tmp_path.iterdir()) == []


def test_openvino_file_written_unchecked_elsewhere_is_refused_at_serving(tmp_path, no_native_bf16):
    path = str(tmp_path / "m.onnx")
    report = export_onnx(TinyLM(vocab=100), (ids,), path, target="openvino", check=False)
    assert os.path.exists(path) and os.path.exists(report.settings_path) and not report.parity
    with pytest.raises(ExportError, match="no native BF16"):
        compile_openvino(path)


def test_openvino_takes_no_fp16(tmp_path):
    with pytest.raises(ValueError, match="target='openvino' serves dtype='bf16'"):
        export_onnx(TinyLM(vocab=100), (ids,), str(tmp_path / "m.onnx"), dtype="fp16", target="openvino")
    assert list(tmp_path.iterdir()) == []


@native_only
def test_openvino_failed_check_leaves_nothing(tmp_path):
    with pytest.raises(ExportError, match="differs from the FP32 model"):
        export_onnx(TinyLM(vocab=100), (ids,), str(tmp_path / "m.onnx"), target="openvino", tolerance=0.0)
    assert list(tmp_path.iterdir()) == []


@native_only
def test_cli_export_target_openvino(tmp_path, capsys):
    """The entry point's subprocess is test_onnx_export's; this is the same command here."""
    models = os.path.join(os.path.dirname(__file__), "fixtures", "models.py")
    out = tmp_path / "cli.onnx"
    code, stdout, err = cli_here(capsys, "export", f"{models}:tiny", "-o", str(out), "--target", "openvino")
    assert code == 0, err[-2000:]
    assert "for OpenVINO CPU" in stdout and "serve: openvino.Core().compile_model" in stdout
    assert out.exists() and (tmp_path / "cli.openvino.json").exists()


class _Any:  # OpenVINO's rt_info values
    def __init__(self, value):
        self.value = value

    def astype(self, _):
        return self.value


class _Layer:
    def __init__(self, kind, precision, names):
        self.info = {"layerType": _Any(kind), "runtimePrecision": _Any(precision), "originalLayersNames": _Any(names)}

    def get_rt_info(self):
        return self.info

    def get_friendly_name(self):
        return self.info["originalLayersNames"].value


class _Compiled:
    def __init__(self, *layers):
        self.layers = layers

    def get_runtime_model(self):
        return self

    def get_ordered_ops(self):
        return self.layers


def _two_matmuls():
    """x (bf16) @ w1 -> a; a * 0.5 -> s; s @ w2 -> y: both MatMuls 16-bit in the plan."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((4, 4), dtype=np.float32), "w")
    half = helper.make_tensor("h", TensorProto.BFLOAT16, [], [0.5])
    nodes = [
        helper.make_node("Cast", ["w"], ["w16"], name="cast_w", to=TensorProto.BFLOAT16),
        helper.make_node("MatMul", ["x", "w16"], ["a"], name="mm1"),
        helper.make_node("Constant", [], ["half"], name="c", value=half),
        helper.make_node("Mul", ["a", "half"], ["s"], name="scale"),
        helper.make_node("MatMul", ["s", "w16"], ["y16"], name="mm2"),
        helper.make_node("Cast", ["y16"], ["y"], name="out", to=TensorProto.FLOAT),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [w],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)])


def test_executed_precision_takes_renamed_16_bit_gemms_and_refuses_f32_ones_on_16_bit_values():
    model = _two_matmuls()
    # OpenVINO fused the scale into the second MatMul and named the layer after the Mul
    fine = _Compiled(_Layer("FullyConnected", "bf16", "mm1"), _Layer("FullyConnected", "bf16", "scale"))
    executed = ov_serving.executed_precision(fine, model)
    assert (executed["low_nodes"], executed["low_nodes_16bit"], executed["low_nodes_unnamed"]) == (2, 1, 1)
    ran_f32 = _Compiled(_Layer("FullyConnected", "bf16", "mm1"), _Layer("FullyConnected", "f32", "scale"))
    with pytest.raises(ExportError, match="FullyConnected scale .* runs in f32 on 16-bit values"):
        ov_serving.executed_precision(ran_f32, model)
    with pytest.raises(ExportError, match="mm1 .16-bit in the plan. runs as FullyConnected in f32"):
        ov_serving.executed_precision(_Compiled(_Layer("FullyConnected", "f32", "mm1")), model)
    with pytest.raises(ExportError, match="none of the plan's 2 16-bit matmuls"):
        ov_serving.executed_precision(_Compiled(_Layer("Eltwise", "f32", "out")), model)
