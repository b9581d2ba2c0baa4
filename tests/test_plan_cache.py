"""The plan cache: a restarted process restores amp's plan for a graph it planned before,
and plans again whenever anything the plan depends on differs."""

import gc
import pickle

import pytest
import torch
import torch.nn as nn
from helpers import LOW_EXEC

import amp_compiler.backend
from amp_compiler import AmpBackend, plan_cache
from amp_compiler.meta import META_KEY


class Net(nn.Module):
    """Two matmuls around an op amp's tables do not know (it runs in FP32, with a warning)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(torch.special.log_ndtr(self.fc1(x)))


@pytest.fixture
def planned(monkeypatch, tmp_path):
    """The cache on, in a directory of the test's own; returns the graphs the pipeline planned
    (by index), so a test sees whether amp planned or restored."""
    monkeypatch.setenv("AMP_COMPILER_PLAN_CACHE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    ran, real = [], amp_compiler.backend.run_pipeline

    def counted(gm, ctx, pipeline):
        ran.append(ctx.graph_index)
        return real(gm, ctx, pipeline)

    monkeypatch.setattr(amp_compiler.backend, "run_pipeline", counted)
    return ran


def entries(tmp_path):
    return sorted((tmp_path / "amp" / "plans").glob("*/*"))


def restart(model, *inputs, **options):
    """A new process's first compile of ``model``: Dynamo's caches cleared, a new backend."""
    torch._dynamo.reset()
    backend = AmpBackend(**options)
    return backend, torch.compile(model, backend=backend)(*inputs)


def test_a_restart_restores_the_plan_and_runs_it(planned, inductor_recorded, amp_log, tmp_path):
    model, x = Net(), torch.randn(4, 16, requires_grad=True)
    first, out1 = restart(model, x)
    (record,) = first.records  # Dynamo's reset clears them: kept here
    plan = first.plan().to_dict()
    out1.sum().backward()
    grads1 = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    assert planned == [0] and len(entries(tmp_path)) == 1
    inductor_recorded.calls.clear()
    warned = [r.getMessage() for r in amp_log]

    second, out2 = restart(model, x)
    out2.sum().backward()
    assert planned == [0], "the restarted process planned again"
    # what ran: the restored graph, 16-bit matmuls included, with the same results
    mms = inductor_recorded.dtypes_of(*LOW_EXEC)
    assert len(mms) == 6 and all(d[:2] == [torch.bfloat16] * 2 for d in mms), mms  # 2 forward, 4 backward
    assert torch.equal(out1, out2)
    assert all(torch.equal(a, p.grad) for a, p in zip(grads1, model.parameters()))
    (restored,) = second.records
    assert restored.graph.code == record.graph.code
    assert second.plan().to_dict() == plan
    assert [p.name for p in restored.passes] == [p.name for p in record.passes]
    # what planning said, said again
    assert any("unknown op" in w and "special_log_ndtr" in w for w in warned)
    assert [r.getMessage() for r in amp_log][len(warned) :] == warned


@pytest.mark.parametrize("collector_on", [True, False])
def test_a_restored_plan_is_compiled_with_the_collector_held(planned, inductor_recorded, monkeypatch, collector_on):
    """A restart reads its plan and compiles the graph with Python's cycle collector held (what
    both make is long-lived; counted in passing it cost a full collection of the heap), and
    gives the collector back as it found it; a planning process leaves it alone."""
    seen, real = [], amp_compiler.backend.inner_compiler

    def watching(name, mode, budget):
        compile = real(name, mode, budget)

        def compiled(gm, inputs):
            seen.append(gc.isenabled())
            return compile(gm, inputs)

        return compiled

    monkeypatch.setattr(amp_compiler.backend, "inner_compiler", watching)
    model, x = Net(), torch.randn(4, 16)
    was_on = gc.isenabled()
    (gc.enable if collector_on else gc.disable)()
    try:
        first, _ = restart(model, x)
        after_planning = gc.isenabled()
        restored = [r.restored for r in first.records]  # Dynamo's reset clears them
        second, _ = restart(model, x)
        after_restoring = gc.isenabled()
    finally:
        (gc.enable if was_on else gc.disable)()
    assert planned == [0]
    assert restored + [r.restored for r in second.records] == [False, True]
    assert seen == [collector_on, False]
    assert after_planning == after_restoring == collector_on


def _ops(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def test_a_restored_graph_lets_its_metadata_go_once_compiled_and_reads_again(planned, monkeypatch):
    """Once compiled, the restored graph the compiled function keeps holds no node metadata
    (its objects would live on in every full collection of the heap); the record reads the
    graph again, metadata included, for whoever inspects it; the compiled graph still runs.
    A planned graph keeps its own."""
    from amp_compiler.render import to_dot

    handed, metadata, real = [], [], amp_compiler.backend.inner_compiler

    def keeping(name, mode, budget):
        compile = real(name, mode, budget)

        def compiled(gm, inputs):
            handed.append(gm)
            metadata.append([dict(n.meta) for n in gm.graph.nodes])
            return compile(gm, inputs)

        return compiled

    monkeypatch.setattr(amp_compiler.backend, "inner_compiler", keeping)
    model, x = Net(), torch.randn(4, 16)
    first, out1 = restart(model, x)
    (planned_record,) = first.records
    assert planned_record.graph is handed[0]
    assert all("val" in n.meta for n in _ops(handed[0]))
    second, out2 = restart(model, x)
    (restored,) = second.records
    assert restored.restored and planned == [0]
    assert all(not n.meta for n in handed[1].graph.nodes)  # what the compiled function keeps
    again = restored.graph  # read again from the cache entry
    assert again is not handed[1] and again.code == planned_record.graph.code
    assert [n.meta.keys() for n in again.graph.nodes] == [m.keys() for m in metadata[1]]
    assert any(META_KEY in m for m in metadata[1])  # the plan, node by node
    assert "bf16" in to_dot([restored]).lower()
    out3 = torch.compile(model, backend=second)(x)  # Dynamo's compiled code, run again
    assert torch.equal(out1, out2) and torch.equal(out2, out3)


CHANGES = {
    "an option": (lambda: ((torch.randn(4, 16),), {"fp32_modules": ("fc2",)})),
    "the input's shape": (lambda: ((torch.randn(6, 16),), {})),
    "the dtype": (lambda: ((torch.randn(4, 16),), {"dtype": "fp16"})),
}


class Edited(Net):
    """Net with one op changed: the same shapes, another graph."""

    def forward(self, x):
        return self.fc2(torch.special.log_ndtr(self.fc1(x).relu()))


@pytest.mark.parametrize("change", [*CHANGES, "amp's source", "grad mode", "the model's code"])
def test_what_changes_the_plan_plans_again(planned, inductor_recorded, monkeypatch, change):
    model = Net()
    restart(model, torch.randn(4, 16))
    if change == "the model's code":
        model.__class__ = Edited
    inputs, options = CHANGES[change]() if change in CHANGES else ((torch.randn(4, 16),), {})
    if change == "amp's source":
        monkeypatch.setattr(plan_cache, "_source_digest", lambda: "an edited pass")
    with torch.set_grad_enabled(change != "grad mode"):
        backend, _ = restart(model, *inputs, **options)
    plan = backend.plan().to_dict()
    assert planned == [0, 0], f"{change}: the plan was restored"
    # and the same again restores
    with torch.set_grad_enabled(change != "grad mode"):
        again, _ = restart(model, *inputs, **options)
    assert planned == [0, 0]
    assert again.plan().to_dict() == plan


@pytest.mark.parametrize("off", ["env", "inductor"])
def test_switched_off_it_stores_nothing(planned, inductor_recorded, monkeypatch, tmp_path, off):
    monkeypatch.setenv("AMP_COMPILER_PLAN_CACHE", "0" if off == "env" else "1")
    model, x = Net(), torch.randn(4, 16)
    # config.patch: monkeypatch's undo would delete the config entry
    with torch._inductor.config.patch(force_disable_caches=off == "inductor"):
        restart(model, x)
        restart(model, x)
    assert planned == [0, 0] and entries(tmp_path) == []


def test_a_damaged_entry_is_planned_again_and_replaced(planned, inductor_recorded, tmp_path):
    model, x = Net(), torch.randn(4, 16)
    _, out1 = restart(model, x)
    (entry,) = entries(tmp_path)
    entry.write_bytes(b"half a file")
    _, out2 = restart(model, x)
    assert planned == [0, 0] and torch.equal(out1, out2)
    assert pickle.loads(entry.read_bytes())[0] == plan_cache.FORMAT
    restart(model, x)
    assert planned == [0, 0]


def test_only_graphs_planned_for_inductor_without_held_tensors_are_cached(planned):
    gm = torch.fx.symbolic_trace(nn.Linear(4, 4))  # reads its weight off the module
    x = [torch.randn(2, 4)]
    opts = AmpBackend().options
    assert plan_cache.key(gm, x, opts, "bf16", None) is None
    plain = torch.fx.symbolic_trace(lambda a: a @ a)
    assert plan_cache.key(plain, x, opts, "bf16", None) is not None
    assert plan_cache.key(plain, x, opts.replace(inner="aot_eager"), "bf16", None) is None
    assert plan_cache.key(plain, x, opts.replace(dump_dir="graphs"), "bf16", None) is None


def test_inductor_compiles_the_restored_graph_from_its_own_cache(planned):
    """Real Inductor: the restored graph is the one its caches saw (AOTAutograd's cache hits)."""
    from torch._dynamo.utils import counters

    model, x = Net(), torch.randn(4, 16, requires_grad=True)
    _, out1 = restart(model, x)
    out1.sum().backward()  # AOTAutograd stores its entry once backward is compiled too
    counters.clear()
    _, out2 = restart(model, x)
    out2.sum().backward()
    assert planned == [0]
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1, dict(counters["aot_autograd"])
    assert torch.equal(out1, out2)
