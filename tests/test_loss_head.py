"""The fused loss head: the op against the loss it replaces, the pass on every form of head it
recognises (and the ones it leaves), what executed and what was saved for backward."""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import (
    MATMULS,
    OpRecorder,
    TinyDecoder,
    causal_batch,
    cosine,
    hf_causal_loss,
    recording_backend,
    tiny_llama,
)
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from amp_compiler import AmpBackend, device, loss_head, make_train_step
from amp_compiler.device import bf16_products, bf16_products_native, native_dtypes
from amp_compiler.loss_head import NO_IGNORE, block_shape, exact, format_chain, head_stats, kernels, logits_stats, tuned

MIN_VOCAB = loss_head.settings().min_vocab

aten = torch.ops.aten
HEAD = torch.ops.amp.head_stats
LOGITS_STATS = torch.ops.amp.logits_stats
V, D = 8192, 32


# -- the op ------------------------------------------------------------------------------


def _reference(h, w, b, t, chain, ignore=-100, smoothing=0.0, reduction="mean"):
    z = F.linear(h, w, b)
    for kind, value in chain:
        z = z * value if kind == "m" else torch.tanh(z)
    return F.cross_entropy(z, t, ignore_index=ignore, label_smoothing=smoothing, reduction=reduction)


def _from_stats(stats, t, vocab, ignore=-100, smoothing=0.0):
    picked, lse, total = stats[:3]
    valid = t != ignore
    nll = torch.lerp(lse - picked, lse - total / vocab, smoothing)
    return torch.where(valid, nll, 0.0).sum() / valid.sum()


def _fp64_head(bias: bool, n=37, d=8, vocab=53):
    """FP64 hidden states, weight (and bias) of a head, targets with every fifth ignored, and
    the tensors that want gradients."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, d, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(vocab, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    t = torch.randint(0, vocab, (n,), generator=g)
    t[::5] = -100
    return h, w, b, t, [x for x in (h, w, b) if x is not None]


@pytest.fixture
def fresh_kernels(monkeypatch):
    """The block math compiled afresh: other tests' chains and flags, each a recompile of the
    same code, may have spent Dynamo's recompile limit (past it a new variant runs eagerly)."""
    torch._dynamo.reset()
    monkeypatch.setattr(kernels, "_KERNELS", {})


@pytest.fixture
def small_blocks():
    """Blocks of 10 tokens x 8 vocabulary entries: uneven blocks both ways, the log-sum-exp
    carried across a row's vocabulary blocks."""
    with tuned(block_elements=64, max_rows=10, min_cols=8):
        assert block_shape(37, 53) == (10, 8)
        yield


@pytest.mark.parametrize("chain", [[], [("m", 1 / 0.7)], [("m", 1 / 30), ("t", 0.0), ("m", 30.0)]])
@pytest.mark.parametrize("bias", [False, True])
def test_op_gives_the_cross_entropy_and_its_gradients(chain, bias, small_blocks):
    """In FP64 (exact) the op's loss and gradients are the unfused head's, over uneven blocks
    of tokens and vocabulary, with ignored targets and label smoothing."""
    h, w, b, t, leaves = _fp64_head(bias)
    vocab = w.shape[0]
    ref = _reference(h, w, b, t, chain, smoothing=0.1)
    ref_grads = torch.autograd.grad(ref, leaves)
    stats = HEAD(h, w, b, t, format_chain(chain), -100, True, True)
    loss = _from_stats(stats, t, vocab, smoothing=0.1)
    grads = torch.autograd.grad(loss, leaves)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)


def test_block_math_runs_as_generated_kernels_and_wide_logits_stay_exact(small_blocks, fresh_kernels):
    """Init-time logits spread wide (std 60: most terms exp() to below FP32's smallest normal,
    where ATen's exp is 6.6x slower): the op's per-block math executes as Inductor's kernels,
    one call a block forward and backward, no ATen exp at all; the loss and gradients equal
    the unfused head's in FP32."""
    from torch.profiler import profile

    g = torch.Generator().manual_seed(0)
    n, d, vocab = 37, 8, 53
    h = (torch.randn(n, d, generator=g) * 20).requires_grad_()
    w = torch.randn(vocab, d, generator=g).requires_grad_()
    t = torch.randint(0, vocab, (n,), generator=g)
    ref = _reference(h, w, None, t, [])
    ref_grads = torch.autograd.grad(ref, (h, w))
    torch.autograd.grad(_from_stats(HEAD(h, w, None, t, "", -100, True, False), t, vocab), (h, w))  # compiles
    with profile() as prof:
        loss = _from_stats(HEAD(h, w, None, t, "", -100, True, False), t, vocab)
        grads = torch.autograd.grad(loss, (h, w))
    ran = {e.key: e.count for e in prof.key_averages()}
    generated = sum(c for k, c in ran.items() if k.startswith("## Call CompiledFxGraph"))
    assert generated == 2 * 4 * 7  # 4 x 7 blocks, forward and backward
    assert not {"aten::exp", "aten::exp_"} & set(ran), ran
    assert (F.linear(h, w).std() > 40).item()  # the logits really spread that wide
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_block_gradient_writes_no_denormals_at_init_time_logits():
    """A probability e^-87 times the loss's weight is an FP32 denormal (1.75x slower kernel
    arithmetic); terms below e^P_FLOOR count as 0, so the gradient holds none, and it stays
    what FP64 gives to far under FP32's resolution."""
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(64, 512, generator=g) * 16).bfloat16()  # a tied head at init: std ~16
    lse = torch.logsumexp(z.float(), 1)
    weight = torch.full((64,), 1 / 4096)  # the mean over 4096 tokens
    at = torch.randint(-1, 512, (64,), generator=g)
    zeros = torch.zeros(64)
    dz = kernels.grad_block(z, lse, weight, zeros, -weight, at, (), torch.float32)
    exact = torch.softmax(z.double(), 1) * weight.double()[:, None]
    exact[at >= 0, at[at >= 0]] -= weight.double()[at >= 0]
    tiny = torch.finfo(torch.float32).tiny
    assert ((exact != 0) & (exact.abs() < tiny)).any()  # the case is here: FP32 would go denormal
    assert not ((dz != 0) & (dz.abs() < tiny)).any()
    dropped = exact[(dz == 0) & (exact != 0)]
    assert dropped.numel() and dropped.abs().max() <= math.exp(loss_head.P_FLOOR) / 4096
    assert (dz.double() - exact).abs().max() < 1e-5 * exact.abs().max()  # FP32's own rounding


def test_block_math_runs_as_written_where_inductor_cannot_compile(small_blocks, monkeypatch, amp_log):
    """A machine where Inductor fails (no C++ compiler): one warning, the same numbers."""
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(9, 8, generator=g), torch.randn(53, 8, generator=g)
    t = torch.randint(0, 53, (9,), generator=g)
    want = HEAD(h, w, None, t, "m0.5,t", -100, True, True)

    def broken(fn, **_):
        def run(*args):
            raise RuntimeError("no C++ compiler")

        return run

    monkeypatch.setattr(kernels, "_KERNELS", {})
    monkeypatch.setattr(torch, "compile", broken)
    got = HEAD(h, w, None, t, "m0.5,t", -100, True, True)
    HEAD(h, w, None, t, "m0.5,t", -100, True, True)
    assert [r.getMessage().count("could not compile the block math") for r in amp_log] == [1]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_op_registration_holds():
    """Fake kernel, autograd and schema agree with the real kernel (torch.library.opcheck)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(12, 8, generator=g, requires_grad=True)
    w = torch.randn(64, 8, generator=g, requires_grad=True)
    t = torch.randint(0, 64, (12,), generator=g)
    torch.library.opcheck(head_stats, (h, w, None, t, "m0.5", -100, False, True))
    torch.library.opcheck(head_stats, (h, w, None, t, "m0.5,t", -100, False, True, "entropy,log_sum_sq,top1"))
    b = torch.randn(64, generator=g, requires_grad=True)
    torch.library.opcheck(head_stats, (h, w, b, t, "m0.5,t", -100, False, True, "", "hw", 0.1))
    for op in (torch.ops.amp.head_stats, torch.ops.amp.head_stats_backward_ahead, LOGITS_STATS):
        assert set(kernels.SYNCS) <= set(op.default.tags)  # they read back to the host: no CUDA graph
    z = (h @ w.t()).detach().requires_grad_()
    torch.library.opcheck(logits_stats, (z, t, "m0.5", -100, True, "entropy,top1"))


# -- the one-pass head: gradients computed in forward --------------------------------------


@pytest.fixture
def small_ahead():
    """One-pass blocks of 10 tokens x 8 vocabulary entries (FP64 logits: 10 rows of 53 fit
    4240 bytes): uneven both ways, rows balanced (37 tokens: 4 blocks of 10, 10, 10, 7); the
    same blocks on a CPU with AMX."""
    small = dict(ahead_bytes=10 * 53 * 8, ahead_min_rows=2, ahead_min_rows_amx=2, ahead_block_elements=80)
    with tuned(**small, min_cols=8):
        assert loss_head.ahead_shape(37, 53, 8) == (10, 8)
        yield


def _ce(stats, t, vocab, smoothing, reduction):
    picked, lse, total = stats[:3]
    valid = t != -100
    loss = torch.where(valid, torch.lerp(lse - picked, lse - total / vocab, smoothing), 0.0).sum()
    return loss / valid.sum() if reduction == "mean" else loss


@pytest.mark.parametrize("chain", [[], [("m", 1 / 30), ("t", 0.0), ("m", 30.0)]])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("smoothing", "reduction"), [(0.0, "mean"), (0.1, "sum")])
def test_one_pass_op_gives_the_cross_entropy_and_its_gradients(chain, bias, smoothing, reduction, small_ahead):
    """ahead=True: the statistics are the recomputing op's, and the gradients it computed in
    forward, scaled in backward by the loss's mean (x3: a gradient accumulation's scale) or sum,
    are FP64 autograd's to FP32's rounding (the split product's accuracy where exact)."""
    h, w, b, t, leaves = _fp64_head(bias)
    vocab = w.shape[0]
    ref = 3 * _reference(h, w, b, t, chain, smoothing=smoothing, reduction=reduction)
    ref_grads = torch.autograd.grad(ref, leaves)
    args = (h, w, b, t, format_chain(chain), -100, True, bool(smoothing))
    stats = HEAD(*args, "", "hw", smoothing)
    for got, want in zip(stats[:3], HEAD(*args)[:3]):
        torch.testing.assert_close(got, want)
    assert [x.shape for x in stats[6:]] == [h.shape, w.shape, b.shape if bias else (0,)]
    loss = 3 * _ce(stats, t, vocab, smoothing, reduction)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    for got, want in zip(torch.autograd.grad(loss, leaves), ref_grads):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


@contextlib.contextmanager
def _gemms():
    """Counts the GEMMs executed inside (every nested ATen call, by the profiler): ``[n]``."""
    count = []
    with torch.profiler.profile() as prof:
        yield count
    count.append(sum(e.name == "aten::mm" for e in prof.events()))


@pytest.mark.parametrize("frozen", [False, True])
def test_one_pass_backward_runs_no_gemm(frozen):
    """16-bit, blocks as shipped: the forward runs the three GEMMs of every block (the
    projection and both gradients), the backward none; the recomputing op runs one forward
    and three again per block in backward (the projection twice). A frozen weight (a LoRA
    fine-tune's head): one GEMM fewer per block either way, and no gradient for it."""
    g = torch.Generator().manual_seed(0)
    n, d, vocab = 600, 16, 50000
    h = torch.randn(n, d, generator=g).bfloat16().requires_grad_()
    w = torch.randn(vocab, d, generator=g, requires_grad=not frozen)
    t = torch.randint(0, vocab, (n,), generator=g)
    rows, cols = loss_head.ahead_shape(n, vocab, 2)
    blocks = math.ceil(n / rows) * math.ceil(vocab / cols)
    assert (rows, blocks) == (n, 4)  # 600 x 50000 BF16 logits fit AHEAD_BYTES: one row block
    recomputed = len([c for _, cols in loss_head.blocks.block_grid(n, vocab) for c in cols])
    per_block = 2 if frozen else 3
    grads = {}
    for ahead, forward, backward in [
        ("h" if frozen else "hw", per_block * blocks, 0),
        ("", recomputed, per_block * recomputed),
    ]:
        with _gemms() as ran_forward:
            stats = HEAD(h, w, None, t, "", -100, False, False, "", ahead, 0.0)
        with _gemms() as ran_backward:
            (stats[1] - stats[0]).mean().backward()
        assert (ran_forward, ran_backward) == ([forward], [backward])
        assert h.grad.dtype == torch.bfloat16 and (w.grad is None if frozen else w.grad.dtype == torch.float32)
        grads[bool(ahead)], h.grad, w.grad = (h.grad, w.grad), None, None
    for got, ref in zip(grads[True], grads[False]):  # the same gradients either way
        if ref is not None:
            assert cosine(got.float().flatten(), ref.float().flatten()) > 0.9999


def test_one_pass_head_recomputes_a_gradient_it_did_not_compute_and_says_so(small_ahead, caplog):
    """A loss weighing each token (or adding a term on the log-sum-exp): the gradients
    computed ahead are not its; backward recomputes them (right to FP32's rounding, GEMMs
    executed) and warns once that the head costs its forward again."""
    g = torch.Generator().manual_seed(2)
    n, d, vocab = 37, 8, 53
    h = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, d, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, vocab, (n,), generator=g)
    weight = torch.rand(n, generator=g, dtype=torch.float64)
    loss_head.ops._warn_recomputed.cache_clear()
    for loss_of in (lambda s: ((s[1] - s[0]) * weight).sum(), lambda s: (s[1] - s[0]).mean() + s[1].square().mean()):
        ref_grads = torch.autograd.grad(loss_of(HEAD(h, w, None, t, "", -100, True, False)), (h, w))
        loss = loss_of(HEAD(h, w, None, t, "", -100, True, False, "", "hw", 0.0))
        with caplog.at_level("WARNING", logger="amp_compiler"), _gemms() as ran:
            grads = torch.autograd.grad(loss, (h, w))
        assert ran[0] > 0
        for got, want in zip(grads, ref_grads):  # computed in FP32 (exact, on CPU) either way
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert sum("gradient was recomputed" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("amx", [False, True])
def test_one_pass_rows_are_balanced_and_their_logits_bounded(amx):
    """On either kind of BF16 CPU (the row floor is higher with AMX)."""
    with tuned(amx=amx) as s:
        least = s.ahead_min_rows_amx if amx else s.ahead_min_rows
        for tokens, vocab, itemsize in [(2048, 50257, 2), (8192, 151936, 2), (100, 50257, 2), (5000, 32000, 4)]:
            rows, cols = loss_head.ahead_shape(tokens, vocab, itemsize)
            blocks = math.ceil(tokens / rows)
            assert rows * blocks - tokens < blocks  # as many tokens in each row block, to one
            assert rows <= max(least, s.ahead_bytes // (vocab * itemsize))
            assert rows * cols <= s.ahead_block_elements and cols <= vocab
        assert loss_head.ahead_shape(2048, 50257, 2)[0] == (2048 if amx else 1024)
    head = (torch.randn(4, 8), torch.randn(64, 8), None, torch.zeros(4, dtype=torch.long), "", -100, False, False)
    with pytest.raises(ValueError, match="gradients 'hx': name 'h', 'w' or both"):
        HEAD(*head, "", "hx", 0.0)
    with pytest.raises(ValueError, match="extras have none"):
        HEAD(*head, "entropy", "hw", 0.0)


def test_one_pass_rows_are_twice_as_many_with_amx():
    """AMX's faster GEMMs: fewer row blocks (each adds to the weight's FP32 gradient)."""
    gpu = loss_head.ahead_shape(8192, 50257, 4, "cuda")
    with tuned(amx=True) as s:
        assert loss_head.ahead_shape(2048, 50257, 2) == (2048, s.ahead_block_elements // 2048)
        assert loss_head.ahead_shape(8192, 50257, 4, "cuda") == gpu  # a GPU is no AMX CPU


def _extras_reference(z, t):
    """Entropy, log(sum p^2), mean logit and "the target is the first argmax" of logits ``z``."""
    logp = z.log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return entropy, torch.logsumexp(2 * logp, -1), z.mean(-1), z.argmax(-1) == t


def _tied_rows(g, n, d, vocab):
    """Hidden states and weights in FP64 where rows 0-2 peak on logits that tie: entries 3, 7
    (one block) and 12 (the next) share a weight row; targets 3, 7 and 12 there, so only
    row 0's target is the first argmax."""
    h = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, d, generator=g, dtype=torch.float64)
    w[3] *= 3
    w[7] = w[12] = w[3]
    h[:3] = w[3]
    t = torch.randint(0, vocab, (n,), generator=g)
    t[:3] = torch.tensor([3, 7, 12])
    return h.requires_grad_(), w.requires_grad_(), t


@pytest.mark.parametrize("op", ["head_stats", "logits_stats"])
def test_op_extras_are_the_statistics_of_the_logits(op, small_blocks):
    """From FP64 over uneven blocks, with a soft-cap chain: entropy, log(sum p^2), the mean logit
    and the first-argmax flag (ties within a block and across blocks) equal their definitions
    on the whole logits; the entropy's gradient (with the log-probs') is autograd's."""
    g = torch.Generator().manual_seed(3)
    n, d, vocab = 37, 8, 53
    h, w, t = _tied_rows(g, n, d, vocab)
    chain = [("m", 1 / 30), ("t", 0.0), ("m", 30.0)]
    z = torch.tanh(F.linear(h, w) / 30) * 30
    ref_ent, ref_sq, ref_mean, ref_top = _extras_reference(z, t)
    assert ref_top[:3].tolist() == [True, False, False]
    ref_loss = z.log_softmax(-1).gather(1, t[:, None]).sum() + (ref_ent * torch.linspace(0, 1, n)).sum()
    ref_grads = torch.autograd.grad(ref_loss, (h, w))
    if op == "head_stats":
        stats = HEAD(h, w, None, t, format_chain(chain), NO_IGNORE, True, True, "entropy,log_sum_sq,top1")
        assert [x.numel() for x in stats[6:]] == [0, 0, 0]  # no gradients computed ahead
        stats = stats[:6]
    else:
        stats = LOGITS_STATS(F.linear(h, w), t, format_chain(chain), NO_IGNORE, True, "entropy,log_sum_sq,top1")
    picked, lse, total, entropy, log_sum_sq, top1 = stats
    # the statistics are FP32 whatever the logits' dtype
    torch.testing.assert_close(entropy.double(), ref_ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(log_sum_sq.double(), ref_sq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close((total / vocab).double(), ref_mean, rtol=1e-5, atol=1e-5)
    assert torch.equal(top1, ref_top)
    loss = (picked - lse).sum() + (entropy * torch.linspace(0, 1, n)).sum()
    for got, want in zip(torch.autograd.grad(loss, (h, w)), ref_grads):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_extras_not_asked_for_are_empty_and_cost_no_gradient():
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(6, 8, generator=g, requires_grad=True), torch.randn(64, 8, generator=g)
    t = torch.randint(0, 64, (6,), generator=g)
    for stats in (HEAD(h, w, None, t, "", -100, False, False)[:6], LOGITS_STATS(h @ w.t(), t, "", -100, False)):
        assert [x.numel() for x in stats] == [6, 6, 6, 0, 0, 0] and stats[5].dtype == torch.bool
    with pytest.raises(ValueError, match="unknown statistics \\['argmax'\\]"):
        HEAD(h, w, None, t, "", -100, False, False, "entropy,argmax")


def test_logits_stats_runs_as_one_generated_kernel_each_way(fresh_kernels):
    """From logits a graph holds: one compiled call forward, one backward, no ATen exp."""
    from torch.profiler import profile

    g = torch.Generator().manual_seed(0)
    z = (torch.randn(40, 300, generator=g) * 20).bfloat16().requires_grad_()
    t = torch.randint(0, 300, (40,), generator=g)

    def run():
        picked, lse, _, entropy, _, _ = LOGITS_STATS(z, t, "m0.5", -100, False, "entropy")
        return torch.autograd.grad((picked - lse).sum() + entropy.sum(), z)[0]

    run()
    with profile() as prof:
        dz = run()
    ran = {e.key: e.count for e in prof.key_averages()}
    assert sum(c for k, c in ran.items() if k.startswith("## Call CompiledFxGraph")) == 2
    assert not {"aten::exp", "aten::exp_"} & set(ran), ran
    assert dz.dtype == torch.bfloat16


def test_block_math_stays_compiled_past_dynamos_default_recompile_limit(fresh_kernels):
    """Each chain or flag set a process uses is a recompile of the same block function; past
    Dynamo's limit (here 1) a fullgraph compile raises, and the head would fall back to ATen
    calls for good: the head's own limit (KERNEL_RECOMPILES) keeps them compiled."""
    if "recompile_limit" not in inspect.signature(torch.compile).parameters:
        pytest.skip("torch.compile has no per-call recompile_limit before torch 2.13")
    g = torch.Generator().manual_seed(0)
    z, t = torch.randn(8, 300, generator=g).bfloat16(), torch.randint(0, 300, (8,), generator=g)
    # torch's own patch, not a monkeypatch: torch 2.15 keeps config overrides in context variables
    with torch._dynamo.config.patch(recompile_limit=1):
        for chain in ("m0.5", "m0.25", "m2.0,t"):
            LOGITS_STATS(z, t, chain, -100, False)  # compiles (the profile would see its tracing)
            with torch.profiler.profile() as prof:
                LOGITS_STATS(z, t, chain, -100, False)
            ran = {e.key for e in prof.key_averages()}
            assert any(k.startswith("## Call CompiledFxGraph") for k in ran) and "aten::exp" not in ran, chain


def test_block_math_under_a_dispatch_mode_runs_as_written_and_stays_compiled(fresh_kernels, amp_log):
    """Dynamo refuses to trace under a dispatch mode. The ops' kernels run with the mode popped,
    but their helpers called directly (a split under a GEMM recorder) do not: such a call runs
    the math as written, warns nothing, and the next call without a mode is compiled (the
    first such call once turned compiling off for the whole process)."""
    x = torch.randn(16, 24, generator=torch.Generator().manual_seed(0))
    with _GemmSpy():
        watched = loss_head.split_operand(x, "split-onednn")
    assert not amp_log
    loss_head.split_operand(x, "split-onednn")  # compiles
    with torch.profiler.profile() as prof:
        got = loss_head.split_operand(x, "split-onednn")
    ran = {e.key for e in prof.key_averages()}
    assert any(k.startswith("## Call CompiledFxGraph") for k in ran) and "aten::bitwise_and" not in ran
    for a, b in zip(got, watched):
        assert torch.equal(a, b)


def test_op_refuses_a_target_outside_the_vocabulary():
    h, w = torch.randn(4, 8), torch.randn(16, 8)
    with pytest.raises(IndexError, match="Target 16 is out of bounds"):
        HEAD(h, w, None, torch.tensor([0, 1, 16, -100]), "", -100, False, False)


def test_a_block_holds_16_mib_of_fp32_logits():
    assert block_shape(2048, 131072) == (2048, 2048) and block_shape(64, 8192) == (64, 8192)
    assert block_shape(65536, 32768) == (8192, 512) and block_shape(None, 32768) == (None, None)
    # a GPU's blocks are 16x larger: fewer launches and compiled calls per step
    assert block_shape(65536, 32768, "cuda") == (32768, 2048) and block_shape(8192, 50257, "cuda") == (8192, 8192)
    rows, cols = block_shape(4096, 50304)
    assert rows * cols * 4 <= 16 * 2**20


# -- the pass ----------------------------------------------------------------------------


def _token_logps(logits, labels):  # what DPO/KTO trainers gather
    logps = torch.gather(logits.float().log_softmax(-1), 2, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (logps * (labels != -100)).sum() / (labels != -100).sum()


def _per_token(logits, labels):
    return torch.gather(logits.float().log_softmax(-1), 2, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)


def _stats(logits, labels):  # what TRL's head is traced to (integrations/trl_head.py)
    z, t = (logits / 0.7).flatten(0, 1), labels.clamp(min=0).flatten()
    picked, lse, _, entropy, _, _ = torch.ops.amp.logits_stats(z, t, "", NO_IGNORE, False, "entropy,top1")
    return -(picked - lse).mean() + 0.1 * entropy.mean()


LOSSES = {
    "hf": hf_causal_loss,
    "shifted": lambda z, y: F.cross_entropy(z[:, :-1].flatten(0, 1).float(), y[:, 1:].flatten()),
    "sum_smoothed": lambda z, y: (
        F.cross_entropy(z.flatten(0, 1), y.flatten(), reduction="sum", label_smoothing=0.1) / 64
    ),
    "none": lambda z, y: F.cross_entropy(z.flatten(0, 1).float(), y.flatten(), reduction="none").mean(),
    "nll": lambda z, y: F.nll_loss(F.log_softmax(z.flatten(0, 1).float(), -1), y.flatten()),
    "token_logps": _token_logps,
    "per_token": _per_token,
    "temperature": lambda z, y: F.cross_entropy((z.float() / 0.7).flatten(0, 1), y.flatten()),
    "softcap": lambda z, y: F.cross_entropy((torch.tanh(z.float() / 30) * 30).flatten(0, 1), y.flatten()),
    "stats": _stats,
    # not fusable: class weights, an op the head does not know
    "weighted": lambda z, y: F.cross_entropy(z.flatten(0, 1).float(), y.flatten(), weight=torch.ones(z.shape[-1])),
    "clamped": lambda z, y: F.cross_entropy(z.flatten(0, 1).float().clamp(-50, 50), y.flatten()),
    # fusable, the logits kept for the other reader
    "entropy_too": lambda z, y: (
        F.cross_entropy(z.flatten(0, 1).float(), y.flatten()) + z.float().log_softmax(-1).exp().mean()
    ),
}


class Decoder(TinyDecoder):
    """A decoder whose loss head is written one of the ways models write it (``LOSSES``)."""

    losses = LOSSES


BATCH = causal_batch()


def _run(model, loss_head, dynamic=None, batches=(BATCH,), dtype="bf16", rec=None, **options):
    """Forward + backward under the amp backend, recorded; (what the backend did, recorder,
    outputs, tensors saved for backward). The next ``torch._dynamo.reset()`` empties the
    backend's records: the returned ``Done`` keeps what the test reads of them."""
    rec = rec or OpRecorder()
    backend = AmpBackend(dtype=dtype, inner=recording_backend(rec), loss_head=loss_head, **options)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, dynamic=dynamic)
    outs, saved = [], []
    for ids, labels in batches:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = compiled(ids, labels)
        loss = out[0] if isinstance(out, tuple) else out
        loss.sum().backward()
        outs.append(out)
    return Done(backend), rec, outs, saved


class Done:
    def __init__(self, backend):
        self.graphs = len(backend.records)
        self.fused = [
            f for r in backend.records for p in r.passes if p.name == "fuse_loss_head" for f in p.detail["fused"]
        ]
        self.nodes = backend.plan().nodes


def _fused(done):
    return done.fused


FUSED = ["hf", "shifted", "sum_smoothed", "none", "nll", "token_logps", "temperature", "softcap", "stats"]


@pytest.mark.parametrize("loss", FUSED)
def test_head_is_fused_trains_alike_and_saves_no_logits(loss):
    """The fused op ran on 16-bit hidden states and the FP32 master weight (cast inside), nothing
    of the logits' size (nor a 16-bit copy of the head's weight) was saved for backward,
    and loss and gradients are the unfused 16-bit head's (within BF16's rounding of both)."""
    torch.manual_seed(0)
    model = Decoder(loss, bias=loss == "temperature")
    plain = copy.deepcopy(model)
    backend, rec, (loss_fused,), saved = _run(model, "fused")
    _, rec_off, (loss_off,), saved_off = _run(plain, "off")
    assert [d[:2] for d in rec.dtypes_of(HEAD)] == [[torch.bfloat16, torch.float32]]
    assert not rec_off.dtypes_of(HEAD)
    logits_size = 62 * V  # the shifted loss reads 62 of the 64 tokens
    assert max(t.numel() for t in saved) < logits_size <= max(t.numel() for t in saved_off)
    copies = [[t for t in ts if t.numel() == V * D and t.dtype == torch.bfloat16] for ts in (saved, saved_off)]
    assert not copies[0] and copies[1]
    assert loss_fused.item() == pytest.approx(loss_off.item(), rel=2e-3)
    for p, q in zip(model.parameters(), plain.parameters()):
        assert cosine(p.grad.flatten(), q.grad.flatten()) > 0.999
    (head,) = _fused(backend)
    tokens = 62 if loss == "shifted" else 64
    assert head["block"] == (tokens, V) and head["saved_bytes"] == tokens * V * 6


class TrlHead(nn.Module):
    """A decoder whose head is TRL's fused head as amp traces it, every statistic asked for."""

    OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")

    def __init__(self):
        super().__init__()
        self.emb, self.body = nn.Embedding(V, D), nn.Sequential(nn.Linear(D, D), nn.GELU())
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, ids, labels):
        from amp_compiler.integrations.trl_head import log_prob_statistics

        h = self.body(self.emb(ids)).flatten(0, 1)
        logps, entropy, *logged = log_prob_statistics(
            h, self.head.weight, None, labels.clamp(min=0).flatten(), 0.7, 64, 30.0, 1.0, self.OUTPUTS
        )
        return -logps.mean() + 0.1 * entropy.mean(), entropy, *logged


def test_trl_heads_statistics_run_in_the_fused_head_with_every_output():
    """TRL's head (log-probs, entropy, log sum p^2, mean logit, top-1; temperature and soft-cap)
    under loss_head="fused": amp's head op executed, asked for the three extras, on 16-bit
    hidden states; the logits' statistics op did not run and nothing of the logits' size was
    saved; every output and gradient is the unfused head's."""
    torch.manual_seed(0)
    model = TrlHead()
    plain = copy.deepcopy(model)
    backend, rec, (fused,), saved = _run(model, "fused")
    _, rec_off, (off,), saved_off = _run(plain, "off")
    assert [d[:2] for d in rec.dtypes_of(HEAD)] == [[torch.bfloat16, torch.float32]]
    assert not rec.dtypes_of(LOGITS_STATS) and rec_off.dtypes_of(LOGITS_STATS) and not rec_off.dtypes_of(HEAD)
    (row,) = [n for n in backend.nodes if n.op == "amp.head_stats.default"]
    assert "log_prob_stats" in row.reason
    assert max(t.numel() for t in saved) < 64 * V <= max(t.numel() for t in saved_off)
    for a, b in zip(fused[:4], off[:4]):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-3, atol=2e-3)
    assert (fused[4] == off[4]).float().mean() > 0.95  # top-1 flips only where 16-bit rounding ties
    for p, q in zip(model.parameters(), plain.parameters()):
        assert cosine(p.grad.flatten(), q.grad.flatten()) > 0.999


def test_exact_head_matches_fp64_and_default_is_no_worse_than_16_bit():
    """Per-token target log-probs at trained-size logits (std ~4) against FP64 from the same
    hidden states: "exact" within 1e-3 nats; the default no worse than the unfused 16-bit head."""
    torch.manual_seed(0)
    vocab = 8192
    model = Decoder("token_logps", vocab=vocab)
    hidden = {}
    model.body.register_forward_hook(lambda m, i, o: hidden.__setitem__("h", o.detach()))
    batch = causal_batch(vocab=vocab)
    model(*batch)
    with torch.no_grad():  # logits of a trained model's size
        model.head.weight.mul_(4 / model.head(hidden["h"]).std())

    def per_token(mode):
        m = copy.deepcopy(model)
        m.loss = "per_token"
        # the body in FP32 (as in the reference): the head's own error is what is measured
        return _run(m, mode, batches=[batch], fp32_modules=["body"])[2][0].detach().double()

    ids, labels = batch
    model(ids, labels)  # the hidden states, again
    z = F.linear(hidden["h"].double(), model.head.weight.double())
    assert 3 < z.std() < 6  # logits of a trained size
    ref = torch.gather(z.log_softmax(-1), 2, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    err = {mode: (per_token(mode) - ref).abs() for mode in ("exact", "fused", "off")}
    assert err["exact"].max() < 1e-3
    assert err["fused"].mean() <= 1.05 * err["off"].mean()
    assert err["off"].mean() > 10 * err["exact"].mean()  # the comparison can fail


@pytest.fixture
def split_gemm(monkeypatch):
    """The exact head's split path where BF16 GEMMs write FP32 (CUDA), emulated on CPU: a
    BF16 x BF16 product accumulated and written in FP32 (each BF16 product is exact in FP32)."""
    calls = []

    def mm32(a, b):
        assert a.dtype == b.dtype == torch.bfloat16
        calls.append((tuple(a.shape), tuple(b.shape)))
        return a.float() @ b.float()

    monkeypatch.setattr(exact, "mm_fp32_out", mm32)
    for module in (exact, loss_head.blocks):  # each reads it by name
        monkeypatch.setattr(module, "split_native", lambda device: True)
    return calls


def test_split_product_is_three_bf16_gemms_to_fp32_accuracy(split_gemm):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 256, generator=g) * 3, torch.randn(256, 96, generator=g)
    want = a.double() @ b.double()
    got = loss_head.exact_mm(a, b)
    assert got.dtype == torch.float32 and len(split_gemm) == 3
    rel = ((got.double() - want).abs().max() / want.abs().max()).item()
    one_bf16 = ((a.bfloat16().double() @ b.bfloat16().double() - want).abs().max() / want.abs().max()).item()
    assert rel < 3e-5 and one_bf16 > 30 * rel  # ~16 mantissa bits where one BF16 product has 8


def _trained_size_head():
    """FP64 h, w and targets of a small head at trained-size logits, with the cross-entropy
    and its gradients for h and w by FP64 autograd."""
    g = torch.Generator().manual_seed(0)
    n, d, vocab = 37, 64, 53
    h = torch.randn(n, d, generator=g, dtype=torch.float64) / 2
    w = torch.randn(vocab, d, generator=g, dtype=torch.float64) / 2
    t = torch.randint(0, vocab, (n,), generator=g)
    h64, w64 = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = _reference(h64, w64, None, t, [], smoothing=0.0)
    return h, w, t, ref, torch.autograd.grad(ref, [h64, w64])


def test_exact_head_through_split_gemms_matches_fp64(split_gemm, small_blocks):
    """loss_head="exact" where the GEMM writes FP32: every projection and gradient GEMM of the
    op ran as three BF16 GEMMs (3 per block forward, 9 backward), the loss within 1e-3 nats
    and the gradients within 1e-4 of FP64's, at trained-size logits."""
    h, w, t, ref, ref_grads = _trained_size_head()
    n, vocab = h.shape[0], w.shape[0]
    h32, w32 = h.float().requires_grad_(), w.float().requires_grad_()
    loss = _from_stats(HEAD(h32, w32, None, t, "", -100, True, False), t, vocab, smoothing=0.0)
    blocks = sum(len(cols) for _, cols in loss_head.blocks.block_grid(n, vocab))
    assert len(split_gemm) == 3 * blocks
    grads = torch.autograd.grad(loss, [h32, w32])
    assert len(split_gemm) == 3 * blocks + 9 * blocks
    assert abs(loss.item() - ref.item()) < 1e-3
    for got, want in zip(grads, ref_grads):
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-4


# whether torch hands FP32 GEMMs to oneDNN in BF16-products mode at all (not on a CPU
# without BF16: its BLAS runs them)
ONEDNN_BF16 = "bf16" in native_dtypes(torch.device("cpu"))[0]


@contextlib.contextmanager
def _onednn_matmuls(capfd):
    """oneDNN's own log of the matmuls it executed inside (its verbose mode): the lines, filled
    in on exit."""
    capfd.readouterr()
    lines = []
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        yield lines
    lines += [ln for ln in capfd.readouterr().out.splitlines() if ",exec,cpu,matmul," in ln]


@pytest.mark.parametrize("mode", [True, "auto"])
@pytest.mark.parametrize("ahead", ["", "hw"])
def test_exact_head_with_bf16_products_runs_every_gemm_split(
    ahead, mode, monkeypatch, capfd, small_blocks, small_ahead
):
    """The exact op where oneDNN runs FP32 GEMMs' products in BF16 (AMX) and the split is
    chosen (always, or by its timing at this width, here as if 3x faster), recomputing and
    one pass: three GEMMs for each FP32 one the op runs elsewhere (by the profiler), every
    one handed to oneDNN in that mode (oneDNN's log of what it executed); the loss within
    1e-3 nats and the gradients within 1e-4 of FP64's."""
    h, w, t, ref, ref_grads = _trained_size_head()
    vocab = w.shape[0]

    def run():
        h32, w32 = h.float().requires_grad_(), w.float().requires_grad_()
        with torch.profiler.profile(record_shapes=True) as prof, _onednn_matmuls(capfd) as log:
            loss = _from_stats(HEAD(h32, w32, None, t, "", -100, True, False, "", ahead), t, vocab)
            grads = torch.autograd.grad(loss, [h32, w32])
        mms = [
            [shape for shape in e.input_shapes if len(shape) == 2][-2:]
            for e in prof.events()
            if e.name in ("aten::mm", "aten::addmm_")
        ]
        # torch hands oneDNN at least the GEMMs above 16^3 multiply-adds; small ones may run
        # FP32 in BLAS (exact either way)
        large = sum(a[0] * a[1] * b[1] > 16**3 for a, b in mms)
        return loss, grads, len(mms), large, log

    loss_head.exact_products(torch.device("cpu"))
    with tuned(split_onednn=False):  # FP32 GEMMs, also on a CPU with AMX
        _, _, fp32_gemms, _, _ = run()
    with tuned(bf16_products=True, split_onednn=mode, split_ms={h.shape[1]: (1.0, 3.0)}):
        loss, grads, gemms, large, log = run()
    assert fp32_gemms and gemms == 3 * fp32_gemms
    if ONEDNN_BF16:
        assert large and large <= len(log) <= gemms and all("attr-fpmath:bf16" in ln for ln in log)
    else:  # oneDNN has no BF16 here: torch runs them in its FP32 BLAS, none in that mode
        assert not any("attr-fpmath:bf16" in ln for ln in log)
    assert abs(loss.item() - ref.item()) < 1e-3
    for got, want in zip(grads, ref_grads):
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-4


class _GemmSpy(TorchDispatchMode):
    """Records each GEMM's operands and the oneDNN FP32 precision it ran under."""

    def __init__(self):
        super().__init__()
        self.gemms = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            mats = args[-2:] if func.overloadpacket is not torch.ops.aten.mm else args[:2]
            self.gemms.append((func.overloadpacket, mats[0].clone(), mats[1].clone(), _precision()))
        return func(*args, **(kwargs or {}))


def _precision():
    return torch.backends.mkldnn.matmul.fp32_precision


def _bf16_valued(x):
    return x.dtype == torch.float32 and torch.equal(x, x.bfloat16().float())


@pytest.mark.parametrize("kind", ["split", "split-onednn"])
def test_a_split_is_one_generated_kernel_into_storage_the_blocks_reuse(kind, fresh_kernels):
    """An operand's halves: BF16 values (``hi`` its leading bits, ``lo`` the rest rounded to
    nearest), within 2^-16 of it, FP32's extremes kept finite; written by one generated kernel
    (no ATen pass over the block) into the storage the call's blocks share, for a weight's
    transpose too."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 40, generator=g) * 3
    x[0, :3] = torch.tensor([3.4e38, -3.4e38, 1e-30])
    into = {}
    hi, lo = loss_head.split_operand(x, kind, into, "dl")
    assert hi.dtype == lo.dtype == (torch.bfloat16 if kind == "split" else torch.float32)
    hi, lo = hi.float().clone(), lo.float().clone()  # the next split takes their storage
    assert _bf16_valued(hi) and _bf16_valued(lo) and hi.isfinite().all()
    assert torch.equal(hi.abs(), (x.abs().view(torch.int32) & -65536).view(torch.float32))  # truncated
    assert torch.equal(lo, (x - hi).bfloat16().float())
    assert ((hi + lo - x).abs() <= x.abs() * 2**-16).all()
    twice = x * 2
    with torch.profiler.profile() as prof:
        again = loss_head.split_operand(twice, kind, into, "dl")
    ran = {e.key for e in prof.key_averages()}
    assert any(k.startswith("## Call CompiledFxGraph") for k in ran)
    assert not {"aten::bitwise_and", "aten::sub", "aten::_to_copy", "aten::copy_"} & ran, ran
    assert [t.data_ptr() for t in again] == [t.data_ptr() for t in into["dl"]]
    assert torch.equal(again[0].float(), 2 * hi)  # the first split's storage, overwritten
    wt = loss_head.split_operand(x.t(), kind, into, "w")  # a weight as the projection takes it
    assert [t.shape for t in wt] == [x.t().shape] * 2 and torch.equal(wt[0].float(), hi.t())
    assert wt[0].t().is_contiguous()


def test_exact_head_on_cpu_is_one_fp32_gemm_where_the_split_does_not_run_or_pay(monkeypatch):
    """No CPU GEMM of BF16 matrices writes FP32 (torch 2.13: ``mm`` with ``out_dtype`` has no
    CPU kernel): on a CPU the exact product is one plain FP32 GEMM unless oneDNN honours BF16
    products and the split is chosen (``split_onednn``: True, or "auto" where it measures
    faster); then it is three GEMMs of BF16 values under that mode, the mode restored after."""
    cpu = torch.device("cpu")
    assert not exact.split_native(cpu) and loss_head.settings().split_onednn == "auto"
    one = torch.ones(2, 2, dtype=torch.bfloat16)
    with pytest.raises((RuntimeError, NotImplementedError)):
        torch.mm(one, one, out_dtype=torch.float32)
    before = _precision()
    for asked in (False, "auto", True):
        with tuned(split_ms={128: (1.0, 3.0)}, split_onednn=asked):  # as if the split measured 3x faster
            kind = loss_head.exact_products(cpu, 128)  # probed before the spy counts
            with _GemmSpy() as spy:
                loss_head.exact_mm(torch.randn(64, 128), torch.randn(128, 96))
        assert _precision() == before
        if kind == "fp32":
            assert not (asked and bf16_products_native(cpu))
            ((op, a, b, precision),) = spy.gemms
            assert op is torch.ops.aten.mm and a.dtype == b.dtype == torch.float32 and precision == before
        else:
            assert asked and bf16_products_native(cpu) and len(spy.gemms) == 3
            assert all(_bf16_valued(a) and _bf16_valued(b) and p == "bf16" for _, a, b, p in spy.gemms)


def test_auto_split_is_chosen_by_timing_one_block_once_per_width(monkeypatch, caplog):
    """``split_onednn="auto"`` where oneDNN honours BF16 products: the first call for a head
    width times one block split and as one FP32 GEMM, and splits only where that is
    ``split_gain`` x faster; one timing per width; no decision without a width or while
    compiling; FP32, untimed, where deterministic algorithms are asked for. Timed for real
    on this machine with the probe forced: oneDNN here runs the "BF16" products in FP32, so
    the split is three FP32 GEMMs and a pass against one GEMM and the timing must refuse it."""
    cpu = torch.device("cpu")
    with tuned(bf16_products=True, split_ms={}, split_timed_block=(256, 1024)):
        with caplog.at_level("INFO", logger="amp_compiler"):
            assert loss_head.exact_products(cpu, 64) == "fp32"
        split_ms, fp32_ms = loss_head.split_timings()[64]
        assert split_ms > 1.5 * fp32_ms and "width 64: split" in caplog.text
        timed = []

        def fake(width):
            timed.append(width)
            return {128: (1.0, 2.0), 96: (1.0, 1.05)}[width]

        monkeypatch.setattr(exact, "_time_split", fake)  # a spy on the timing, not a setting
        assert [loss_head.exact_products(cpu, w) for w in (128, 128, 96, 96)] == ["split-onednn"] * 2 + ["fp32"] * 2
        assert timed == [128, 96]
        assert loss_head.exact_products(cpu) == loss_head.exact_products(cpu, 32, measure=False) == loss_head.UNDECIDED
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
        assert loss_head.exact_products(cpu, 128) == loss_head.exact_products(cpu, 40) == "fp32"
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: False)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert loss_head.exact_products(cpu, 48) == loss_head.UNDECIDED and timed == [128, 96]


def test_the_plan_says_how_the_exact_head_multiplies(monkeypatch):
    """The exact head's plan row names its GEMMs: FP32 where oneDNN runs no BF16 products; where
    it does and the split is "auto", decided at the first step until a step has timed this
    width, then the choice made (a later compile reads it)."""

    def how():
        backend, *_ = _run(Decoder("hf"), "exact")
        (row,) = [n.reason for n in backend.nodes if "projection" in n.reason and "exact" in n.reason]
        return row

    assert ": FP32 projection" in how() or bf16_products_native(torch.device("cpu"))
    monkeypatch.setattr(exact, "_time_split", lambda width: (1.0, 3.0))  # as if the split timed 3x faster
    with tuned(bf16_products=True, split_ms={}):
        assert "times faster split at the first step" in how()
        assert loss_head.split_timings() == {D: (1.0, 3.0)}  # the step timed it
        assert "three FP32 GEMMs of BF16 halves" in how()


def test_the_probe_of_bf16_products_says_what_the_gemm_does(monkeypatch):
    """``bf16_products_native`` is True exactly where a GEMM under ``bf16_products`` rounds
    its operands to BF16: checked on matrices other than the probe's, on this machine, and
    probed alike where a compile's fake mode is active."""
    monkeypatch.setattr(device, "_BF16_PRODUCTS", {})  # probed afresh, twice
    with FakeTensorMode():
        probed_under_fake = bf16_products_native(torch.device("cpu"))
    monkeypatch.setattr(device, "_BF16_PRODUCTS", {})
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(96, 200, generator=g), torch.randn(200, 80, generator=g)
    with bf16_products():
        got = torch.mm(a, b).double()
    as_bf16 = a.bfloat16().double() @ b.bfloat16().double()
    as_fp32 = a.double() @ b.double()
    rounded = (got - as_bf16).abs().max() < (got - as_fp32).abs().max()
    assert rounded == bf16_products_native(torch.device("cpu")) == probed_under_fake


def test_split_with_bf16_products_is_exact_and_reaches_onednn_with_that_mode(capfd):
    """The AMX path on any CPU: three GEMMs (one mm, two addmm into the same output) of
    BF16-valued FP32 halves, to ~16 mantissa bits, each handed to oneDNN with its FP32 math in
    BF16 (oneDNN's own log of what it executed); the setting restored after."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 256, generator=g) * 3, torch.randn(256, 96, generator=g)
    out = torch.empty(64, 96)
    before = _precision()
    with tuned(bf16_products=True, split_onednn=True), _GemmSpy() as spy, _onednn_matmuls(capfd) as log:
        assert loss_head.exact_products(torch.device("cpu")) == "split-onednn"
        got = loss_head.exact_mm(a, b, out)
    assert got.data_ptr() == out.data_ptr() and _precision() == before
    assert [op for op, *_ in spy.gemms] == [torch.ops.aten.mm, torch.ops.aten.addmm_, torch.ops.aten.addmm_]
    assert all(_bf16_valued(x) and _bf16_valued(y) and p == "bf16" for _, x, y, p in spy.gemms)
    if ONEDNN_BF16:
        assert len(log) == 3 and all("attr-fpmath:bf16" in ln for ln in log)
    else:  # oneDNN has no BF16 here: torch runs the three in its FP32 BLAS, none in that mode
        assert not any("attr-fpmath:bf16" in ln for ln in log)
    want = a.double() @ b.double()
    rel = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert rel < 3e-5


@pytest.mark.parametrize(
    "loss, why",
    [("weighted", "class weights"), ("clamped", "logits pass through aten.clamp"), ("hf", "vocabulary of 64")],
)
def test_a_head_left_as_written_says_why(loss, why):
    torch.manual_seed(0)
    vocab = 64 if why.startswith("vocabulary") else V
    model = Decoder(loss, vocab=vocab)
    backend, rec, _, _ = _run(model, "fused", batches=[causal_batch(vocab=vocab)])
    assert not rec.dtypes_of(HEAD) and not _fused(backend)
    reasons = [n.reason for n in backend.nodes if "loss head not fused" in n.reason]
    assert reasons and why in reasons[0]
    assert MIN_VOCAB > 64


def _projections(rec):
    """The vocabulary projections the graphs executed (matmuls with a V-sized operand)."""
    return rec.dtypes_where(MATMULS, lambda shapes: any(V in s for s in shapes))


def test_logits_read_elsewhere_are_kept_for_that_reader():
    """Logits another op reads too: the loss's statistics are read from them (amp::logits_stats,
    no second projection), the FP32 log-probs are not kept for backward."""
    torch.manual_seed(0)
    model = Decoder("entropy_too")
    plain = copy.deepcopy(model)
    done, rec, (loss,), saved = _run(model, "fused")
    _, _, (loss_off,), saved_off = _run(plain, "off")
    (head,) = done.fused
    assert rec.dtypes_of(LOGITS_STATS) and not rec.dtypes_of(HEAD)
    assert head["logits_kept_for"] == ["to_1"] and head["from_logits"]  # the second .float()
    fp32_logits = [[t for t in ts if t.numel() == 64 * V and t.dtype == torch.float32] for ts in (saved, saved_off)]
    assert len(fp32_logits[0]) < len(fp32_logits[1])
    assert loss.item() == pytest.approx(loss_off.item(), rel=2e-3)


def test_logits_returned_too_are_kept_intact_and_projected_once():
    """A model that returns its logits beside the loss: the loss's statistics are read from the
    logits the graph returns (one projection forward, as written; not a second in a fused
    head), the logits are the unfused graph's bit for bit, the plan names who kept them, and
    the FP32 log-probs are not kept for backward."""
    torch.manual_seed(0)
    model = Decoder("hf", returns_logits=True)
    plain = copy.deepcopy(model)
    backend, rec, ((loss, logits),), saved = _run(model, "fused", rec=OpRecorder())
    _, rec_off, ((loss_off, logits_off),), saved_off = _run(plain, "off", rec=OpRecorder())
    assert rec.dtypes_of(LOGITS_STATS) and not rec.dtypes_of(HEAD)
    assert len(_projections(rec)) == len(_projections(rec_off)) == 3  # forward, and two in backward
    assert logits.dtype == torch.float32 and torch.equal(logits, logits_off)
    (head,) = _fused(backend)
    assert head["logits_kept_for"] == ["output"] and head["saved_bytes"] == 64 * V * 4
    assert not [t for t in saved if t.numel() == 64 * V and t.dtype == torch.float32]
    assert [t for t in saved_off if t.numel() == 64 * V and t.dtype == torch.float32]
    assert loss.item() == pytest.approx(loss_off.item(), rel=2e-3)
    for p, q in zip(model.parameters(), plain.parameters()):
        assert cosine(p.grad.flatten(), q.grad.flatten()) > 0.999


LONG = causal_batch(seq=256)


def test_a_training_graph_computes_its_heads_gradients_in_forward():
    """A mean loss over 512 tokens (logits 8 MiB, gradients 1.1 MiB): fused in one pass, the
    head's backward only scales what forward computed (no recomputing op, no GEMM of the
    vocabulary's width in backward), nothing of the logits' size saved, and loss and
    gradients (the tied weight's: one, from both uses) those of the head as written."""
    torch.manual_seed(0)
    model = Decoder("hf", tied=True)
    plain = copy.deepcopy(model)
    with torch.profiler.profile() as prof:
        done, rec, (loss,), saved = _run(model, "fused", batches=(LONG,))
    _, _, (loss_off,), _ = _run(plain, "off", batches=(LONG,))
    (head,) = _fused(done)
    assert head["ahead"] == "hw" and head["block"] == (512, V)
    ran = {e.name for e in prof.events()}
    assert "amp::head_stats_backward_ahead" in ran and "amp::head_stats_backward" not in ran
    (row,) = [n for n in done.nodes if n.op == "amp.head_stats.default"]
    assert "gradients computed in forward" in row.reason and "1.1 MiB of FP32 gradients kept" in row.reason
    assert max(t.numel() for t in saved) < 512 * V
    assert loss.item() == pytest.approx(loss_off.item(), rel=2e-3)
    assert model.head.weight is model.emb.weight
    for p, q in zip(model.parameters(), plain.parameters()):
        assert cosine(p.grad.flatten(), q.grad.flatten()) > 0.999


@pytest.mark.parametrize("kept", [True, False])
def test_inductors_partitioner_keeps_the_one_pass_head_in_forward(kept, monkeypatch):
    """Under amp's default memory budget (0.8) Inductor's partitioner recomputed ops outside its
    allowlist in backward where that saved bytes: for a small one-pass head (8192 x 32, 128
    tokens) the whole head again, three GEMMs a block where backward needs none. The joint
    pass marks the op MUST_SAVE: backward runs no head forward (by what executed); without the
    pass (``kept=False``, showing the test can fail) it does."""
    from torch._inductor.utils import fresh_cache

    import amp_compiler.passes.inductor.keep_head_stats as keep

    if not kept:
        monkeypatch.setattr(keep, "keep_head_stats", lambda graph: 0)
    calls, ahead = [], loss_head.ahead_grads
    monkeypatch.setattr(loss_head.ops, "ahead_grads", lambda *a, **k: calls.append(1) or ahead(*a, **k))  # a spy
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = torch.compile(Decoder("hf", tied=True), backend=AmpBackend(loss_head="fused"))
    with fresh_cache():  # the pass's source keys the cache: a patched pass needs a fresh one
        for _ in range(2):
            loss = model(*BATCH_64)
            calls.clear()
            loss.backward()
    assert len(calls) == (0 if kept else 1)


BATCH_64 = causal_batch(seq=64)


def test_a_frozen_head_computes_only_its_inputs_gradient_in_forward():
    """A LoRA-style fine-tune: the head's weight frozen, the body trained. The one-pass head
    computes h's gradient only (no GEMM for a weight gradient nobody wants), the weight gets
    none, and the body's gradients are the head as written's."""
    torch.manual_seed(0)
    model = Decoder("hf")
    model.head.requires_grad_(False)
    plain = copy.deepcopy(model)
    done, _, _, _ = _run(model, "fused", batches=(LONG,))
    _run(plain, "off", batches=(LONG,))
    (head,) = _fused(done)
    assert head["ahead"] == "h"
    (row,) = [n for n in done.nodes if n.op == "amp.head_stats.default"]
    assert "0.1 MiB of FP32 gradients kept" in row.reason  # 512 tokens x 32 x 4 bytes
    assert model.head.weight.grad is None
    for p, q in zip(model.body.parameters(), plain.body.parameters()):
        assert cosine(p.grad.flatten(), q.grad.flatten()) > 0.999


@pytest.mark.parametrize("case", ["no_grad", "fp16", "per_token", "frozen"])
def test_a_head_computes_its_gradients_in_backward_where_forward_cannot_know_them(case):
    """Evaluation (no gradient wanted), FP16 (unscaled gradients could leave its range), a loss
    per token (weighed by the caller) and a frozen model: the fused head computes no gradient
    in forward."""
    torch.manual_seed(0)
    model = Decoder("none" if case == "per_token" else "hf")
    if case == "frozen":
        model.requires_grad_(False)
    context = torch.no_grad() if case == "no_grad" else contextlib.nullcontext()
    backend = AmpBackend(dtype="fp16" if case == "fp16" else "bf16", loss_head="fused")
    torch._dynamo.reset()
    with context:
        torch.compile(model, backend=backend)(*LONG)
    (head,) = [f for r in backend.records for p in r.passes if p.name == "fuse_loss_head" for f in p.detail["fused"]]
    assert not head["ahead"]


def test_tied_weights_get_one_gradient():
    torch.manual_seed(0)
    model = Decoder("hf", tied=True)
    plain = copy.deepcopy(model)
    _, rec, _, _ = _run(model, "fused")
    _run(plain, "off")
    assert rec.dtypes_of(HEAD)
    assert model.head.weight is model.emb.weight
    assert cosine(model.emb.weight.grad.flatten(), plain.emb.weight.grad.flatten()) > 0.999


class WrittenOutTiedHead(Decoder):
    """``h @ self.emb.weight.T``: the tied head as nanoGPT-style code writes it, no nn.Linear."""

    def forward(self, ids, labels):
        return hf_causal_loss(self.body(self.emb(ids)) @ self.emb.weight.T, labels)


def test_a_tied_head_written_as_a_matmul_is_fused():
    torch.manual_seed(0)
    model = WrittenOutTiedHead("hf")
    plain = copy.deepcopy(model)
    done, rec, (loss,), _ = _run(model, "fused")
    _, _, (loss_off,), _ = _run(plain, "off")
    (head,) = _fused(done)
    assert head["kind"] == "cross_entropy" and head["vocab"] == V
    assert rec.dtypes_of(HEAD) == [[torch.bfloat16, torch.float32]] * len(rec.dtypes_of(HEAD))
    assert loss.item() == pytest.approx(loss_off.item(), rel=2e-3)
    assert cosine(model.emb.weight.grad.flatten(), plain.emb.weight.grad.flatten()) > 0.999


def test_dynamic_sequence_lengths_compile_once():
    """Under dynamic=True two sequence lengths share one fused graph (no size guard)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    batches = [(ids, ids) for ids in (torch.randint(0, V, (2, n), generator=g) for n in (16, 24, 40))]
    done, rec, _, _ = _run(Decoder("hf"), "fused", dynamic=True, batches=batches)
    off, _, _, _ = _run(Decoder("hf"), "off", dynamic=True, batches=batches)
    assert len(rec.dtypes_of(HEAD)) == 3
    assert done.graphs == off.graphs  # the fused head guards on no size
    assert done.fused[-1]["saved_bytes"] is None


def test_plan_row_names_the_head_its_blocks_and_the_bytes():
    torch.manual_seed(0)
    backend, _, _, _ = _run(Decoder("hf"), "fused")
    (row,) = [n for n in backend.nodes if n.op == "amp.head_stats.default"]
    assert row.name.startswith("loss_head_") and row.precision == "LOW" and row.compute_dtype == "bf16"
    assert "blocks of 64 tokens x 8192 vocabulary entries" in row.reason
    assert "3.0 MiB of logits not kept" in row.reason
    backend, _, _, _ = _run(Decoder("hf"), "exact")
    (row,) = [n for n in backend.nodes if n.op == "amp.head_stats.default"]
    assert row.precision == "FP32" and "loss_head='exact'" in row.reason
    assert "3.0 MiB of logits not kept" in row.reason  # what the 16-bit head as written keeps


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_training_step_fuses_a_loss_given_beside_the_model(dtype):
    """make_train_step compiles the loss with the model: the head is fused there too, FP16
    with its loss scaling (no skipped step, the loss falls)."""
    torch.manual_seed(0)
    model, rec = Decoder(), OpRecorder()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    options = {"inner": recording_backend(rec), "loss_head": "fused"}
    step = make_train_step(model, opt, hf_causal_loss, dtype=dtype, compile_options=options)
    ids, labels = causal_batch()
    results = [step(ids, labels) for _ in range(6)]
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    assert rec.dtypes_of(HEAD) and all(d[:2] == [low, torch.float32] for d in rec.dtypes_of(HEAD))
    assert not any(r.skipped for r in results)
    assert results[-1].loss.item() < results[0].loss.item()


def test_doctor_sees_the_fused_loss_beside_the_one_it_replaces():
    """The side-by-side comparison under doctor and calibrate reads the fused head's loss
    against the FP32 program's cross-entropy: one node, its own error."""
    from amp_compiler.compare import run_side_by_side

    torch.manual_seed(0)
    run = run_side_by_side(Decoder("hf"), causal_batch(), {}, "bf16", None)
    (loss,) = [n for n in run.nodes if n.name == "cross_entropy_loss"]
    assert 0 < loss.rel_error < 1e-2 and not loss.nonfinite


def test_hugging_face_causal_lm_with_labels_fuses_and_returns_its_logits():
    """A transformers causal LM (ForCausalLMLoss: .float(), pad-and-shift, ignore_index=-100)
    called with labels: the loss's statistics are read from the BF16 logits it returns (no
    FP32 log-probs kept), the returned logits are the unfused graph's."""
    model = tiny_llama(seed=0, vocab_size=V, num_hidden_layers=1, max_position_embeddings=64)
    plain = copy.deepcopy(model)
    ids, labels = causal_batch()

    def run(m, mode):
        rec = OpRecorder()
        backend = AmpBackend(dtype="bf16", inner=recording_backend(rec), loss_head=mode)
        torch._dynamo.reset()
        out = torch.compile(m, backend=backend)(input_ids=ids, labels=labels)
        out.loss.backward()
        return out, rec, Done(backend)

    out, rec, done = run(model, "fused")
    out_off, _, _ = run(plain, "off")
    assert [d[:1] for d in rec.dtypes_of(LOGITS_STATS)] == [[torch.bfloat16]] and not rec.dtypes_of(HEAD)
    assert done.fused[0]["logits_kept_for"]  # the model returns them: read, not projected again
    assert torch.equal(out.logits, out_off.logits)
    assert out.loss.item() == pytest.approx(out_off.loss.item(), rel=2e-3)
    assert cosine(model.lm_head.weight.grad.flatten(), plain.lm_head.weight.grad.flatten()) > 0.999


def test_training_curve_is_the_unfused_heads():
    """30 AdamW steps through make_train_step, the head fused and as written, the same
    batches: the curves agree within 0.1% at every step."""

    def curve(mode):
        torch.manual_seed(0)
        model = Decoder()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        step = make_train_step(
            model, opt, hf_causal_loss, dtype="bf16", compile_options={"inner": "aot_eager", "loss_head": mode}
        )
        return [step(*causal_batch(seed=i % 4)).loss.item() for i in range(30)]

    fused, off = curve("fused"), curve("off")
    assert off[-1] < 0.9 * off[0]
    assert all(abs(a - b) <= 1e-3 * b for a, b in zip(fused, off)), max(abs(a - b) / b for a, b in zip(fused, off))


def test_blocks_of_tokens_and_vocabulary_in_a_compiled_step():
    """The same head through the backend over 3 x 4 blocks (24 tokens x 2048 entries): the
    loss is that of one block, the gradients too up to BF16 rounding of the partial GEMMs."""
    torch.manual_seed(0)
    model = Decoder("hf")
    blocked = copy.deepcopy(model)
    _, _, (one,), _ = _run(model, "fused")
    with tuned(max_rows=24, block_elements=24 * 2048):
        done, _, (many,), _ = _run(blocked, "fused")
    assert done.fused[0]["block"] == (24, 2048)
    assert many.item() == pytest.approx(one.item(), rel=1e-5)
    for p, q in zip(model.parameters(), blocked.parameters()):
        assert (p.grad - q.grad).norm() <= 1e-2 * q.grad.norm()


def test_onnx_export_leaves_the_head_as_written():
    """No ONNX runtime has amp::head_stats: the export's plan keeps the head's own ops."""
    from amp_compiler.onnx_export.program import planned_program

    ep, _, _ = planned_program(Decoder("hf").eval(), BATCH, {}, "bf16", "cpu", None, None, False)
    targets = {n.target for n in ep.graph_module.graph.nodes if n.op == "call_function"}
    assert HEAD.default not in targets and aten.cross_entropy_loss.default in targets


def test_auto_keeps_a_head_whose_logits_fit_as_written_and_says_why():
    """The default weighs the logits the head as written keeps for backward (3.0 MiB here)
    against the memory: under 1/8 of it the faster unfused head runs (its log_softmax
    executes in FP32, the fused op does not), with the figures on the loss's plan row."""
    torch.manual_seed(0)
    done, rec, _, _ = _run(Decoder("hf"), "auto", memory_bytes=32 << 20)
    assert not rec.dtypes_of(HEAD) and [d[0] for d in rec.dtypes_of(torch.ops.aten._log_softmax)] == [torch.float32]
    (row,) = [n for n in done.nodes if n.op == "aten.cross_entropy_loss.default"]
    assert "auto: left as written, faster: its logits kept for backward (3.0 MiB)" in row.reason
    assert "under 1/8 of the memory (32.0 MiB)" in row.reason and "loss_head='fused'" in row.reason


def test_auto_fuses_where_the_logits_would_take_an_eighth_of_the_memory():
    torch.manual_seed(0)
    done, rec, _, _ = _run(Decoder("hf"), "auto", memory_bytes=16 << 20)
    assert [d[:2] for d in rec.dtypes_of(HEAD)] == [[torch.bfloat16, torch.float32]]
    (row,) = [n for n in done.nodes if n.op == "amp.head_stats.default"]
    assert "auto: fused, the logits as written would take at least 1/8 of the memory (16.0 MiB)" in row.reason


def test_auto_reads_the_statistics_from_logits_the_graph_returns():
    """Returned logits are kept anyway: whatever the memory, the default reads the loss's
    statistics from them (as fast as the head as written: measured equal on a Llama) and
    keeps no FP32 log-probs; the plan says so."""
    torch.manual_seed(0)
    done, rec, _, saved = _run(Decoder("hf", returns_logits=True), "auto", memory_bytes=1 << 40)
    assert rec.dtypes_of(LOGITS_STATS) and not rec.dtypes_of(HEAD)
    assert not [t for t in saved if t.numel() == 64 * V and t.dtype == torch.float32]
    (row,) = [n for n in done.nodes if n.op == "amp.logits_stats.default"]
    assert "auto: statistics read from the logits the graph keeps anyway" in row.reason


def test_auto_under_inductor_leaves_returned_logits_as_written_and_says_why():
    """Under Inductor the head as written keeps its 16-bit logits and no FP32 log-probs (its
    partitioner recomputes them: checked here, the premise of the choice), so reading the
    statistics in amp's op would save nothing: the default leaves the head as written."""
    torch.manual_seed(0)
    model = Decoder("hf", returns_logits=True)
    backend = AmpBackend(dtype="bf16", loss_head="auto", memory_bytes=1 << 40)
    torch._dynamo.reset()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss, logits = torch.compile(model, backend=backend)(*BATCH)
    loss.backward()
    done = Done(backend)
    assert not done.fused
    (row,) = [n for n in done.nodes if n.op == "aten.cross_entropy_loss.default"]
    assert "auto: left as written: its logits are kept for output anyway" in row.reason
    logits_saved = [t for t in saved if t.numel() == logits.numel()]
    assert [t.dtype for t in logits_saved] == [torch.bfloat16]


def test_auto_weighs_the_devices_memory_by_default(monkeypatch):
    """Without memory_bytes the device's total decides (patched: 16 MiB makes 3 MiB large)."""
    import importlib

    fuse = importlib.import_module("amp_compiler.passes.fuse_loss_head")  # the module, not the pass
    seen = []
    monkeypatch.setattr(fuse, "memory_bytes", lambda device: seen.append(device.type) or 16 << 20)
    torch.manual_seed(0)
    _, rec, _, _ = _run(Decoder("hf"), "auto")
    assert rec.dtypes_of(HEAD) and seen == ["cpu"]


@pytest.mark.parametrize("loss", ["hf", "none"])
def test_auto_fuses_a_head_of_dynamic_size(loss):
    """Under dynamic=True the number of tokens has no bound: the head is fused, in one pass
    where its loss is a mean (bounded by the tokens: gradients of 4 x width bytes a token)."""
    g = torch.Generator().manual_seed(0)
    batches = [(ids, ids) for ids in (torch.randint(0, V, (2, n), generator=g) for n in (16, 24, 40))]
    torch.manual_seed(0)
    done, rec, _, _ = _run(Decoder(loss), "auto", dynamic=True, batches=batches, memory_bytes=1 << 40)
    assert len(rec.dtypes_of(HEAD)) == 3
    why = "auto: fused, in one pass" if loss == "hf" else "auto: fused, the number of tokens is dynamic"
    assert any(why in n.reason for n in done.nodes)
    assert {f["ahead"] for f in done.fused} == {"hw" if loss == "hf" else ""}


def test_device_memory_is_the_ram_or_the_containers_limit():
    from amp_compiler.device import memory_bytes

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < memory_bytes(torch.device("cpu")) <= ram


@pytest.mark.parametrize("bad", [0, -1, "1GB", 1.5, True])
def test_memory_bytes_must_be_a_positive_int(bad):
    from amp_compiler.options import AmpOptionsError

    with pytest.raises(AmpOptionsError, match="memory_bytes must be a positive int"):
        AmpBackend(memory_bytes=bad)
