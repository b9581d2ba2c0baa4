"""The upstream surface: what amp needs of torch (and the libraries it patches) is still there.

Each test names the entry that broke, so an upstream release that renames or removes one turns
CI red in one place (amp_compiler/upstream) instead of degrading a job.
"""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest
import torch
from helpers import tiny_llama

from amp_compiler import policy
from amp_compiler.upstream import aten as upstream_aten
from amp_compiler.upstream import patches, torch_private

# Table names absent from a torch release, as measured (a name absent from a release not
# listed here is reported by test_absent_table_names_are_known, not silently accepted).
ABSENT_BY_TORCH = {
    "2.11": set(),
    "2.13": set(),
    "2.14": {"cholesky"},  # removed upstream; linalg_cholesky stays in the table
    "2.15": {"cholesky"},
}
MINOR = ".".join(torch.__version__.split(".")[:2])


@pytest.mark.parametrize("name", upstream_aten.ESSENTIAL)
def test_essential_op_is_defined(name):
    """An op the plan rests on (matmul, attention, softmax, norm, loss) exists in this torch."""
    assert hasattr(torch.ops.aten, name), f"torch {torch.__version__} has no aten.{name}: the plan needs it"


def test_absent_table_names_are_known():
    """The op tables name ops this torch lacks only where that absence was measured; the list
    per release is ABSENT_BY_TORCH."""
    if MINOR not in ABSENT_BY_TORCH:
        pytest.fail(
            f"torch {torch.__version__} is untested: its absent table names are {sorted(upstream_aten.ABSENT)}; "
            "add them to ABSENT_BY_TORCH once the suite passes on it"
        )
    assert upstream_aten.ABSENT == ABSENT_BY_TORCH[MINOR]


def test_absent_op_is_in_no_table():
    """An absent name drops out of its table instead of failing the import."""
    missing = upstream_aten.aten.no_such_op_in_any_torch
    assert isinstance(missing, upstream_aten.Absent) and "no_such_op_in_any_torch" in repr(missing)
    assert upstream_aten.present({missing, torch.ops.aten.mm}) == {torch.ops.aten.mm}
    upstream_aten.ABSENT.discard("no_such_op_in_any_torch")
    for ops in policy.TABLES.values():
        assert not any(isinstance(op, upstream_aten.Absent) for op in ops)


def test_essential_ops_keep_their_tables():
    """The plan's anchors sit where the design note puts them, on every torch."""
    a = torch.ops.aten
    assert {a.mm, a.bmm, a.addmm, a.linear, a.convolution, a.scaled_dot_product_attention} <= policy.LOW_OPS
    assert {a.softmax, a._softmax, a.layer_norm, a.native_layer_norm, a.rms_norm, a.sum, a.exp} <= policy.FP32_OPS
    assert {a.nll_loss, a.cross_entropy_loss, a.mse_loss} <= policy.FP32_OPS


# -- private torch names: every one listed, every one resolves


@pytest.mark.parametrize("path", sorted(torch_private.SURFACE))
def test_private_torch_name_resolves(path):
    """Each private torch name amp uses exists in the running torch."""
    assert torch_private.has(path), f"torch {torch.__version__} lacks {path} ({torch_private.SURFACE[path]})"


def test_a_missing_private_name_is_named_with_what_needs_it(monkeypatch):
    monkeypatch.setitem(torch_private.SURFACE, "torch._no_such_name", "a feature that needs it")
    with pytest.raises(torch_private.UpstreamChanged, match=r"no torch\._no_such_name, which amp uses for a feature"):
        torch_private.private("torch._no_such_name")
    with pytest.raises(KeyError, match="not listed"):
        torch_private.private("torch._dynamo.unlisted")


def _private_uses(tree: ast.AST) -> list[str]:
    """Private torch names a module reaches directly: ``torch._x`` / ``torch.utils._x``
    attribute chains (ops under ``torch.ops`` aside) and imports from such modules."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
            names = [*node.module.split("."), *(a.name for a in node.names)]
            found += [f"from {node.module} import ..."] if any(_private(n) for n in names) else []
        elif isinstance(node, ast.Import):
            found += [
                a.name for a in node.names if a.name.startswith("torch.") and any(map(_private, a.name.split(".")))
            ]
        elif isinstance(node, ast.Attribute):
            chain, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            chain = [getattr(value, "id", ""), *reversed(chain)]
            if chain[0] == "torch" and chain[1:2] != ["ops"] and any(map(_private, chain[1:3])):
                found.append(".".join(chain[:3]))
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _package_sources():
    root = pathlib.Path(__file__).resolve().parent.parent
    for folder in ("amp_compiler", "passes"):
        for path in sorted((root / folder).rglob("*.py")):
            if "upstream" not in path.parts:
                yield path


def test_private_torch_names_are_reached_through_the_registry():
    """No module outside amp_compiler/upstream reaches a private torch name directly, and every
    name passed to private()/has() is listed (so the canaries above cover every use)."""
    direct, unlisted = [], []
    for path in _package_sources():
        tree = ast.parse(path.read_text())
        direct += [f"{path.name}: {use}" for use in _private_uses(tree)]
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("private", "has") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and arg.value not in torch_private.SURFACE:
                    unlisted.append(f"{path.name}: {arg.value}")
                if isinstance(arg, ast.Constant) and ".config." in arg.value:  # private() looks up once
                    direct.append(f"{path.name}: {arg.value} (read a config value off its config module)")
    assert not direct, f"reach these through amp_compiler.upstream.torch_private.private: {direct}"
    assert not unlisted, f"not in torch_private.SURFACE: {unlisted}"


def test_dynamo_graph_attributes_amp_carries_over():
    """What capture copies from Dynamo's graph onto the traced one (each input's source, the
    parameters' sources, the compile id), and a compiled module's ``_orig_mod`` (module-name
    pins match through it)."""
    seen = []

    def keep(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    model = torch.nn.Linear(4, 4)
    compiled = torch.compile(model, backend=keep)
    compiled(torch.randn(2, 4))
    assert compiled._orig_mod is model
    (gm,) = seen
    assert "dynamo_compile_id" in gm.meta
    assert all(hasattr(n, "_dynamo_source") for n in gm.graph.find_nodes(op="placeholder"))
    assert isinstance(getattr(gm, "_param_name_to_source", None), dict)
    torch.compiler.reset()


# -- attributes amp patches in other libraries: one canary per entry


def _accelerator():
    accelerate = pytest.importorskip("accelerate")
    return accelerate.Accelerator(cpu=True, mixed_precision="bf16")


def _source_sets(owner, attribute: str) -> bool:
    return f"self.{attribute} =" in inspect.getsource(owner)


def _trl(name):
    pytest.importorskip("trl")
    import trl

    return getattr(trl, name)


PATCH_CANARIES = {
    "accelerate: Accelerator.native_amp": lambda: _accelerator().native_amp is True,
    "accelerate: Accelerator.scaler": lambda: hasattr(_accelerator(), "scaler"),
    "accelerate: Accelerator.prepare_model keeps model._original_forward": lambda: (
        "_original_forward" in vars(_accelerator().prepare_model(torch.nn.Linear(2, 2)))
    ),
    "transformers: Trainer.callback_handler.callbacks": lambda: (
        _source_sets(pytest.importorskip("transformers").Trainer.__init__, "callback_handler")
        and _source_sets(pytest.importorskip("transformers.trainer_callback").CallbackHandler.__init__, "callbacks")
    ),
    "transformers: layer._gradient_checkpointing_func": lambda: _checkpointed_layer_has_func(),
    "trl: trl.trainer.utils._ChunkedLogProbFunction": lambda: (
        _trl("DPOTrainer") and hasattr(pytest.importorskip("trl.trainer.utils"), "_ChunkedLogProbFunction")
    ),
    "trl: DPOTrainer._precompute_ref_logps": lambda: callable(_trl("DPOTrainer")._precompute_ref_logps),
    "trl: DPOTrainer._precompute_model_hash": lambda: _source_sets(_trl("DPOTrainer"), "_precompute_model_hash"),
    "transformers: LRScheduler.step (instance)": lambda: callable(torch.optim.lr_scheduler.LRScheduler.step),
}


def _checkpointed_layer_has_func() -> bool:
    model = tiny_llama(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1)
    model.gradient_checkpointing_enable()
    return any(
        getattr(m, "gradient_checkpointing", False) and callable(getattr(m, "_gradient_checkpointing_func", None))
        for m in model.modules()
    )


def test_every_patch_has_a_canary():
    assert set(PATCH_CANARIES) == set(patches.PATCHES)


@pytest.mark.parametrize("entry", sorted(patches.PATCHES))
def test_patched_attribute_is_where_amp_expects_it(entry):
    """The attribute amp replaces or reads still exists, as amp uses it, in the installed release."""
    assert PATCH_CANARIES[entry](), f"upstream changed: {entry} ({patches.PATCHES[entry]})"


def test_grad_scaler_state_the_loss_scaler_extends():
    """The GradScaler members LossScaler reads and writes exist on an instance after a step."""
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.randn(3, 2)).sum()).backward()
    scaler.step(opt)
    missing = [name for name in torch_private.GRAD_SCALER_STATE if not hasattr(scaler, name)]
    assert not missing, f"torch {torch.__version__}'s GradScaler lacks {missing}: amp's LossScaler extends them"
