"""The codebase's shape: layered modules, no cycles, no reaching into another module's privates."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _graph_tool():
    spec = importlib.util.spec_from_file_location("module_graph", ROOT / "tools" / "module_graph.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_module_graph_has_no_cycle_upward_or_private_import():
    """Every import goes to the importer's layer or below, and never to a ``_private`` name."""
    assert _graph_tool().problems() == []


def test_module_graph_check_catches_an_upward_and_a_private_import(tmp_path, monkeypatch):
    """The check can fail: a vocabulary module importing the backend's private helper."""
    tool = _graph_tool()
    real = tool.modules()
    bad = tmp_path / "policy.py"
    bad.write_text("from .backend import _saved_tensors_hooks_off\n")
    monkeypatch.setattr(tool, "modules", lambda: {**real, "amp_compiler.policy": bad})
    found = tool.problems()
    assert any(p.startswith("upward import: amp_compiler.policy") for p in found)
    assert "private import: amp_compiler.policy: amp_compiler.backend._saved_tensors_hooks_off" in found


def test_one_version_source():
    """The version is written once (amp_compiler/version.py); packaging and the package agree."""
    from importlib.metadata import version

    import amp_compiler

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert version("amp-compiler") == amp_compiler.__version__


def test_declared_lower_bounds_are_the_ones_ci_installs():
    """Every integration's lower bound in pyproject.toml is pinned in .ci/lowest.txt, which
    .ci/run installs and tests: a bound nobody tests is a claim."""
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    bounds = {}
    for name in ("hf", "trl", "lightning", "openvino"):
        for line in extras[name]:
            if line.startswith("onnx"):  # the exporter, not a runtime integration
                continue
            req = Requirement(line)
            (low,) = [s.version for s in req.specifier if s.operator == ">="]
            assert bounds.setdefault(req.name, low) == low, f"{req.name}: two lower bounds"
    pins = {}
    for line in (ROOT / ".ci" / "lowest.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            (pins[req.name],) = [s.version for s in req.specifier if s.operator == "=="]
    assert pins == bounds
    for line in extras["test"]:  # the test extra repeats them
        req = Requirement(line)
        if req.name in bounds:
            assert [s.version for s in req.specifier if s.operator == ">="] == [bounds[req.name]]


def test_torch_range_is_declared_tested_and_stated_once():
    """pyproject's torch floor is the tested range's low end (which .ci/run installs), and the
    README's table states the range CI runs."""
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    from amp_compiler.upstream import TESTED_TORCH

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_req,) = [Requirement(d) for d in deps if d.startswith("torch")]
    (floor,) = [s.version for s in torch_req.specifier if s.operator == ">="]
    (low, high) = TESTED_TORCH
    assert floor == f"{low[0]}.{low[1]}"
    readme = (ROOT / "README.md").read_text()
    for major, minor in (low, high):
        assert f"| {major}.{minor}." in readme, f"README's tested-range table has no torch {major}.{minor} row"
    assert f"torch>={floor}" in readme


def test_every_mutant_still_finds_the_code_it_breaks(monkeypatch):
    """tools/mutants.py breaks each README promise by editing the code; a mutant whose text
    has moved would break nothing (and report a survivor for the wrong reason)."""
    spec = importlib.util.spec_from_file_location("mutants_tool", ROOT / "tools" / "mutants.py")
    mutants = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mutants)  # its dataclasses look their module up
    spec.loader.exec_module(mutants)
    assert len({m.name for m in mutants.MUTANTS}) == len(mutants.MUTANTS) >= 10
    for m in mutants.MUTANTS:
        text = (ROOT / m.path).read_text()
        for find, _ in m.edits():
            assert text.count(find) == 1, (m.name, find)
        for test in m.tests:
            assert (ROOT / test).is_file(), (m.name, test)
