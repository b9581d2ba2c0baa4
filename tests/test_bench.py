"""Bytes saved for backward, and the benchmark that is the source of the README's figures."""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import LOW_EXEC

from amp_compiler import AmpBackend, loss_head

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))
from helpers import cosine  # noqa: E402

import bench  # noqa: E402


def saved_bytes(fwd, model, x, autocast=False) -> int:
    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return fwd(x)

    return bench.saved_bytes(forward, model.parameters(), lambda out: out.float().pow(2).mean())


def test_explicit_softmax_attention_saves_no_more_than_autocast():
    """The FP32 softmax's backward reads the BF16 copy the next matmul saves anyway, so the
    FP32 probabilities are not kept (before: amp saved them beside the BF16 copy)."""
    torch.manual_seed(0)
    model = bench.LM(d=64, layers=2, heads=4, seq=32, vocab=128, explicit=True)
    x = torch.randint(0, 128, (4, 32))
    ref = model(x).float().pow(2).mean()
    ref.backward()
    ref_grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()

    auto = torch.compile(model)
    saved_bytes(auto, model, x, autocast=True)
    theirs = saved_bytes(auto, model, x, autocast=True)
    model.zero_grad()
    torch._dynamo.reset()
    amp = torch.compile(model, backend=AmpBackend(inner="inductor"))
    saved_bytes(amp, model, x)
    model.zero_grad()
    ours = saved_bytes(amp, model, x)
    assert ours <= theirs, (ours, theirs)
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert cosine(grads, ref_grads) >= 0.999


def test_bench_runs_side_by_side_and_writes_json_plot_and_table(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    # bf16 asked for: the rewrite is checked on any CPU (tiny, so cheap where BF16 is emulated)
    assert (
        bench.main(
            [
                "--size",
                "tiny",
                "--dtype",
                "bf16",
                "--workloads",
                "lm-explicit",
                "--variants",
                "fp32-eager,amp-step",
                "--reps",
                "2",
                "--steps",
                "1",
                "--json",
                str(out),
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    results = json.loads(out.read_text())
    runs = results["workloads"]["lm-explicit"]["variants"]
    assert set(runs) == {"fp32-eager", "amp-step"}
    for r in runs.values():
        assert r["step_ms"] > 0 and len(r["step_ms_samples"]) == 2 and r["first_call_s"] > 0
        assert r["saved_bytes"] > 0 and r["grad_cos"] > 0.99
    assert runs["amp-step"]["casts"] > 0 and runs["amp-step"]["plan"]["nodes"]["LOW"] > 0
    assert runs["amp-step"]["kernels"] > 0 and runs["fp32-eager"]["kernels"] is None
    assert results["machine"]["cpu_kind"] and png.stat().st_size > 1000
    capsys.readouterr()
    bench.main(["--table", str(out)])
    table = capsys.readouterr().out
    assert "| amp-step |" in table and "python" in table and "| kernels |" in table
    # where the step's time went: fp32 eager's is GEMMs and ATen ops, none generated;
    # amp-step's GEMMs run through ATen beside Inductor's kernels and the fused optimizer
    eager, amp = runs["fp32-eager"]["breakdown"], runs["amp-step"]["breakdown"]
    assert sum(eager.values()) == pytest.approx(1.0) and sum(amp.values()) == pytest.approx(1.0)
    assert eager["gemm"] > 0 and "generated" not in eager
    assert amp["gemm"] > 0 and amp["generated"] > 0
    assert "| time by kind % |" in table and "GEMM " in table


def test_breakdown_kinds_of_profiler_names():
    kinds = {
        "aten::addmm": "gemm",
        "mkldnn::_linear_pointwise": "gemm",
        "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
        "## Call CompiledFxGraph fabc ##": "generated",
        "aten::_fused_adamw_": "optimizer",
        "aten::_to_copy": "casts",
        "aten::gelu": "other",
    }
    assert {name: bench.breakdown_kind(name) for name in kinds} == kinds
    assert bench.format_breakdown({"gemm": 0.531, "generated": 0.34, "optimizer": 0.07, "other": 0.02}) == (
        "GEMM 53 gen 34 opt 7"
    )


def test_lowmem_variant_is_the_training_step_under_an_explicit_budget():
    """Named only: the step whose partitioner may recast the weights' 16-bit copies."""
    model, _, _, loss_fn, _ = bench.build("lm-sdpa", bench.SIZES["tiny"], "cpu")
    variants = {n: bench.make_variant(n, model, loss_fn, "bf16", "cpu") for n in ("amp-step", "amp-step-lowmem")}
    assert variants["amp-step"].train_step.backend.options.memory_budget is None
    assert variants["amp-step-lowmem"].train_step.backend.options.memory_budget == bench.LOWMEM_BUDGET
    assert "amp-step-lowmem" not in bench.VARIANTS  # not in a default run


def test_paired_ratio_cancels_drift_between_repetitions():
    # the machine slows down 3x in the second repetition: both variants feel it
    ours, theirs = [90.0, 270.0, 95.0], [100.0, 300.0, 100.0]
    assert bench.paired_ratio(ours, theirs) == pytest.approx(0.9)
    assert bench.paired_ratio(theirs, theirs) == 1.0


def test_table_of_a_run_without_16_bit_variants_compares_with_inductor_fp32():
    # auto where 16 bit is emulated: amp runs FP32, and its target is Inductor FP32's step
    run = {"fp32-inductor": [100.0, 200.0], "amp": [104.0, 190.0]}
    workload = {
        "variants": {
            name: {
                "step_ms": statistics.median(s),
                "step_ms_samples": s,
                "infer_ms": 1.0,
                "saved_bytes": 2**20,
                "first_call_s": 1.0,
                "casts": 0,
            }
            for name, s in run.items()
        }
    }
    assert bench.baseline(workload) == "fp32-inductor"
    amp = dict(zip(("variant",) + bench.COLUMNS, bench.rows(workload)[1]))
    assert amp["vs {base}"] == f"{147.0 / 150.0:.2f}" and amp["paired"] == f"{(1.04 + 0.95) / 2:.2f}"
    text = bench.markdown(
        {
            "machine": {
                "date": "d",
                "cpu": "c",
                "cpu_kind": "k",
                "threads": 2,
                "torch": "t",
                "dtype": "fp32",
                "dtype_reason": "r",
                "command": "python tools/bench.py",
            },
            "workloads": {"lm": workload},
        }
    )
    assert "| vs fp32-inductor |" in text and "autocast+inductor |" not in text


def test_roofline_divides_each_dtypes_gemms_by_that_dtypes_peak():
    """The exact head's FP32 projection against the FP32 peak, its 16-bit body against the
    16-bit one (it was all divided by an emulated BF16 peak: 944%); FP32 variants all FP32."""
    size = {"batch": 4, "seq": 512, "d": 512, "vocab": 32768}
    head = 6 * 4 * 512 * 512 * 32768
    flops = 3 * head
    peaks = {"bf16": 2.0, "fp32": 0.4}
    parts = bench.gemm_flops_by_dtype("amp-step-exact", "lm-head-32k", size, flops, "bf16")
    assert parts == {"fp32": head, "bf16": 2 * head}
    ideal_ms = (head / 0.4e12 + 2 * head / 2.0e12) * 1e3
    assert bench.roofline("amp-step-exact", "lm-head-32k", size, flops, ideal_ms * 2, "bf16", peaks) == pytest.approx(
        0.5
    )
    assert bench.gemm_flops_by_dtype("fp32-eager", "lm-head-32k", size, flops, "bf16") == {"fp32": flops}
    assert bench.gemm_flops_by_dtype("amp-step", "lm-head-32k", size, flops, "bf16") == {"bf16": flops}
    assert bench.roofline("amp-step", "lm-sdpa", size, flops, 1.0, "bf16", {"fp32": 0.4}) is None
    # split products (CUDA, or oneDNN's BF16 products on AMX): three BF16 GEMMs for each FP32 one
    split = bench.gemm_flops_by_dtype("amp-step-exact", "lm-head-32k", size, flops, "bf16", "split-onednn")
    assert split == {"bf16": 5 * head}


def test_head_block_tool_times_both_ways_of_the_same_math(capsys):
    import head_block

    assert head_block.main(["--size", "64", "--std", "2", "--reps", "2"]) == 0
    out = capsys.readouterr().out
    for name in ("forward, ATen calls", "forward, generated", "backward, ATen calls", "backward, generated"):
        assert name in out
    # both sides compute the same numbers
    g = torch.Generator().manual_seed(3)
    z = (torch.randn(16, 16, generator=g) * 16).bfloat16()
    at = torch.randint(-1, 16, (16,), generator=g)
    top, zeros = torch.full((16,), float("-inf")), torch.zeros(16)
    want = head_block.eager_forward(z, top, zeros.clone(), at)
    got = loss_head.kernels.stats_block(z, loss_head.kernels.start_stats(16, z), at, (), False, (False, False, False))
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    torch.testing.assert_close(got[2], torch.where(at >= 0, want[2], 0.0))


def test_serve_bench_times_every_served_form_and_names_what_it_skipped(tmp_path, capsys):
    import serve_bench

    pytest.importorskip("transformers")
    pytest.importorskip("onnxruntime")
    out = tmp_path / "serve.json"
    argv = ["--d", "32", "--layers", "1", "--vocab", "64", "--shapes", "2x16", "--reps", "2", "--json", str(out)]
    assert serve_bench.main(argv) == 0
    result = json.loads(out.read_text())
    timed = set(result["shapes"]["2x16"])
    # every variant is timed or skipped with the reason, never both, never neither
    assert timed | set(result["skipped"]) == set(serve_bench.VARIANTS) and not timed & set(result["skipped"])
    assert {"eager-fp32", "autocast-inductor", "amp", "ort-cpu-fp32"} <= timed
    assert result["shapes"]["2x16"]["ort-cpu-fp32"]["vs_ort-cpu-fp32"] == 1.0
    if "openvino-bf16" not in timed:
        why = result["skipped"]["openvino-bf16"]
        assert "no native BF16" in why or "openvino" in why, why
    assert all(v["peak_rss_bytes"] > 2**20 and v["disk_bytes"] > 0 for v in result["variants"].values())
    assert "| 2x16 | amp |" in capsys.readouterr().out


def test_serve_bench_generation_mode_times_tokens_and_compares_them(tmp_path, capsys, inductor_recorded):
    """--generate: every variant timed or skipped with the reason; the FP32 export's tokens
    are eager FP32's (the comparison can say so), the BF16 ones are compared too; the
    compiled generate() ran amp's 16-bit plan; each variant's cache precision is read back."""
    import serve_bench
    from benchkit.generation import COMPILED_VARIANTS, GEN_VARIANTS

    pytest.importorskip("transformers")
    pytest.importorskip("openvino")
    out = tmp_path / "gen.json"
    argv = ["--generate", "--d", "64", "--layers", "1", "--vocab", "128", "--batches", "2", "--prompt-lengths", "8"]
    argv += ["--no-memory"]
    plot = tmp_path / "gen.png"
    assert (
        serve_bench.main(argv + ["--new-tokens", "6", "--gen-reps", "1", "--json", str(out), "--plot", str(plot)]) == 0
    )
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads(out.read_text())
    timed = set(result["cases"]["2x8"])
    every = set(GEN_VARIANTS + COMPILED_VARIANTS)
    assert timed | set(result["skipped"]) == every and not timed & set(result["skipped"])
    assert {"eager-fp32", "openvino-fp32", *COMPILED_VARIANTS} <= timed
    amp = result["amp_graphs"]["amp-static"]  # prompt and later tokens: two graphs, each with 16-bit ops
    assert amp["graphs"] == 2 and all(n > 0 for n in amp["low_ops"])
    ran = inductor_recorded.dtypes_of(*LOW_EXEC)  # what amp's graphs executed (a recording inner backend)
    assert ran and all(d[0] == torch.bfloat16 for d in ran), ran
    assert all(result["cases"]["2x8"][k]["compile_s"] > 0 for k in COMPILED_VARIANTS)
    cache = {k: (c["precision"], c["bytes_per_token"]) for k, c in result["cache"].items()}
    # key and value, 1 layer, 1 KV head of 32, FP32
    assert cache["eager-fp32"] == cache["openvino-fp32"] == ("f32", 2 * 1 * 1 * 32 * 4)
    if "openvino-amp-bf16" in timed:
        assert cache["openvino-amp-bf16"] == ("bf16", 128)
    for k in timed:
        r = result["cases"]["2x8"][k]
        assert r["first_token_ms"] > 0 and r["per_token_ms"] > 0
    assert result["cases"]["2x8"]["openvino-fp32"]["tokens_differing_vs_fp32"] == 0
    assert "| 2x8 | openvino-fp32 |" in capsys.readouterr().out


def test_head_decoder_tool_runs_every_variant_and_the_fused_head_executes(capsys, tmp_path):
    import head_decoder

    argv = ["--vocab", "8192", "--d", "32", "--layers", "1", "--seq", "32", "--reps", "1"]
    out = tmp_path / "h.json"
    with torch.profiler.profile() as prof:
        assert head_decoder.main(argv + ["--variants", "autocast-inductor,fused", "--json", str(out)]) == 0
    assert any(e.name == "amp::head_stats" for e in prof.events())  # the tied matmul head was fused
    report = json.loads(out.read_text())
    saved = {k: v["saved_bytes"] for k, v in report["variants"].items()}
    assert saved["fused"] + 2 * 32 * 8192 <= saved["autocast-inductor"]  # no 16-bit logits kept
    assert report["machine"]["cpu_kind"] and report["size"]["vocab"] == 8192
    assert head_decoder.main(argv + ["--variants", "off,exact,auto"]) == 0
    printed = capsys.readouterr().out
    for k in head_decoder.VARIANTS:
        assert f"{k}: " in printed
    assert "vocabulary 8192" in printed
    assert "(auto: left as written, faster" in printed  # 1 MiB of logits: the plan's choice, printed
    assert head_decoder.main(argv + ["--variants", "auto", "--returns-logits"]) == 0
    assert "(auto: left as written: its logits are kept for" in capsys.readouterr().out


def test_head_decoder_sets_the_one_pass_heads_row_blocks(tmp_path, monkeypatch):
    """--ahead-rows: 256 tokens in row blocks of 64 (the figures say so), the head's gradients
    computed in forward; the flag's blocks are what the op ran with."""
    import head_decoder

    shapes = []
    real = loss_head.ahead_shape
    # a spy on the shapes the op cuts its blocks to
    monkeypatch.setattr(loss_head.ops, "ahead_shape", lambda *a, **k: shapes.append(real(*a, **k)) or shapes[-1])
    before = loss_head.settings()
    argv = ["--vocab", "8192", "--d", "32", "--layers", "1", "--seq", "128", "--reps", "1", "--variants", "fused"]
    out = tmp_path / "h.json"
    with torch.profiler.profile() as prof:
        assert head_decoder.main([*argv, "--ahead-rows", "64", "--json", str(out)]) == 0
    assert any(e.name == "amp::head_stats_backward_ahead" for e in prof.events())
    assert json.loads(out.read_text())["size"]["ahead_rows"] == 64
    assert (64, 8192) in shapes and loss_head.settings() == before  # the flag's rows, then the defaults again
    with pytest.raises(SystemExit, match="--ahead-rows: a positive number"):
        head_decoder.main([*argv, "--ahead-rows", "0"])


def _split_gemms(monkeypatch) -> list[int]:
    """GEMMs run under oneDNN's BF16 products, a count per time the mode is switched on."""
    split, mode = [], loss_head.exact.bf16_products

    @contextlib.contextmanager
    def counted():
        with mode(), torch.profiler.profile() as prof:
            yield
        split.append(sum(e.name in ("aten::mm", "aten::addmm_") for e in prof.events()))

    monkeypatch.setattr(loss_head.exact, "bf16_products", counted)
    return split


def test_head_decoder_exact_variants_split_as_they_say(tmp_path, monkeypatch, capsys):
    """``exact-split`` runs the exact head's GEMMs split through oneDNN's BF16 products (played
    here: the mode honoured), three to a product under that mode, ``exact-fp32`` none, and
    ``exact`` as its timing of one block chose (here: as if the split were slower), by what
    executed; the JSON says whether this machine honours the mode and what the timing found;
    the switch is back to "auto" after each variant. Where the mode is not honoured the two
    named variants are left out, saying why."""
    import head_decoder

    argv = ["--vocab", "8192", "--d", "32", "--layers", "1", "--seq", "64", "--reps", "1"]
    with loss_head.tuned(bf16_products=False):
        assert head_decoder.main([*argv, "--variants", "exact,exact-split,exact-fp32"]) == 0
    printed = capsys.readouterr().out
    for name in ("exact-split", "exact-fp32"):
        assert f"{name} left out" in printed and f"{name}: " not in printed
    split = _split_gemms(monkeypatch)
    out = tmp_path / "h.json"
    with loss_head.tuned(bf16_products=True, split_ms={32: (3.0, 1.0)}):
        assert head_decoder.main([*argv, "--variants", "exact-split", "--json", str(out)]) == 0
        assert split and set(split) == {3}
        for name in ("exact", "exact-fp32"):
            split.clear()
            assert head_decoder.main([*argv, "--variants", name]) == 0
            assert not split, name
        machine = json.loads(out.read_text())["machine"]
        assert machine["bf16_products"] is True and machine["split_timings"] == {"32": [3.0, 1.0]}
        s = loss_head.settings()
        assert s.split_onednn == "auto" and loss_head.exact_products(torch.device("cpu"), 32) == "fp32"


def test_head_decoder_split_twin_runs_the_split_as_fp32_gemms_where_it_is_not_real(tmp_path, monkeypatch):
    """``--split-twin`` on a CPU whose oneDNN runs no BF16 products: ``exact-split`` runs (three
    GEMMs to a product under the mode, by what executed), the JSON says it was the twin and
    keeps the machine's real answer, and the probe is the real one again after; refused where
    the split is real."""
    import head_decoder

    argv = ["--vocab", "8192", "--d", "32", "--layers", "1", "--seq", "64", "--reps", "1"]
    split = _split_gemms(monkeypatch)
    out = tmp_path / "twin.json"
    with loss_head.tuned(bf16_products=False) as machine:
        assert head_decoder.main([*argv, "--split-twin", "--variants", "exact-split", "--json", str(out)]) == 0
        assert loss_head.settings() is machine  # the twin's setting undone
    report = json.loads(out.read_text())
    assert split and set(split) == {3} and "exact-split" in report["variants"]
    assert report["split_twin"] is True and report["machine"]["bf16_products"] is False
    with loss_head.tuned(bf16_products=True), pytest.raises(SystemExit, match="here the split is real"):
        head_decoder.main([*argv, "--split-twin"])


def test_native_check_script_is_valid_and_calls_existing_tools():
    """tools/native_check.sh (the native-BF16 figures in one command): valid bash, and every
    tool and option it runs exists (a renamed flag would fail only on the machine it is for)."""
    import re
    import subprocess

    script = Path(__file__).parent.parent / "tools" / "native_check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text().replace("\\\n", " ")
    calls = re.findall(r'"\$PY" (tools/\w+\.py)([^\n]*)', text)
    assert {c[0] for c in calls} == {
        "tools/bench.py",
        "tools/head_decoder.py",
        "tools/trl_bench.py",
        "tools/restart_bench.py",
    }
    usages = {}  # one --help per tool: each start imports torch and transformers
    for tool, args in calls:
        if tool not in usages:
            usages[tool] = subprocess.run(
                [sys.executable, str(script.parent.parent / tool), "--help"], capture_output=True, text=True, check=True
            ).stdout
        usage = usages[tool]
        for flag in re.findall(r"(--[a-z-]+)", args):
            assert flag in usage, (tool, flag)
        for names in re.findall(r"--workloads ([\w,-]+)", args):
            known = {*bench.WORKLOADS, *bench.HF_WORKLOADS, *bench.HEAD_WORKLOADS}
            assert set(names.split(",")) <= known, names
        if tool == "tools/bench.py":
            for names in re.findall(r"--variants ([\w,-]+)", args):
                assert set(names.split(",")) <= {*bench.VARIANTS, *bench.EXTRA_VARIANTS}, names


def test_fused_attention_variant_keeps_the_fused_kernel():
    """amp-fused-attention (native_check's crossover check) hands Inductor the fused SDPA op
    where amp's default writes a short one out as matmul -> softmax -> matmul."""
    size = bench.SIZES["tiny"]
    model, x, y, loss_fn, _ = bench.build("lm-sdpa", size, "cpu")
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    kept = {}
    for name in ("amp", "amp-fused-attention"):
        v = bench.make_variant(name, model, loss_fn, "bf16", "cpu")
        with torch.no_grad():
            v.forward(x)
        kept[name] = sum(n.target is sdpa for r in v.backend.records for n in r.graph.graph.nodes)
    assert kept["amp-fused-attention"] == size["layers"] and kept["amp"] == 0


def test_serve_bench_serves_an_optimum_intel_export_beside_ours(tmp_path, capsys):
    """--save-model writes the bench's model for optimum-cli (in a venv of its own);
    --optimum DIR serves that export's openvino_model.xml in the same loop. Here a stand-in
    with optimum-intel's interface (our FP32 decoder, made stateful: input_ids,
    attention_mask, position_ids, beam_idx -> logits): its FP32 tokens are eager FP32's; each
    variant's peak memory is measured alone."""
    import serve_bench

    transformers = pytest.importorskip("transformers")
    ov = pytest.importorskip("openvino")
    from amp_compiler.onnx_export import export_decoder
    from amp_compiler.onnx_export.openvino import stateful_model

    size = ["--d", "64", "--layers", "1", "--vocab", "128"]
    saved = tmp_path / "model"
    assert serve_bench.main(["--generate", *size, "--save-model", str(saved)]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(saved).eval()  # the weights the bench serves
    report = export_decoder(model, str(tmp_path / "d.onnx"), dtype="fp32", target="openvino", new_tokens=4)
    anchor = tmp_path / "optimum"
    anchor.mkdir()
    ov.save_model(stateful_model(str(tmp_path / "d.onnx"), report.layout), str(anchor / "openvino_model.xml"))
    out = tmp_path / "gen.json"
    argv = ["--generate", *size, "--batches", "2", "--prompt-lengths", "8", "--new-tokens", "6", "--gen-reps", "1"]
    argv += ["--variants", "eager-fp32,optimum-f32"]
    assert serve_bench.main(argv + ["--optimum", str(anchor), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    case = result["cases"]["2x8"]
    assert {"optimum-f32", "eager-fp32"} == set(case)
    # each alone in a process of its own: the peak while generating, above what it set up
    assert set(result["memory"]) == set(case) and result["memory_case"] == "2x8"
    assert all(m["peak_bytes"] >= m["setup_bytes"] > 0 for m in result["memory"].values())
    assert case["optimum-f32"]["tokens_differing_vs_fp32"] == 0 and case["optimum-f32"]["per_token_ms"] > 0
    assert "| 2x8 | optimum-f32 |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no openvino_model.xml"):
        serve_bench.main(argv + ["--optimum", str(tmp_path)])


def test_generation_closeness_tool_trains_exports_and_measures_every_form(tmp_path, capsys):
    """tools/generation_closeness.py: train (a few steps here), then measure each served form
    against eager FP32: the FP32 export matches it (KL ~0, every token), the BF16 forms are
    measured by the same numbers."""
    import generation_closeness as gc_

    pytest.importorskip("transformers")
    pytest.importorskip("openvino")
    folder = tmp_path / "trained"
    assert gc_.main(["train", str(folder), "--steps", "2", "--d", "32", "--layers", "1"]) == 0
    from amp_compiler.onnx_export.openvino import native_bf16

    if not native_bf16():
        with pytest.raises(SystemExit, match="measure how close BF16 generation .* no native BF16"):
            gc_.main(["measure", str(folder)])
        return
    assert gc_.main(["measure", str(folder), "--json", str(tmp_path / "c.json")]) == 0
    forms = json.loads((tmp_path / "c.json").read_text())["forms"]
    assert set(forms) == {
        "openvino-fp32", "openvino-own-bf16", "openvino-amp-bf16", "openvino-amp-bf16-fp32-head",
        "openvino-amp-bf16-fp32-head-attention",
    }  # fmt: skip
    assert all(f["prefill_ms"] > 0 and f["per_token_ms"] > 0 for f in forms.values())
    fp32 = forms["openvino-fp32"]
    assert fp32["kl_to_fp32"] < 1e-9 and fp32["top1_agreement"] == 1.0 and fp32["greedy_tokens_differing"] == 0
    assert all(f["kl_to_fp32"] >= 0 and 0 < f["top1_agreement"] <= 1 for f in forms.values())
    assert "| openvino-amp-bf16 |" in capsys.readouterr().out


def test_closeness_of_identical_and_of_different_logits():
    import generation_closeness as gc_

    rng = np.random.default_rng(0)
    logits, rows = rng.normal(size=(2, 5, 7)), rng.integers(0, 7, (2, 5))
    same = gc_.closeness(logits, logits, rows)
    assert same["kl_to_fp32"] == pytest.approx(0, abs=1e-12) and same["top1_agreement"] == 1.0
    other = gc_.closeness(logits + rng.normal(size=logits.shape), logits, rows)
    assert other["kl_to_fp32"] > 0.01 and other["top1_agreement"] < 1.0


def test_restart_bench_warns_when_a_restart_planned_afresh(monkeypatch):
    import restart_bench

    def rows(*planned):
        return {"amp": {"warm_runs": [{"plans": {"planned": n, "restored": 1 - n}} for n in planned]}}

    assert restart_bench.replanned(rows(0, 0)) is None
    monkeypatch.setenv("AMP_COMPILER_PLAN_CACHE", "0")
    assert restart_bench.replanned(rows(1, 1)) == (
        "warning: restarts planned 2 graph(s) afresh (AMP_COMPILER_PLAN_CACHE=0 turns amp's plan cache off)"
    )
    monkeypatch.delenv("AMP_COMPILER_PLAN_CACHE")
    assert "plan cache missed" in restart_bench.replanned(rows(0, 1))


def test_restart_bench_restarts_from_the_caches_and_says_where_the_collector_struck(tmp_path, capsys, monkeypatch):
    """tools/restart_bench.py: a cold process fills the caches; a restart hits AOTAutograd's
    cache on amp's restored plan (planning then only reads it back, as counted); each run says how many
    collections of each generation its first step ran and where each full one struck."""
    import restart_bench

    monkeypatch.delenv("AMP_COMPILER_PLAN_CACHE")  # the suite's default off: a restart as users run it
    out = tmp_path / "r.json"
    restart_bench.main(
        "--layers 1 --d 32 --batch 1 --seq 8 --vocab 64 --threads 1 --warm-runs 1 --variants amp".split()
        + ["--json", str(out)]
    )
    amp = json.loads(out.read_text())["rows"]["amp"]
    cold, (warm,) = amp["cold"], amp["warm_runs"]
    assert cold["caches"]["aot_autograd"].get("autograd_cache_saved") == 1
    assert warm["caches"]["aot_autograd"] == {"autograd_cache_hit": 1}
    # the restart read amp's plan back instead of planning afresh (what ran, not a timing)
    assert cold["plans"]["restored"] == 0 and cold["plans"]["planned"] > 0
    assert warm["plans"] == {"planned": 0, "restored": cold["plans"]["planned"]}
    assert warm["planning_s"] > 0
    for run in (cold, warm):
        assert len(run["full_collections_in"]) == run["gc_collections"][2]
        assert all(":" in where for where in run["full_collections_in"])
    printed = capsys.readouterr().out
    assert "warm vs autocast" in printed and "afresh" not in printed
