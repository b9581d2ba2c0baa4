"""The CLI, driven as a user would: through a subprocess where the entry point, the
terminal view, exit codes or the demo are what is tested; in-process (``ok_here``, the same
``main``) for the output formats, where start-up and imports were most of the time."""

from __future__ import annotations

import html.parser
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
from helpers import cli_here

from amp_compiler.device import resolve_dtype

HERE = os.path.dirname(__file__)
MODELS = os.path.join(HERE, "fixtures", "models.py")
OVERFLOW = os.path.join(HERE, "fixtures", "overflow_model.py")


def cli(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "amp_compiler", *args], capture_output=True, text=True, timeout=timeout
    )


def ok(*args):
    res = cli(*args)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def ok_here(capsys, *args):
    code, out, err = cli_here(capsys, *args)
    assert code == 0, err[-3000:]
    return out


def test_cli_inspect_table_lists_nodes_and_summary():
    out = ok("inspect", f"{MODELS}:tiny", "--nodes")
    assert "aten.softmax.int" in out and "FP32" in out and "LOW" in out
    assert "nodes per precision: LOW" in out
    assert "casts inserted:" in out and "bytes cast per step:" in out and "unknown ops: none" in out


def test_cli_inspect_default_is_a_module_tree_that_fits_a_terminal(tmp_path, capsys):
    """GPT-2 with 2 layers: a tree of modules (counts per precision, casts, FP32 reasons),
    integer plumbing hidden, no line wider than 120 columns; --all lists every node."""
    pytest.importorskip("transformers")
    factory = tmp_path / "gpt2.py"
    factory.write_text(
        "import torch, transformers\n"
        "def make():\n"
        "    cfg = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2)\n"
        "    return transformers.GPT2LMHeadModel(cfg), {'input_ids': torch.randint(0, 96, (2, 16))}\n"
    )
    tree = ok_here(capsys, "inspect", f"{factory}:make")
    full = ok_here(capsys, "inspect", f"{factory}:make", "--all")
    floats = ok_here(capsys, "inspect", f"{factory}:make", "--nodes")
    assert "transformer" in tree and "h" in tree and "attn" in tree and "LOW" in tree and "casts" in tree
    assert "FP32 x" in tree  # the reasons of a module's FP32 nodes
    assert max(len(line) for line in tree.splitlines()) <= 120
    assert len(tree.splitlines()) < len(floats.splitlines()) < len(full.splitlines())
    assert "aten.arange" in full and "aten.arange" not in floats


def test_cli_inspect_says_when_dynamo_compiled_nothing(tmp_path, capsys):
    """A forward Dynamo never compiles runs in FP32 under amp: inspect says so, not an empty plan."""
    factory = tmp_path / "eager_model.py"
    factory.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = torch.nn.Linear(8, 4)\n"
        "    @torch.compiler.disable\n"
        "    def forward(self, x):\n"
        "        return self.fc(x)\n"
        "def make():\n"
        "    return M(), torch.randn(2, 8)\n"
    )
    assert "Dynamo compiled no graph of this model" in ok_here(capsys, "inspect", f"{factory}:make")
    code, out, err = cli_here(capsys, "inspect", f"{factory}:make", "--format", "json")
    assert code == 0
    assert json.loads(out)["nodes"] == [] and "runs as written, in FP32" in err


def test_cli_inspect_names_parameters_left_outside_every_graph(tmp_path, capsys):
    """Experts behind a data-dependent loop run eagerly: inspect warns, naming them."""
    factory = tmp_path / "routed.py"
    factory.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.inp, self.router = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)\n"
        "        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))\n"
        "    def route(self, h):\n"
        "        chosen, out = self.router(h).argmax(-1), torch.zeros_like(h)\n"
        "        for e, expert in enumerate(self.experts):\n"
        "            rows = torch.where(chosen == e)[0]\n"
        "            out = out.index_add(0, rows, expert(h[rows]))\n"
        "        return out\n"
        "    def forward(self, x):\n"
        "        return self.route(self.inp(x))\n"
        "def make():\n"
        "    return M(), torch.randn(6, 8)\n"
    )
    code, out, err = cli_here(capsys, "inspect", f"{factory}:make")
    assert code == 0 and "LOW 1" in out  # inp compiled; the routing ran eagerly
    assert "taken by no compiled graph" in err and "experts.0.weight" in err and "inp.weight" not in err


def test_cli_inspect_json_schema(capsys):
    plan = json.loads(ok_here(capsys, "inspect", f"{MODELS}:tiny", "--format", "json"))
    assert plan["schema"] == "amp_compiler.plan/1"
    for node in plan["nodes"]:
        assert node["precision"] in {"LOW", "FP32", "PROMOTE", "PASSTHROUGH"} and node["reason"]
    by_op = {n["op"]: n["precision"] for n in plan["nodes"]}
    assert by_op["aten.softmax.int"] == "FP32"
    assert by_op["aten.matmul.default"] == "LOW" and by_op["aten.linear.default"] == "LOW"
    assert plan["summary"]["casts"] > 0


def test_cli_inspect_dot_parses_as_a_graph(tmp_path, capsys):
    pydot = pytest.importorskip("pydot")
    out = tmp_path / "plan.dot"
    ok_here(capsys, "inspect", f"{MODELS}:tiny", "--format", "dot", "-o", str(out))
    graphs = pydot.graph_from_dot_data(out.read_text())
    assert graphs and graphs[0].get_name() == "amp"
    text = out.read_text()
    assert "#9be3b0" in text and "cast -> bf16" in text  # LOW colour, casts visible
    assert sorted(os.listdir(tmp_path)) == ["plan.dot"]  # no temp files left


class _Checker(html.parser.HTMLParser):
    VOID = {"meta", "br", "img", "hr", "input", "link"}

    def __init__(self):
        super().__init__()
        self.stack, self.rows = [], 0

    def handle_starttag(self, tag, attrs):
        if tag not in self.VOID:
            self.stack.append(tag)
        self.rows += tag == "tr"

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, (self.stack[-3:], tag)
        self.stack.pop()


def test_cli_inspect_html_is_well_formed_and_renders(tmp_path, capsys):
    out = tmp_path / "plan.html"
    ok_here(capsys, "inspect", f"{MODELS}:tiny", "--format", "html", "-o", str(out))
    text = out.read_text()
    checker = _Checker()
    checker.feed(text)
    assert checker.stack == []
    assert not re.search(r"<script[^>]*src=|(src|href)=['\"]?https?:", text)  # self-contained
    assert "<details" in text and "class='bar'" in text and "id='q'" in text  # tree, bars, search
    assert "<svg" in text and "cast -&gt; bf16" in text  # small graphs still drawn, casts visible
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium not installed: structure checked, rendering not")
    png = tmp_path / "shot.png"
    _chromium(chromium, tmp_path, f"--screenshot={png}", "--window-size=1200,900", f"file://{out}")
    assert png.exists() and png.stat().st_size > 10_000
    dom = _chromium(chromium, tmp_path, "--dump-dom", f"file://{out}#m=attn").stdout
    assert "data-done" in dom and dom.count("<td><code>") >= 2  # the module's node table, on demand


def _chromium(chromium, tmp_path, *args):
    return subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            f"--user-data-dir={tmp_path / 'profile'}",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_inspect_html_of_a_48_layer_model_is_small_and_quick_to_open(tmp_path, capsys):
    factory = tmp_path / "deep.py"
    factory.write_text(
        "import torch, torch.nn as nn\n"
        "class Block(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.norm, self.up, self.down = nn.LayerNorm(16), nn.Linear(16, 32), nn.Linear(32, 16)\n"
        "    def forward(self, x):\n"
        "        return x + self.down(torch.relu(self.up(self.norm(x)))).softmax(-1)\n"
        "class Deep(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.h = nn.ModuleList(Block() for _ in range(48))\n"
        "    def forward(self, x):\n"
        "        for b in self.h:\n"
        "            x = b(x)\n"
        "        return x\n"
        "def make():\n"
        "    return Deep(), torch.randn(2, 16)\n"
    )
    tree = ok_here(capsys, "inspect", f"{factory}:make")  # the terminal view folds the 48 alike blocks
    assert "0 .. 47: 48 alike" in tree and len(tree.splitlines()) < 30
    out = tmp_path / "deep.html"
    ok_here(capsys, "inspect", f"{factory}:make", "--format", "html", "-o", str(out))
    size = out.stat().st_size
    assert size < 1_000_000, size
    text = out.read_text()
    assert text.count("<details") >= 48 * 4 and "not drawn" in text  # one per module, graph too big to draw
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium not installed: size checked, load time not")
    t0 = time.perf_counter()
    dom = _chromium(chromium, tmp_path, "--dump-dom", f"file://{out}#m=h.47.up").stdout
    seconds = time.perf_counter() - t0
    assert "data-done" in dom and seconds < 20, seconds


def test_cli_inspect_inputs_from_command_line(capsys):
    out = ok_here(capsys, "inspect", f"{MODELS}:tiny_model_only", "--input", "2x8:int64:0-50", "--format", "json")
    assert json.loads(out)["nodes"]


def test_cli_inspect_fp16_and_pins(capsys):
    plan = json.loads(
        ok_here(capsys, "inspect", f"{MODELS}:tiny", "--dtype", "fp16", "--fp32-module", "^head$", "--format", "json")
    )
    assert plan["dtype"] == "fp16"
    head = [n for n in plan["nodes"] if n["module"] == "head"]
    assert head and all(n["precision"] == "FP32" for n in head)


def test_cli_doctor_names_the_overflowing_op_and_fixes_it(capsys):
    out = ok_here(capsys, "doctor", f"{OVERFLOW}:make")
    assert "[fp16]" in out and "first Inf/NaN: node 'mul_1' (aten.mul.Tensor" in out
    assert "beyond FP16 range (|x| > 65504): node 'mul_1'" in out
    assert "proposed pins: fp32_modules=" in out and "re-run [fp16] with pins: fixed" in out


def test_cli_doctor_clean_model_needs_no_pins(capsys):
    out = ok_here(capsys, "doctor", f"{MODELS}:tiny", "--dtype", "bf16")
    assert "first Inf/NaN: none" in out and "no pins needed" in out


@pytest.mark.parametrize(
    "args,message",
    [
        (["inspect", "nope/missing.py:make"], "no such file: 'nope/missing.py'"),
        (["inspect", "no_such_pkg_xyz:make"], "cannot import module 'no_such_pkg_xyz'"),
        (["inspect", f"{MODELS}:broken"], "failed: RuntimeError: weights not found"),
        (["inspect", f"{MODELS}:absent"], "has no callable 'absent'"),
        (["inspect", f"{MODELS}:tiny_model_only"], "returned no example inputs"),
        (["inspect", f"{MODELS}:tiny_model_only", "--input", "2by8"], "write SHAPE[:DTYPE"),
        (["inspect", f"{MODELS}"], "must be 'package.module:factory'"),
        (["inspect", f"{MODELS}:tiny", "--format", "svg"], "invalid choice: 'svg'"),
        (["inspect", "missing.onnx"], "no such file: 'missing.onnx'"),
        (["doctor", f"{MODELS}:broken"], "weights not found"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_cli_errors_exit_2_with_one_line(capsys, args, message):
    code, _, err = cli_here(capsys, *args)
    assert code == 2, (code, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "args,message",
    [
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["inspect", f"{MODELS}:broken"], "failed: RuntimeError: weights not found"),
    ],
)
def test_cli_errors_exit_2_with_one_line_from_a_fresh_process(args, message):
    # what a shell sees: exit status and stderr of the real entry point, import-time noise included
    res = cli(*args)
    assert res.returncode == 2, (res.returncode, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("command", [[], ["inspect"], ["doctor"], ["calibrate"], ["demo"], ["export"]])
def test_cli_help_on_every_command(capsys, command):
    code, out, _ = cli_here(capsys, *command, "--help")
    assert code == 0 and "usage: amp-compiler" in out


def _bf16_onnx(path, with_reduce=False):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto as T
    from onnx import helper

    nodes = [
        helper.make_node("Cast", ["x"], ["xb"], to=T.BFLOAT16),
        helper.make_node("MatMul", ["xb", "w"], ["m"]),
        helper.make_node("Cast", ["m"], ["mf"], to=T.FLOAT),
        helper.make_node("Softmax", ["mf"], ["y"], axis=-1),
    ]
    if with_reduce:
        nodes.append(helper.make_node("ReduceMean", ["m"], ["r"], keepdims=1))
    w = helper.make_tensor("w", T.BFLOAT16, [4, 4], [0x3F80] * 16)
    outputs = [helper.make_tensor_value_info("y", T.FLOAT, [2, 4])]
    if with_reduce:
        outputs.append(helper.make_tensor_value_info("r", T.BFLOAT16, None))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT, [2, 4])], outputs, initializer=[w])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 22)]), str(path))


def test_cli_inspect_onnx_histogram_casts_and_kernels(tmp_path, capsys):
    path = tmp_path / "m.onnx"
    _bf16_onnx(path, with_reduce=True)
    report = json.loads(ok_here(capsys, "inspect", str(path), "--ep", "cpu", "--format", "json"))
    hist = {(h["op"], h["dtype"]): h["count"] for h in report["histogram"]}
    assert hist[("MatMul", "bf16")] == 1 and hist[("Softmax", "fp32")] == 1
    assert report["casts"] == {"fp32->bf16": 1, "bf16->fp32": 1}
    cpu_bad = {u["op"] for u in report["unsupported"]}
    assert cpu_bad == {"MatMul", "ReduceMean"}
    cuda = json.loads(ok_here(capsys, "inspect", str(path), "--ep", "cuda", "--format", "json"))
    assert {u["op"] for u in cuda["unsupported"]} == {"ReduceMean"}
    assert "no CPU kernel" in ok_here(capsys, "inspect", str(path), "--ep", "cpu")


def test_cli_demo_runs_and_compares(tmp_path, real_machine):
    # auto decides by the hardware: BF16 where it is native, FP32 where 16 bit is emulated
    choice, reason = resolve_dtype("auto", torch.device("cpu"))
    out = ok("demo", "--steps", "4", "--inner", "eager")
    first = " ".join(out.split("\n")[:2]).split()
    assert first[:2] == ["Precision:", choice] and " ".join(reason.split()[:3]) in " ".join(first)
    assert f"Precision plan: {choice}" in out and "amp speed vs FP32" in out and f"amp-{choice}" in out


def test_cli_env_states_torch_and_the_tested_range(capsys, monkeypatch, amp_log):
    """``env`` names torch and the integrations, says whether torch is in the tested range, and
    warns (on stderr, exit 0) where it is not; the backend warns once through amp's logger."""
    import importlib.metadata

    import amp_compiler
    from amp_compiler import upstream

    low, high = upstream.TESTED_TORCH
    code, out, err = cli_here(capsys, "env")
    assert code == 0 and not err
    assert f"torch {torch.__version__} (inside the tested range {low[0]}.{low[1]}-{high[0]}.{high[1]})" in out
    assert f"transformers {importlib.metadata.version('transformers')}" in out
    assert 'dtype="auto": ' in out

    monkeypatch.setattr(upstream, "TESTED_TORCH", ((1, 0), (1, 9)))  # as if torch had moved past it
    code, out, err = cli_here(capsys, "env")
    assert code == 0 and "outside the tested range 1.0-1.9" in out
    assert f"torch {torch.__version__} is newer than amp-compiler's tested range (1.0-1.9)" in err
    upstream.warn_outside_tested_range.cache_clear()
    for _ in range(2):
        amp_compiler.AmpBackend()
    upstream.warn_outside_tested_range.cache_clear()
    assert [r.getMessage().count("newer than amp-compiler's tested range") for r in amp_log] == [1]
    monkeypatch.undo()
    assert "older than" in upstream.torch_range_said("0.9.0")
    assert upstream.torch_range_said(f"{low[0]}.{low[1]}.0+cu130") is None
