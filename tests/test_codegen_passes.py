"""The Inductor passes that steer code generation on CPU: proven by what executes and what
backward saves, with the same values as the program without them."""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import profile

from amp_compiler import AmpBackend
from amp_compiler.passes.inductor import fold_broadcast_bmm as fold_mod
from amp_compiler.passes.inductor import recompute_masks as masks_mod

aten = torch.ops.aten


class ReluScaled(nn.Module):
    """ReLU whose output is not saved (the next op scales it first), so its backward
    needs a mask: the case where the partitioner saves a bool tensor."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 8)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)) * 0.5)


def saved_dtypes_and_grads(model, x, dtype):
    saved = []

    def pack(t):
        saved.append(t.dtype)
        return t

    model.zero_grad()
    # the speed-first partition: a memory budget below 1 may recompute the mask by itself
    compiled = torch.compile(model, backend=AmpBackend(dtype=dtype, inner="inductor", memory_budget=1.0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = compiled(x)
    out.float().pow(2).sum().backward()
    return saved, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_relu_mask_is_recomputed_not_saved_and_gradients_are_identical(dtype, monkeypatch, no_caches):
    torch.manual_seed(0)
    model, x = ReluScaled(), torch.randn(32, 16)
    saved, grads = saved_dtypes_and_grads(model, x, dtype)
    assert saved and torch.bool not in saved, saved

    torch._dynamo.reset()
    monkeypatch.setattr(masks_mod, "recompute_masks", lambda graph: 0)
    saved_off, grads_off = saved_dtypes_and_grads(model, x, dtype)
    assert torch.bool in saved_off  # the control: without the pass a mask is saved
    for g, h in zip(grads, grads_off):
        assert torch.equal(g, h)  # the same comparison of the same tensor


def test_random_masks_are_left_to_the_partitioner():
    """Dropout's mask compares random numbers: recomputing it would need the draw again."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    t = graph.placeholder("tangents_1")
    r = graph.call_function(aten.rand_like.default, (x,))
    m = graph.call_function(aten.lt.Scalar, (r, 0.9))
    y = graph.call_function(aten.le.Scalar, (x, 0))
    graph.output((graph.call_function(aten.mul.Tensor, (t, m)), graph.call_function(aten.mul.Tensor, (t, y))))
    fake = torch._subclasses.FakeTensorMode()
    with fake:
        vals = {"x": torch.empty(4), "tangents_1": torch.empty(4)}
    for n in graph.nodes:
        if n.op == "placeholder":
            n.meta["val"] = vals[n.name]
        elif n.op == "call_function":
            with fake:
                args = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in n.args]
                n.meta["val"] = n.target(*args)
    assert masks_mod.recompute_masks(graph) == 1
    assert "recompute" not in m.meta and "recompute" in y.meta


class InProjection(nn.Module):
    """``nn.MultiheadAttention``'s layout: a linear on a transposed (seq, batch, d) view."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 96)

    def forward(self, x):
        return self.proj(x.transpose(0, 1))


def executed(fn, *args):
    """The ATen ops the compiled code ran (its extern kernels), by the profiler."""
    with profile() as prof:
        out = fn(*args)
    return out, {e.name for e in prof.events()}


@pytest.mark.parametrize("grad", [False, True])
def test_linear_on_a_transposed_batch_runs_one_mm_not_a_broadcast_bmm(grad, no_caches):
    torch.manual_seed(0)
    model, x = InProjection(), torch.randn(4, 16, 32)
    compiled = torch.compile(model, backend=AmpBackend(dtype="bf16", inner="inductor"))
    with torch.set_grad_enabled(grad):
        compiled(x)
        out, ops = executed(compiled, x)
    assert "aten::bmm" not in ops and "aten::mm" in ops, ops
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(x)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_broadcast_bmm_control_without_the_pass(monkeypatch, no_caches):
    """Without the rewrite Inductor runs the broadcast bmm (what the pass exists to avoid)."""
    monkeypatch.setattr(fold_mod, "fold_broadcast_bmm", lambda graph: 0)
    model, x = InProjection(), torch.randn(4, 16, 32)
    compiled = torch.compile(model, backend=AmpBackend(dtype="bf16", inner="inductor"))
    with torch.no_grad():
        compiled(x)
        assert "aten::bmm" in executed(compiled, x)[1]


def test_compiled_graphs_stay_cacheable(no_caches):
    """The custom passes and the partitioner carry stable cache keys: neither Inductor's FX
    graph cache nor AOTAutograd's cache is bypassed (a bypass recompiles every graph in every
    new process)."""
    from torch._dynamo.utils import counters

    counters.clear()
    with torch._inductor.config.patch(fx_graph_cache=True), torch._functorch.config.patch(enable_autograd_cache=True):
        model = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 8))
        compiled = torch.compile(model, backend=AmpBackend(dtype="bf16", inner="inductor"))
        compiled(torch.randint(0, 64, (4, 12))).float().sum().backward()
    assert counters["inductor"]["fxgraph_cache_bypass"] == 0
    assert counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_hit"] == 2
    aot = counters["aot_autograd"]
    assert aot["autograd_cache_bypass"] == 0 and aot["autograd_cache_miss"] + aot["autograd_cache_hit"] == 1, dict(aot)


class Dropped(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(16, 64), nn.Linear(64, 8), nn.Dropout(0.3)

    def forward(self, x):
        return self.fc2(self.drop(F.relu(self.fc1(x))))


def test_dropout_on_cpu_draws_eagers_masks_with_atens_kernel(no_caches):
    """In CPU training graphs random ops run ATen's kernels (Inductor's fallback_random): the
    mask is stored for backward anyway and ATen draws it faster. The masks are then the ones
    eager draws from the same seed."""
    torch.manual_seed(0)
    model, x = Dropped().train(), torch.randn(32, 16)
    compiled = torch.compile(model, backend=AmpBackend(dtype="bf16", inner="inductor"))
    compiled(x)
    torch.manual_seed(7)
    with profile() as prof:
        ours = compiled(x)
    assert "aten::native_dropout" in {e.name for e in prof.events()} or "aten::bernoulli_" in {
        e.name for e in prof.events()
    }
    torch.manual_seed(7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(x)
    torch.testing.assert_close(ours.float(), ref.float(), rtol=2e-2, atol=2e-2)
    ours.float().sum().backward()  # the mask saved by ATen's dropout feeds backward
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_dropout_under_no_grad_draws_in_the_generated_kernel(no_caches):
    """Without backward no mask is needed: Inductor's random fuses into the kernel that
    consumes it and no ATen random op executes (hf-gpt2 in train mode under no_grad: 0.99x
    autocast, 1.12x with ATen's). Dropout still drops, at the rate asked, fresh each call."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.3)).train(), torch.randn(512, 16)
    compiled = torch.compile(model, backend=AmpBackend(dtype="bf16", inner="inductor"))
    with torch.no_grad():
        compiled(x)
        with profile() as prof:
            a, b = compiled(x), compiled(x)
    names = {e.name for e in prof.events()}
    assert not names & {"aten::native_dropout", "aten::bernoulli_", "aten::bernoulli", "aten::rand"}, names
    assert not torch.equal(a, b)
    assert 0.27 < (a == 0).float().mean().item() < 0.33
    assert any(n.startswith("## Call CompiledFxGraph") for n in names)  # it ran compiled


@pytest.mark.parametrize("budget", [0.8, 0.1])
def test_dropout_masks_feed_backward_unchanged_under_a_memory_budget(budget, no_caches):
    """However hard the budget squeezes, backward uses the masks forward drew (a recomputed
    dropout would draw new ones): the gradients are eager autocast's from the same seed."""
    import copy

    torch.manual_seed(0)
    model = Dropped().train()
    ref, x = copy.deepcopy(model), torch.randn(32, 16)
    compiled = torch.compile(model, backend=AmpBackend(inner="inductor", memory_budget=budget))
    compiled(x)
    torch.manual_seed(7)
    compiled(x).float().pow(2).sum().backward()
    torch.manual_seed(7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref(x).float().pow(2).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=3e-2, atol=3e-2)


class GeluBlocks(nn.Module):
    """Pre-LN MLP blocks on an FP32 residual stream: GELU outputs and residual sums are
    what a memory budget recomputes instead of saving."""

    def __init__(self, d=32, n=2):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(n)
        )

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def grads_with_saved(model, x, pack, **options):
    """One compiled forward with ``pack`` seeing every tensor saved for backward, then
    backward; the gradients."""
    model.zero_grad()
    compiled = torch.compile(model, backend=AmpBackend(inner="inductor", **options))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = compiled(x)
    out.pow(2).mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def saved_bytes_and_grads(model, x, **options):
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    grads = grads_with_saved(model, x, pack, **options)
    return sum(seen.values()), grads


def test_memory_budget_recomputes_cheap_ops_with_the_same_gradients(no_caches):
    torch.manual_seed(0)
    model, x = GeluBlocks(), torch.randn(4, 64, 32)
    speed_first, ref = saved_bytes_and_grads(model, x, memory_budget=1.0)
    torch._dynamo.reset()
    default, grads = saved_bytes_and_grads(model, x)
    assert default <= 0.85 * speed_first, (default, speed_first)
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def saved_weight_copies(model, x, **options):
    """Shapes of the 16-bit tensors shaped like a weight (or its transpose) that backward
    keeps, and the gradients."""
    shapes = {tuple(s) for p in model.parameters() if p.dim() == 2 for s in (p.shape, p.shape[::-1])}
    copies = []

    def pack(t):
        if t.dtype == torch.bfloat16 and tuple(t.shape) in shapes:
            copies.append(tuple(t.shape))
        return t

    torch._dynamo.reset()
    grads = grads_with_saved(model, x, pack, dtype="bf16", **options)
    return copies, grads


def test_weight_copies_are_saved_by_default_and_recast_under_an_explicit_budget(no_caches):
    """Parameters are free to save (they live across the step), so under a budget below 1
    the partitioner recasts their 16-bit copies in backward. The default keeps the copies
    (no second pass over the weights); an explicit budget, even the default's 0.8, lets
    the partitioner choose. Either way backward sees the same BF16 weights."""
    torch.manual_seed(0)
    model, x = GeluBlocks(), torch.randn(4, 64, 32)
    kept, grads = saved_weight_copies(model, x)
    assert sorted(kept) == sorted([(128, 32), (32, 128)] * 2), kept
    recast, grads_recast = saved_weight_copies(model, x, memory_budget=0.8)
    assert recast == []
    for g, h in zip(grads, grads_recast):
        torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-7)


def test_memory_budget_is_never_applied_to_a_graph_with_random_ops(caplog):
    from amp_compiler.capture import to_aten
    from amp_compiler.inductor import memory_budget_for

    blocks = to_aten(torch.fx.symbolic_trace(GeluBlocks()), [torch.randn(2, 3, 32)])[0]
    dropped = to_aten(torch.fx.symbolic_trace(Dropped()), [torch.randn(4, 16)])[0]
    assert memory_budget_for(blocks, None) == 0.8 and memory_budget_for(blocks, 0.3) == 0.3
    assert memory_budget_for(dropped, None) == 1.0
    with caplog.at_level("WARNING", logger="amp_compiler"):
        assert memory_budget_for(dropped, 0.3) == 1.0
    assert "would draw new masks" in caplog.text
    # dropout(0.0) (nn.TransformerEncoderLayer(dropout=0.0) still calls it) draws nothing
    idle = Dropped()
    idle.drop.p = 0.0
    idle = to_aten(torch.fx.symbolic_trace(idle), [torch.randn(4, 16)])[0]
    assert any(n.target is torch.ops.aten.dropout.default for n in idle.graph.nodes)
    assert memory_budget_for(idle, None) == 0.8


@pytest.mark.parametrize("bad", [0, 1.5, "0.8", True])
def test_memory_budget_out_of_range_is_refused(bad):
    from amp_compiler import AmpOptionsError

    with pytest.raises(AmpOptionsError, match=r"memory_budget must be a number in \(0, 1\]"):
        AmpBackend(memory_budget=bad)


class PreNormBlock(nn.Module):
    """A transformer layer's shape: two residual adds of 16-bit outputs, each after a LayerNorm."""

    def __init__(self, d: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.mix, self.up, self.down = nn.Linear(d, d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        x = x + self.mix(self.ln1(x))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class ResidualStack(nn.Module):
    def __init__(self, layers: int, d: int = 32):
        super().__init__()
        self.emb = nn.Embedding(64, d)
        self.blocks = nn.Sequential(*(PreNormBlock(d) for _ in range(layers)))
        self.out = nn.LayerNorm(d)

    def forward(self, ids):
        return self.out(self.blocks(self.emb(ids)))


def distinct_kernels(layers: int, realize_reads: int, monkeypatch) -> int:
    from torch._inductor.utils import run_and_get_code

    import amp_compiler.inductor as backend_mod

    monkeypatch.setattr(backend_mod, "REALIZE_READS", realize_reads)
    torch._dynamo.reset()
    compiled = torch.compile(ResidualStack(layers), backend=AmpBackend(dtype="bf16", inner="inductor"))
    with torch.no_grad():
        _, code = run_and_get_code(compiled, torch.randint(0, 64, (2, 8)))
    return sum(c.count("async_compile.cpp_pybinding") for c in code)


def test_kernels_do_not_grow_with_depth(monkeypatch, no_caches):
    """Every layer runs the same C++ kernels (compiled once), however deep the stack: the
    residual stream is stored once per layer, not re-added from its 16-bit terms inside
    each LayerNorm. Control: at Inductor's own threshold the count grows with depth."""
    from amp_compiler.inductor import REALIZE_READS

    assert distinct_kernels(2, REALIZE_READS, monkeypatch) == distinct_kernels(5, REALIZE_READS, monkeypatch)
    assert distinct_kernels(5, 4, monkeypatch) > distinct_kernels(2, 4, monkeypatch)


def test_joint_passes_are_one_custom_pass_for_every_inductor():
    """Inductor before 2.13 takes one callable per hook (a list failed: 'list' object is not
    callable, seen with torch 2.11 on CUDA); both passes run, in order, under one cache key."""
    from amp_compiler.passes.inductor.infra import InductorPass, InductorPasses

    ran = []

    class Stub(InductorPass):
        def __init__(self, tag):
            self.tag = tag

        def __call__(self, graph):
            ran.append((self.tag, graph))

        def uuid(self):
            return self.tag.encode()

    passes = InductorPasses(Stub("a"), Stub("b"))
    passes("g")
    assert ran == [("a", "g"), ("b", "g")]
    assert passes.uuid() != InductorPasses(Stub("b"), Stub("a")).uuid()
    assert callable(passes) and not isinstance(passes, list)


def test_an_edited_op_of_amps_changes_inductors_cache_key(tmp_path, monkeypatch):
    """Inductor caches a custom op's call with its default arguments written out: a pass's key
    covers the source of amp's ops, so a changed schema never runs cached code of the old."""
    from amp_compiler.loss_head import ops
    from amp_compiler.passes.inductor.infra import InductorPass

    p = InductorPass("amp_compiler.passes.inductor.recompute_masks", "recompute_masks")
    before = p.uuid()
    edited = tmp_path / "ops.py"
    edited.write_text(pathlib.Path(ops.__file__).read_text() + "\n# a new default\n")
    monkeypatch.setattr(ops, "__file__", str(edited))
    assert p.uuid() != before
