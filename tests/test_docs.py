"""The documentation runs: every Python block of README.md and docs/ executes as written.

A page's blocks run in order in one namespace, in a scratch folder (they write files such as
``amp-policy.json``). Inductor stands aside for a recording ``aot_eager`` so the test sees
what executed, op by op: a page that shows amp training or compiling must have run 16-bit
matmuls (a path that silently ran FP32 would pass every printed loss). Inductor itself is
covered by test_codegen_passes.
"""

from __future__ import annotations

import pathlib
import sys
import types

import pytest
import torch
from helpers import MATMULS
from mktestdocs import grab_code_blocks

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
WITH_CODE = [p for p in PAGES if grab_code_blocks(p.read_text(), lang="python")]
# pages whose blocks compile or train through amp: a 16-bit matmul must have executed there
RUNS_16_BIT = {"README.md", "calibration.md", "config.md", "integrations.md", "loss-head.md", "training.md"}
# pages that show an op of amp's own running: it must have executed there
EXECUTES = {"loss-head.md": torch.ops.amp.head_stats}
NEEDS = {
    "integrations.md": ("transformers", "trl", "lightning"),
    "onnx.md": ("onnxruntime",),
    "openvino.md": ("onnx", "openvino"),
}


def _skip_without_native_bf16(page) -> None:
    """The OpenVINO page serves BF16: on a CPU without native BF16 it is refused (as tested)."""
    if page.name == "openvino.md":
        from amp_compiler.onnx_export import native_bf16

        if not native_bf16():
            pytest.skip("this CPU has no native BF16: the page's export is refused here (test_openvino.py)")


@pytest.mark.parametrize("page", WITH_CODE, ids=lambda p: p.name)
def test_page_python_blocks_run(page, tmp_path, monkeypatch, inductor_recorded):
    """Each Python block of the page runs; pages that compile through amp ran 16-bit matmuls."""
    for package in NEEDS.get(page.name, ()):
        pytest.importorskip(package)
    _skip_without_native_bf16(page)
    monkeypatch.chdir(tmp_path)
    page_module = types.ModuleType("amp_docs_page")  # Dynamo looks up the module of code it traces
    monkeypatch.setitem(sys.modules, page_module.__name__, page_module)
    namespace = page_module.__dict__
    for i, block in enumerate(grab_code_blocks(page.read_text(), lang="python")):
        try:
            exec(compile(block, f"{page.name}[block {i}]", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"{page.name}, Python block {i} failed: {type(e).__name__}: {e}\n{block}") from e
    if page.name in RUNS_16_BIT:
        low = [d for d in inductor_recorded.dtypes_of(*MATMULS) if d and d[0] in (torch.bfloat16, torch.float16)]
        assert low, f"{page.name} compiles through amp, yet no 16-bit matmul executed"
    if page.name == "openvino.md":  # OpenVINO's runtime model said which precision ran
        executed = namespace["executed"]
        assert executed["low_nodes_16bit"] > 0, executed
        assert executed["low_nodes_16bit"] + executed["low_nodes_unnamed"] == executed["low_nodes"], executed
        decoder = namespace["report"]  # the decoder's export: BF16 ran, tokens were compared
        assert decoder.layout and decoder.parity["executed_low_nodes_16bit"] > 0, decoder.parity
        assert decoder.generation["new_tokens"] == 32 and namespace["tokens"].shape == (2, 8)
        lm = namespace["lm"]  # generate() over the same file: the plan's precision, read back
        assert lm.decoder.stateful and lm.decoder.executed["low_nodes_16bit"] > 0, lm.decoder.executed
        for out in (namespace["beams"], namespace["sampled"]):  # the prompts, continued (an end token may stop early)
            assert (
                out.shape[0] == 2
                and 5 < out.shape[1] <= 5 + 8
                and torch.equal(out[:, :5], namespace["prompt"]["input_ids"])
            )
    if page.name in EXECUTES:
        assert inductor_recorded.dtypes_of(EXECUTES[page.name]), f"{page.name}: {EXECUTES[page.name]} never ran"


def test_every_page_is_in_the_site_navigation():
    """A page outside mkdocs.yml's nav is one nobody finds."""
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [p.name for p in PAGES[1:] if p.name not in nav]
    assert not missing, f"docs pages missing from mkdocs.yml nav: {missing}"


def test_options_page_is_generated_from_amp_options():
    """docs/options.md is what tools/gen_options_doc.py makes of AmpOptions today."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen", ROOT / "tools" / "gen_options_doc.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (ROOT / "docs" / "options.md").read_text() == gen.render(), (
        "docs/options.md is stale: run python tools/gen_options_doc.py"
    )


def test_readme_stays_a_front_door():
    """The README is the front door (what, two commands, recipes, links); the manual is docs/."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250
    assert 'pip install torch==2.13.0 && pip install -e ".[test]" && amp-compiler demo' in lines
    assert "python -m pytest -q" in lines
