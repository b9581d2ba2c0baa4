"""Decoders exported for generation: the KV cache in and out, tokens against transformers'
own generate(), the stateful OpenVINO form, BF16 executed as planned."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import tiny_gpt2, tiny_llama

from amp_compiler import ExportError, export_decoder
from amp_compiler.onnx_export import openvino as ov_serving
from amp_compiler.onnx_export.generation import Decoder, example_prompts

transformers = pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")
ov = pytest.importorskip("openvino")

NATIVE = ov_serving.native_bf16()
native_only = pytest.mark.skipif(
    not NATIVE, reason="this CPU has no native BF16: OpenVINO would run a BF16 export in FP32 (refusal tested)"
)
NEW = 24


def _small(name, **extra):
    """transformers' ``{name}ForCausalLM`` from a small config (2 layers, d=32, 100 tokens)."""

    def make():
        torch.manual_seed(0)
        base = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
        config = getattr(transformers, f"{name}Config")(**{**base, **extra})
        return getattr(transformers, f"{name}ForCausalLM")(config).eval()

    return make


FAMILIES = {
    "gpt2": lambda: tiny_gpt2(seed=0, n_positions=64, vocab_size=100).eval(),
    "llama": lambda: tiny_llama(seed=0).eval(),
    "qwen2": _small("Qwen2", num_key_value_heads=2),
    "mistral": _small("Mistral", num_key_value_heads=2, sliding_window=None),
    "phi3": _small("Phi3", num_key_value_heads=2, pad_token_id=0),  # one fused qkv projection
    "gemma": _small("Gemma", num_key_value_heads=2, head_dim=8),
    "gpt_neox": _small("GPTNeoX"),  # rotary over part of each head
    # MoE: experts as transformers' own custom op, written by its ONNX translation
    "qwen2_moe": _small(
        "Qwen2Moe",
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
    ),
}


# OpenVINO 2026 keeps the marked nodes in f32 under its BF16 hint; 2025.4 lowers the
# written-out softmax and norms despite the marks
KEEPS_MARKS = tuple(int(v) for v in ov.__version__.split(".")[:1]) >= (2026,)


def served_pinned(report) -> bool:
    """Whether a 16-bit export is served as its pinned model. Only an OpenVINO that lowers
    marked nodes may fall back (the report says why; the ONNX file is served under hint f32):
    a release that stops keeping them fails here, not silently."""
    if report.served_path is None:
        assert not KEEPS_MARKS, f"OpenVINO {ov.__version__} should serve the pinned model: {report.not_served}"
        assert report.not_served.startswith("under OpenVINO's BF16 hint") and "served as the ONNX" in report.format()
        return False
    assert report.served_path == ov_serving.served_path(report.path) and "served as" in report.format()
    return True


def hf_greedy(model, ids, mask, new=NEW) -> np.ndarray:
    """transformers' own generate(), each prompt alone without its padding: the oracle a
    left-padded batch from the export is held against."""
    # no end-of-sequence token: the config's id is a token the graph may rightly pick
    config = transformers.GenerationConfig(max_new_tokens=new, do_sample=False, pad_token_id=0)
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    rows = []
    try:
        for row, keep in zip(ids, mask.astype(bool)):
            with torch.no_grad():
                out = model.generate(input_ids=torch.as_tensor(row[keep][None]), generation_config=config)
            assert out.shape[1] == keep.sum() + new
            rows.append(out[0, keep.sum() :].numpy())
    finally:
        model.generation_config.eos_token_id = saved
    return np.stack(rows)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fp32_export_generates_transformers_tokens(family, tmp_path):
    """Prompt and every later token through one graph with the cache in and out, on ONNX
    Runtime's CPU provider: the same greedy tokens as transformers' generate(), a left-padded
    prompt in the batch; the same again with transformers' generate() driving the file
    (``CausalLM`` takes each family's config, a MoE's experts setting included)."""
    from amp_compiler.onnx_export import CausalLM

    model = FAMILIES[family]()
    path = str(tmp_path / "decoder.onnx")
    report = export_decoder(model, path, dtype="fp32", target="cpu", new_tokens=NEW)
    assert report.generation["tokens_differing"] == 0 and report.generation["first_divergent"] is None
    assert not model.training  # the model comes back in the mode it was given

    import onnx

    graph = onnx.load(path, load_external_data=False).graph
    layers = model.config.num_hidden_layers
    assert [i.name for i in graph.input] == ["input_ids", "attention_mask", "position_ids"] + [
        f"past_key_values.{i}.{k}" for i in range(layers) for k in ("key", "value")
    ]
    assert [o.name for o in graph.output] == ["logits"] + [
        f"present.{i}.{k}" for i in range(layers) for k in ("key", "value")
    ]
    ids, mask = example_prompts(100, seed=3)  # prompts the export's own check did not see
    assert (mask == 0).any()
    got = Decoder(path, runtime="ort").generate(ids, mask, NEW)
    np.testing.assert_array_equal(got, hf_greedy(model, ids, mask))
    lm = CausalLM(path, model.config, runtime="ort")
    served = _generate(lm, ids, mask, max_new_tokens=NEW, do_sample=False)[:, ids.shape[1] :]
    np.testing.assert_array_equal(served.numpy(), got)


def test_cache_lengths_and_batch_are_dynamic(tmp_path):
    """One graph: an empty cache and a prompt of 9, then single tokens, at batch 1 and 3;
    each step's cache one token longer, logits equal to the model's."""
    import onnxruntime as ort

    model = tiny_llama(seed=0).eval()
    path = str(tmp_path / "d.onnx")
    report = export_decoder(model, path, dtype="fp32", target="cpu", new_tokens=4)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    layout = report.layout
    for batch in (1, 3):
        ids = np.random.default_rng(batch).integers(0, 100, (batch, 9))
        mask, past = np.ones_like(ids), layout.empty(batch)
        for step in range(3):
            feed = ids if step == 0 else ids[:, -1:]
            pos = np.arange(mask.shape[1] - feed.shape[1], mask.shape[1])[None].repeat(batch, 0)
            logits, *past = session.run(
                None,
                {"input_ids": feed, "attention_mask": mask, "position_ids": pos, **dict(zip(layout.past_names, past))},
            )
            assert [p.shape[2] for p in past] == [mask.shape[1]] * len(past)
            with torch.no_grad():
                want = model(torch.as_tensor(ids), attention_mask=torch.as_tensor(mask)).logits[:, -feed.shape[1] :]
            np.testing.assert_allclose(logits, want.numpy(), atol=1e-5, rtol=1e-4)
            ids = np.concatenate([ids, logits[:, -1:].argmax(-1)], 1)
            mask = np.ones_like(ids)


def test_stateful_openvino_keeps_the_cache_and_reorders_it_by_beam_idx(tmp_path):
    """OpenVINO's stateful form: no cache inputs or outputs, a beam_idx input; its tokens are
    the cache-passing form's, and beam_idx moves a row's cache to another row."""
    from amp_compiler.onnx_export.openvino import compile_stateful, stateful_model

    model = FAMILIES["llama"]()
    path = str(tmp_path / "d.onnx")
    report = export_decoder(model, path, dtype="fp32", target="openvino", new_tokens=NEW)
    stateful = stateful_model(path, report.layout)
    assert sorted(n for i in stateful.inputs for n in i.get_names()) == sorted(
        ["input_ids", "attention_mask", "position_ids", "beam_idx"]
    )
    assert [n for o in stateful.outputs for n in o.get_names()] == ["logits"]
    assert len(stateful.get_sinks()) == 2 * report.layout.layers  # one Assign per cache tensor

    ids, mask = example_prompts(100, seed=5)
    kept = Decoder(path, runtime="openvino", stateful=True).generate(ids, mask, NEW)
    passed = Decoder(path, runtime="openvino", stateful=False).generate(ids, mask, NEW)
    np.testing.assert_array_equal(kept, passed)
    np.testing.assert_array_equal(kept, hf_greedy(model, ids, mask))

    # the prompt of row 1 continued from row 0's place once its cache is moved there
    request = compile_stateful(path, report.layout)[0].create_infer_request()
    full = np.ones_like(ids)
    prompt = {"input_ids": ids, "attention_mask": full, "position_ids": np.arange(12)[None].repeat(2, 0)}
    first = request.infer({**prompt, "beam_idx": np.arange(2, dtype=np.int32)})["logits"]
    token = first[:, -1].argmax(-1)[:, None]
    nxt = {"attention_mask": np.ones((2, 13), np.int64), "position_ids": np.full((2, 1), 12)}
    swapped = request.infer({**nxt, "input_ids": token[[1, 1]], "beam_idx": np.array([1, 1], np.int32)})["logits"]
    with torch.no_grad():
        want = model(torch.as_tensor(np.concatenate([ids, token], 1)[[1, 1]])).logits[:, -1]
    np.testing.assert_allclose(swapped[:, -1], want.numpy(), atol=1e-4, rtol=1e-4)


@native_only
@pytest.mark.parametrize("family", ["gpt2", "qwen2", "phi3", "gpt_neox"])  # the last two: one qkv GEMM, split
def test_bf16_export_generates_with_the_plan_executed(family, tmp_path):
    """BF16 from the plan on OpenVINO: matmuls ran in BF16, norms in FP32 (read back from the
    compiled model), attention fused with a BF16 cache that OpenVINO holds (half FP32's
    bytes; the softmax inside the fused kernel in f32), rotary fused; where its tokens first
    leave FP32's is reported, and an FP32 control run of the same graph differs. Served as
    the stateful model written beside the file: under OpenVINO's BF16 hint, the logits the
    FP32 sums of their BF16 GEMM, every other FP32 value of the plan written in f32 (norms,
    rotary and SiLU computing in f32 inside kernels that read and write BF16, counted)."""
    import json

    import onnx

    from amp_compiler.onnx_export.openvino import attention_fuses_here

    model, path = FAMILIES[family](), str(tmp_path / "d.onnx")
    report = export_decoder(model, path, new_tokens=NEW)
    p, g = report.parity, report.generation
    assert p["executed_low_nodes_16bit"] > 0 and p["negative_control_diff"] > 0
    assert "bf16" in p["executed_layers"] and "MVN bf16" not in p["executed_layers"]
    assert g["prompts"] == 2 and g["new_tokens"] == NEW
    assert g["first_divergent"] is None or 0 <= g["first_divergent"] < NEW
    assert "generation: prompts 2" in report.format()
    served, pinned = Decoder(path), served_pinned(report)  # stateful, as served
    assert "Reduce bf16" not in served.executed["layers"] and "MVN bf16" not in served.executed["layers"]
    if pinned:  # the head's FP32 sums; norms computing in f32 (RMS on BF16 in and out)
        assert served.executed["logits"] == "FullyConnected bf16 f32"
        assert "MVN f32" in served.executed["layers"] or served.executed["fp32_math_16bit_io"] >= 2
    if not attention_fuses_here():  # attention written out: softmax FP32 as its own layer
        assert "Softmax f32" in served.executed["layers"] and "Softmax bf16" not in served.executed["layers"]
        return
    graph = onnx.load(path, load_external_data=False).graph
    past = [i.type.tensor_type.elem_type for i in graph.input if i.name.startswith("past_key_values.")]
    assert set(past) == {onnx.TensorProto.BFLOAT16}
    assert json.load(open(report.settings_path))["KV_CACHE_PRECISION"] == "bf16"
    assert served.compiled.get_property("KV_CACHE_PRECISION").to_string() == "bf16"
    layers = report.layout.layers
    assert f"ScaledDotProductAttention bf16 x{layers}" in served.executed["layers"]
    assert "Softmax" not in served.executed["layers"] and "MatMul" not in served.executed["layers"]
    if family != "gpt2":  # rotary fused (``widen_first``): queries and keys; FP32 as planned on the ONNX file
        assert f"RoPE {'bf16' if pinned else 'f32'} x{2 * layers}" in served.executed["layers"]
        compiled, executed = ov_serving.compile_openvino(path)
        assert f"RoPE f32 x{2 * layers}" in executed["layers"]


@native_only
def test_the_served_decoder_keeps_fp32_where_the_plan_does_because_it_is_marked(tmp_path):
    """Under OpenVINO's BF16 hint only the marks keep the plan's FP32 nodes (the residual
    stream's adds) in f32: the served model read without them is refused by name; the file
    made from another export is refused; an FP32 export over the same path takes the BF16
    one's served model away."""
    import shutil

    model, path = FAMILIES["llama"](), str(tmp_path / "d.onnx")
    report = export_decoder(model, path, new_tokens=4)
    if not served_pinned(report):
        pytest.skip(f"this OpenVINO cannot keep the plan under its BF16 hint: {report.not_served[:300]}")
    served = report.served_path
    text = open(served).read()
    assert text.count('<attribute name="precise"') > 2 * report.layout.layers
    unmarked = str(tmp_path / "unmarked.xml")
    with open(unmarked, "w") as f:
        f.write(text.replace('<attribute name="precise" version="0" />', ""))
    shutil.copy(served[:-4] + ".bin", unmarked[:-4] + ".bin")
    with pytest.raises(ExportError, match=r"node_add\w* \(FP32 in the plan\) runs as Eltwise, writing bf16"):
        ov_serving._compiled(path, None, True, lambda core: core.read_model(unmarked), pinned=True)

    other = str(tmp_path / "other.onnx")
    export_decoder(FAMILIES["qwen2"](), other, check=False)
    shutil.copy(ov_serving.served_path(other), served)
    shutil.copy(ov_serving.served_path(other)[:-4] + ".bin", served[:-4] + ".bin")
    with pytest.raises(ExportError, match="was not made from .*export again"):
        Decoder(path)

    export_decoder(model, path, dtype="fp32", target="openvino", new_tokens=4)
    assert not [f for f in tmp_path.iterdir() if f.name.startswith("d.openvino.") and f.suffix in (".xml", ".bin")]
    assert "logits" not in Decoder(path).executed  # the ONNX file, served as it is


def test_a_moe_decoder_exports_its_experts_in_bf16_from_the_plan(tmp_path):
    """The experts' grouped matmul (transformers' custom op, written by transformers' own
    ONNX translation) is 16-bit in the file as the plan says, beside every other GEMM; no
    FP32 op of the plan takes BF16. Any CPU: the file is written unchecked and its structure
    checked here (what it executes is checked where BF16 is native)."""
    from amp_compiler.onnx_export.structure import check_structure

    model, path = FAMILIES["qwen2_moe"](), str(tmp_path / "d.onnx")
    report = export_decoder(model, path, check=False)
    experts = model.config.num_hidden_layers * 2  # gate-up and down: a grouped GEMM each
    structure = check_structure(path, "bf16", "openvino", report.plan)
    assert structure["fp32_matmul_conv"] == 0 and structure["low_matmul_conv"] >= experts
    assert report.plan.summary()["nodes"]["LOW"] > 0


def test_a_model_without_a_cache_is_refused_with_what_to_use(tmp_path):
    with pytest.raises(ExportError, match="export_decoder takes a transformers causal LM.*export_onnx"):
        export_decoder(torch.nn.Linear(4, 4), str(tmp_path / "d.onnx"), dtype="fp32", target="cpu")
    assert list(tmp_path.iterdir()) == []


def test_fp32_tokens_that_differ_fail_the_export_and_leave_nothing(tmp_path, monkeypatch):
    """The generation check is a check: tokens that leave the reference's keep the file out."""
    from amp_compiler.onnx_export import generation

    real = generation.torch_greedy
    monkeypatch.setattr(generation, "torch_greedy", lambda *a: (real(*a) + 1) % 100)
    with pytest.raises(ExportError, match="greedy tokens leave PyTorch's at token 0"):
        export_decoder(tiny_llama(seed=0).eval(), str(tmp_path / "d.onnx"), dtype="fp32", target="cpu", new_tokens=4)
    assert list(tmp_path.iterdir()) == []


def test_bf16_decoder_is_refused_without_native_bf16(tmp_path, monkeypatch):
    if NATIVE:
        monkeypatch.setattr(ov_serving, "native_bf16", lambda core=None: False)
    with pytest.raises(ExportError, match="no native BF16") as refused:
        export_decoder(tiny_llama(seed=0).eval(), str(tmp_path / "d.onnx"))
    assert "opset" not in str(refused.value)  # no other export would pass: nothing to suggest
    assert list(tmp_path.iterdir()) == []


def test_a_missing_folder_is_named_before_any_work(tmp_path):
    with pytest.raises(ExportError, match="folder .*missing.* does not exist$"):
        export_decoder(tiny_llama(seed=0).eval(), str(tmp_path / "missing" / "d.onnx"), dtype="fp32")
    assert list(tmp_path.iterdir()) == []


def test_cli_exports_a_decoder_for_generation(tmp_path, capsys):
    from pathlib import Path

    from helpers import cli_here

    target = str(Path(__file__).parent / "fixtures" / "models.py") + ":tiny_causal_lm"
    out = str(tmp_path / "decoder.onnx")
    code, stdout, err = cli_here(capsys, "export", target, "-o", out, "--task", "text-generation", "--dtype", "fp32",
                                 "--target", "cpu")  # fmt: skip
    assert code == 0, err
    assert "past_key_values.*" in stdout and "tokens_differing 0" in stdout
    ids, mask = example_prompts(100, seed=1)
    model = FAMILIES["llama"]()  # the factory's model: the same seed and config
    np.testing.assert_array_equal(Decoder(out, runtime="ort").generate(ids, mask, 8), hf_greedy(model, ids, mask, 8))

    code, _, err = cli_here(capsys, "export", target, "-o", out, "--task", "text-generation", "--dynamic", "0:batch")
    assert code == 2 and "makes batch and lengths dynamic itself" in err


def test_cuda_target_without_cuda_checks_numbers_and_says_generation_was_skipped(tmp_path):
    """target="cuda" on a machine without CUDA: the BF16 file is checked as export_onnx checks
    it (rounding emulated on ORT CPU); generation is not run on some other runtime instead."""
    import torch as _torch

    if _torch.cuda.is_available():
        pytest.skip("a CUDA machine generates on ORT's CUDA provider (tools/gpu_check.sh)")
    path = tmp_path / "d.onnx"
    report = export_decoder(FAMILIES["llama"](), str(path), target="cuda", new_tokens=4)
    assert path.exists() and "emulated" in report.parity["method"]
    assert "no CUDA device" in report.generation["skipped"]


def test_a_row_that_ends_keeps_its_end_token_and_the_others_go_on(tmp_path):
    path = str(tmp_path / "d.onnx")
    export_decoder(FAMILIES["llama"](), path, dtype="fp32", target="cpu", new_tokens=4)
    decoder = Decoder(path, runtime="ort")
    ids, mask = example_prompts(100, seed=3)
    free = decoder.generate(ids, mask, 10)
    end = int(free[0, 2])  # row 0's third token, made its end
    stopped = decoder.generate(ids, mask, 10, eos_token_id=end)
    assert (stopped[0, :3] == free[0, :3]).all() and (stopped[0, 3:] == end).all()
    ends = np.flatnonzero(free[1] == end)
    upto = ends[0] + 1 if len(ends) else 10  # row 1 goes on as before until it makes that token
    assert (stopped[1, :upto] == free[1, :upto]).all() and (stopped[1, upto:] == end).all()


MODES = {
    "greedy": dict(do_sample=False),
    "beam search": dict(num_beams=3, do_sample=False),  # the cache reordered between steps
    "sampling": dict(do_sample=True, top_k=20, temperature=0.8),  # the same seed for both
}


@pytest.fixture(scope="module")
def llama_fp32(tmp_path_factory):
    model = FAMILIES["llama"]()
    path = str(tmp_path_factory.mktemp("lm") / "d.onnx")
    export_decoder(model, path, dtype="fp32", target="openvino", new_tokens=8)
    return model, path


def _generate(lm, ids, mask, **kw):
    torch.manual_seed(1)
    gen = dict(max_new_tokens=12, pad_token_id=0, eos_token_id=None)
    return lm.generate(torch.as_tensor(ids), attention_mask=torch.as_tensor(mask), **{**gen, **kw})


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("stateful", [True, False], ids=["stateful", "cache-passed"])
def test_transformers_generate_drives_the_export_as_it_drives_the_model(llama_fp32, stateful, mode):
    """CausalLM: transformers' generate() over the FP32 export on OpenVINO gives the tokens it
    gives over the PyTorch model, a left-padded batch; every forward ran on OpenVINO."""
    from amp_compiler.onnx_export import CausalLM

    model, path = llama_fp32
    lm = CausalLM(path, model.config, stateful=stateful)
    rows, real = [], lm.decoder.step
    lm.decoder.step = lambda feeds, *a, **k: rows.append(feeds["input_ids"].shape) or real(feeds, *a, **k)
    ids, mask = example_prompts(100, seed=7)
    got = _generate(lm, ids, mask, **MODES[mode])
    want = _generate(model, ids, mask, **MODES[mode])
    assert torch.equal(got, want), (got, want)
    batch = 2 * MODES[mode].get("num_beams", 1)
    assert rows == [(batch, ids.shape[1])] + [(batch, 1)] * 11  # the prompt, then one token a step


def test_generate_stops_rows_at_their_end_token_and_runs_on_onnx_runtime(llama_fp32):
    from amp_compiler.onnx_export import CausalLM

    model, path = llama_fp32
    lm = CausalLM(path, model.config, runtime="ort")
    ids, mask = example_prompts(100, seed=7)
    free = _generate(lm, ids, mask)
    end = int(free[0, ids.shape[1] + 2])  # row 0's third new token, made its end
    got, want = _generate(lm, ids, mask, eos_token_id=end), _generate(model, ids, mask, eos_token_id=end)
    assert torch.equal(got, want)
    assert (got[0, ids.shape[1] + 3 :] == 0).all()  # padded after its end


def test_generate_applies_logits_processors_and_feeds_a_streamer(llama_fp32):
    """What generate() adds around the model works over the export as over the model: a
    words ban (a logits processor) and a streamer that sees every token."""
    from amp_compiler.onnx_export import CausalLM

    class Streamer:
        def __init__(self):
            self.seen = []

        def put(self, value):
            self.seen.append(value.clone())

        def end(self):
            self.seen.append(None)

    model, path = llama_fp32
    lm = CausalLM(path, model.config)
    ids, _ = example_prompts(100, seed=7)
    ids = torch.as_tensor(ids[:1])  # a streamer takes one row
    free = _generate(lm, ids, np.ones_like(ids))
    banned = [[int(t)] for t in free[0, ids.shape[1] : ids.shape[1] + 3]]  # its first three new tokens
    streamer = Streamer()
    got = _generate(lm, ids, np.ones_like(ids), bad_words_ids=banned, streamer=streamer)
    want = _generate(model, ids, np.ones_like(ids), bad_words_ids=banned)
    assert torch.equal(got, want) and not set(got[0, ids.shape[1] :].tolist()) & {b[0] for b in banned}
    assert streamer.seen[-1] is None and torch.equal(torch.cat([t.view(-1) for t in streamer.seen[:-1]]), got[0])


def test_causal_lm_refuses_what_the_graph_cannot_give(llama_fp32, tmp_path):
    from amp_compiler.onnx_export import CausalLM

    model, path = llama_fp32
    model.config.save_pretrained(tmp_path)
    lm = CausalLM(path, str(tmp_path))  # a directory holding config.json
    ids = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="logits and the cache only"):
        lm(ids, output_hidden_states=True)
    assert lm(ids).logits.shape == (1, 3, 100)
    with pytest.raises(ValueError, match="decoder-only"):
        CausalLM(path, transformers.T5Config(vocab_size=100, d_model=32, num_layers=1))


@native_only
def test_generate_over_a_bf16_export_runs_the_plan(tmp_path):
    """The BF16 plan under generate(): the compiled model's executed precision checked as the
    export checks it, and greedy tokens those of the numpy loop over the same file."""
    from amp_compiler.onnx_export import CausalLM

    model, path = FAMILIES["qwen2"](), str(tmp_path / "d.onnx")
    export_decoder(model, path, new_tokens=8)
    lm = CausalLM(path, model.config)
    executed = lm.decoder.executed
    # the norms in FP32: fused (RMS, computing in f32 on BF16 in and out) or, where an older
    # OpenVINO does not fuse them, reduced in f32
    assert executed["low_nodes_16bit"] > 0 and "Reduce bf16" not in executed["layers"]
    if "logits" in executed:  # served as the pinned model
        assert executed["fp32_math_16bit_io"] >= 5 or "Reduce f32" in executed["layers"]
        assert executed["logits"] == "FullyConnected bf16 f32"
    else:
        assert "RMS f32" in executed["layers"] or "Reduce f32" in executed["layers"]
    ids, mask = example_prompts(100, seed=7)
    got = _generate(lm, ids, mask)[:, ids.shape[1] :].numpy()
    np.testing.assert_array_equal(got, Decoder(path).generate(ids, mask, 12))


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_fp32_export_for_openvino_fuses_attention_with_its_cache(family, tmp_path):
    """For OpenVINO an FP32 decoder's attention is ONNX's Attention, laid out so OpenVINO's CPU
    plugin fuses it with the stateful cache (what ran: its ScaledDotProductAttention layers, no
    MatMul/Softmax left), the cache held in FP32 as the graph gives it (OpenVINO's default
    would store it as u8); the tokens stay transformers' own."""
    import json

    from amp_compiler.onnx_export.openvino import attention_fuses_here, compile_stateful

    if not attention_fuses_here():
        pytest.skip("attention cannot be fused here (OpenVINO or onnxscript too old): it is written out")
    model, path = FAMILIES[family](), str(tmp_path / "d.onnx")
    report = export_decoder(model, path, dtype="fp32", target="openvino", new_tokens=NEW)
    assert report.opset == 23 and report.generation["tokens_differing"] == 0
    assert json.load(open(report.settings_path))["KV_CACHE_PRECISION"] == "f32"
    compiled, _ = compile_stateful(path, report.layout)
    assert compiled.get_property("KV_CACHE_PRECISION").to_string() == "f32"
    kinds = [op.get_rt_info()["layerType"].astype(str) for op in compiled.get_runtime_model().get_ordered_ops()]
    assert kinds.count("ScaledDotProductAttention") == report.layout.layers
    assert "Softmax" not in kinds and "MatMul" not in kinds
    ids, mask = example_prompts(100, seed=5)
    np.testing.assert_array_equal(Decoder(path).generate(ids, mask, NEW), hf_greedy(model, ids, mask))


def _round_trip_graph(source, middle, moves):
    """x (``source``) -> Cast(``middle``) -> ``moves`` -> Cast(back to ``source``) -> y."""
    import onnx
    import onnx_ir as ir
    from onnx import TensorProto, helper

    shape = [1, 2, 3, 4]
    nodes, value = [helper.make_node("Cast", ["x"], ["wide"], to=middle)], "wide"
    for i, op in enumerate(moves):
        extra = {"Unsqueeze": ["axes"], "Reshape": ["shape"]}[op]
        nodes.append(helper.make_node(op, [value, *extra], [f"m{i}"]))
        value = f"m{i}"
    nodes.append(helper.make_node("Cast", [value], ["y"], to=source))
    nodes.append(helper.make_node("Neg", ["y"], ["z"]))  # what reads the round trip
    inits = [
        helper.make_tensor("axes", TensorProto.INT64, [1], [0]),
        helper.make_tensor("shape", TensorProto.INT64, [4], shape),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", source, shape)],
        [helper.make_tensor_value_info("z", source, shape)], inits,
    )  # fmt: skip
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]))
    return ir.serde.deserialize_model(model)  # every value typed, as the exporter writes them


@pytest.mark.parametrize(
    "source, middle, moves, casts_left",
    [
        ("BFLOAT16", "FLOAT", ["Unsqueeze", "Reshape"], 0),  # a 16-bit cache's repeat: moved in 16 bit
        ("BFLOAT16", "FLOAT", [], 0),
        ("FLOAT16", "FLOAT", ["Reshape"], 0),
        ("BFLOAT16", "FLOAT16", ["Reshape"], 2),  # not exact: bf16's range does not fit f16
        ("FLOAT", "BFLOAT16", ["Reshape"], 2),  # a rounding, not a widening
    ],
)
def test_only_exact_round_trips_through_moves_are_folded(source, middle, moves, casts_left):
    from onnx import TensorProto

    from amp_compiler.onnx_export.openvino import fold_round_trips

    model = _round_trip_graph(getattr(TensorProto, source), getattr(TensorProto, middle), moves)
    fold_round_trips(model.graph)
    assert [n.op_type for n in model.graph].count("Cast") == casts_left
    assert [n.op_type for n in model.graph if n.op_type != "Cast"] == [*moves, "Neg"]
    if casts_left == 0:  # the moves now carry the 16-bit values, Neg reads them
        assert all(n.outputs[0].dtype.name == source for n in model.graph)


def _rotate_half_graph(widened_elsewhere: bool):
    """Rotary's rotate-half of a BF16 ``x`` (Slice, Neg, Concat) widened to FP32 and scaled;
    ``widened_elsewhere``: ``x`` also has a widening of its own (rotary's ``x * cos`` path)."""
    import onnx
    import onnx_ir as ir
    from onnx import TensorProto, helper

    shape = [1, 2, 3, 8]
    nodes = [
        helper.make_node("Slice", ["x", "zero", "half", "last"], ["lo"]),
        helper.make_node("Slice", ["x", "half", "end", "last"], ["hi"]),
        helper.make_node("Neg", ["hi"], ["neg"]),
        helper.make_node("Concat", ["neg", "lo"], ["rot"], axis=-1),
        helper.make_node("Cast", ["rot"], ["rot32"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["rot32", "scale"], ["y"]),
        helper.make_node("Cast", ["x"], ["same"], to=TensorProto.BFLOAT16),  # a no-op
        helper.make_node("Neg", ["same"], ["z"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)]
    if widened_elsewhere:
        nodes.append(helper.make_node("Cast", ["x"], ["x32"], to=TensorProto.FLOAT))
        nodes.append(helper.make_node("Mul", ["x32", "scale"], ["w"]))  # after: the rewrite must reorder
        outputs.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, shape))
    outputs.append(helper.make_tensor_value_info("z", TensorProto.BFLOAT16, shape))
    inits = [
        helper.make_tensor(n, TensorProto.INT64, [1], [v])
        for n, v in (("zero", 0), ("half", 4), ("end", 8), ("last", -1))
    ] + [helper.make_tensor("scale", TensorProto.FLOAT, [8], np.linspace(-2, 3, 8).tolist())]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, shape)], outputs, inits
    )
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]))
    return ir.serde.deserialize_model(model)


@pytest.mark.parametrize("widened_elsewhere", [True, False])
def test_rotate_half_is_computed_from_the_widening_the_graph_has(widened_elsewhere):
    """The exact ops between a BF16 value and its widening run on a widening the graph already
    has (one Convert fewer; OpenVINO then fuses FP32 rotary): the same values, no Cast added,
    none moved where there is no widening to share; a Cast to the dtype it reads is dropped."""
    import onnx_ir as ir
    import openvino as ov
    import torch
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    from amp_compiler.onnx_export.openvino import widen_first

    x = torch.randn(1, 2, 3, 8).to(torch.bfloat16).view(torch.uint16).numpy()

    def run(model):
        compiled = ov.Core().compile_model(
            ov.Core().read_model(ir.serde.serialize_model(model).SerializeToString(), b""),
            "CPU",
            {"INFERENCE_PRECISION_HINT": "f32"},
        )
        return [r.tobytes() for r in compiled(ov.Tensor(x, x.shape, ov.Type.bf16)).values()]

    before = _rotate_half_graph(widened_elsewhere)
    want = run(_rotate_half_graph(widened_elsewhere))
    widen_first(before.graph)
    RemoveUnusedNodesPass()(before)  # as the export does after
    ops = [(n.op_type, n.outputs[0].dtype.name) for n in before.graph]
    casts = [o for o in ops if o[0] == "Cast"]
    if widened_elsewhere:
        assert casts == [("Cast", "FLOAT")]
        assert {o for o in ops if o[0] in ("Slice", "Neg", "Concat")} == {
            ("Slice", "FLOAT"), ("Neg", "FLOAT"), ("Concat", "FLOAT"), ("Neg", "BFLOAT16")
        }  # fmt: skip
    else:
        assert casts == [("Cast", "FLOAT")] and ("Concat", "BFLOAT16") in ops
    got = run(before)
    assert got == want  # bit for bit
