"""Tiny graphs through the passes: exact casts, the pass contract, invariants."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import OpRecorder, assert_near

from amp_compiler import AmpBackend, AmpPolicyError, AmpVerifyError, Precision
from amp_compiler.meta import info
from amp_compiler.passes import PIPELINE, PassContext, run_pipeline, verify_plan
from amp_compiler.passes.graph_util import CAST_OP, is_inserted_cast

aten = torch.ops.aten


def rewrite(fn, *inputs, **options):
    """Run ``fn`` through the amp pipeline; returns (graph module, backend)."""
    backend = AmpBackend(inner="eager", **options)
    gm = backend.rewrite(torch.fx.symbolic_trace(fn), list(inputs)).graph
    return gm, backend


def casts(gm):
    return [n for n in gm.graph.nodes if is_inserted_cast(n)]


def cast_pairs(gm):
    """(source name, target dtype) of every inserted cast, in graph order."""
    return [(n.args[0].name, n.kwargs["dtype"]) for n in casts(gm)]


def nodes_of(gm, packet):
    return [n for n in gm.graph.nodes if getattr(n.target, "overloadpacket", None) is packet]


def out_dtypes(gm):
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return [a.meta["val"].dtype for a in out.all_input_nodes]


x = torch.randn(4, 8)
w = torch.randn(8, 8)
bf16, fp32 = torch.bfloat16, torch.float32


def test_tag_matmul_low_softmax_fp32_three_casts():
    """matmul gets bf16 inputs (2 casts), softmax gets its input back in fp32 (1 cast)."""
    gm, _ = rewrite(lambda x, w: torch.softmax(x @ w, -1), x, w)
    (mm,) = nodes_of(gm, aten.matmul)
    (sm,) = nodes_of(gm, aten.softmax)
    assert info(mm).precision is Precision.LOW and info(sm).precision is Precision.FP32
    assert [a.meta["val"].dtype for a in mm.all_input_nodes] == [bf16, bf16]
    assert sm.args[0].meta["val"].dtype == fp32
    assert len(casts(gm)) == 3
    assert out_dtypes(gm) == [fp32]


def test_insert_casts_weight_cast_once_for_two_readers():
    """A weight read by two matmuls is cast once; the bf16 sum goes back to fp32 at the output."""
    gm, _ = rewrite(lambda x, y, w: (x @ w) + (y @ w), x, x.clone(), w)
    sources = [s for s, _ in cast_pairs(gm)]
    assert sorted(sources[:3]) == ["w", "x", "y"]  # the weight once
    assert len(casts(gm)) == 4  # x, y, w -> bf16; result -> fp32
    assert out_dtypes(gm) == [fp32]


def test_insert_casts_activation_between_matmuls_stays_low():
    """Linear -> GELU -> Linear costs no cast around the GELU."""
    gm, _ = rewrite(lambda x, w1, w2: F.gelu(x @ w1) @ w2, x, w, w)
    (gelu,) = nodes_of(gm, aten.gelu)
    assert info(gelu).precision is Precision.PASSTHROUGH
    assert gelu.meta["val"].dtype == bf16 and not info(gelu).casts
    assert len(casts(gm)) == 3  # x, w -> bf16 (w shared), result -> fp32


def test_insert_casts_residual_add_promotes_to_fp32():
    """x + f(x): the residual stream stays fp32, the branch is cast up once."""
    gm, _ = rewrite(lambda x, w: x + x @ w, x, w)
    (add,) = nodes_of(gm, aten.add)
    assert info(add).precision is Precision.PROMOTE and add.meta["val"].dtype == fp32
    assert len(casts(gm)) == 3 and out_dtypes(gm) == [fp32]


def test_user_cast_survives_and_is_pinned():
    """A user's .float() is kept as written (and makes the sum need no extra cast)."""
    gm, _ = rewrite(lambda x, w: (x @ w).float().sum(), x, w)
    user = [n for n in gm.graph.nodes if n.target is aten.to.dtype]
    assert len(user) == 1 and not is_inserted_cast(user[0])
    assert info(user[0]).precision is Precision.FP32 and "user cast" in info(user[0]).reason
    assert len(casts(gm)) == 2


def test_integer_and_float64_untouched():
    """float64 matmuls and integer ops get no casts."""
    x64, w64 = x.double(), w.double()
    gm, _ = rewrite(lambda a, b, i: ((a @ b).sum(), (i * 2).sum()), x64, w64, torch.arange(4))
    assert casts(gm) == []
    (mm,) = nodes_of(gm, aten.matmul)
    assert "float64" in info(mm).reason
    assert out_dtypes(gm) == [torch.float64, torch.int64]


def test_inplace_write_gets_fresh_casts_per_reader():
    """A view whose base is written in place between two reads is cast afresh for each."""

    def f(x, w):
        v = x.view(4, 8)
        a = v @ w
        x.add_(1)
        return a, v @ w

    gm, _ = rewrite(f, x.clone(), w)
    (view,) = nodes_of(gm, aten.view)
    sources = [s for s, d in cast_pairs(gm) if d == bf16]
    assert sources.count(view.name) == 2
    assert len(sources) == 3  # the view twice, w once
    xa, xr = x.clone(), x.clone()
    a, b = gm(xa, w)
    ra = xr @ w
    xr.add_(1)
    rb = xr @ w
    assert_near(a, ra, 0.02)  # BF16 rounding: under 1% of the largest output
    assert_near(b, rb, 0.02)
    assert (a - rb).abs().max() > 0.2 * rb.abs().max()  # what a stale cast would return is far off
    torch.testing.assert_close(xa, xr)


def test_inplace_on_low_value_runs_in_its_dtype():
    """h.mul_(2) on a bf16 matmul result runs in bf16; softmax then gets a fresh fp32 cast."""

    def f(x, w):
        h = x @ w
        h.mul_(2)
        return torch.softmax(h, -1)

    gm, _ = rewrite(f, x, w)
    (mul,) = nodes_of(gm, aten.mul_)
    assert mul.meta["val"].dtype == bf16 and "in-place" in info(mul).reason
    assert len(casts(gm)) == 3


def test_pipeline_is_idempotent_and_lints():
    """A second run of the whole pipeline changes nothing."""
    gm, backend = rewrite(lambda x, w: torch.softmax(x @ w, -1) + x, x, w)
    code = gm.code
    rec = backend.records[0]
    ctx = PassContext(policy=rec.options.policy(bf16), options=rec.options, fake_mode=None)
    again = run_pipeline(gm, ctx, PIPELINE)
    assert [r.modified for r in again] == [False] * len(PIPELINE)
    assert gm.code == code
    gm.graph.lint()


def test_pass_records_say_what_changed():
    """The runner records per pass its name, nodes added and modified flag."""
    _, backend = rewrite(lambda x, w: torch.softmax(x @ w, -1), x, w)
    recs = {r.name: r for r in backend.records[0].passes}
    assert list(recs) == [p.__name__ for p in PIPELINE]
    assert recs["insert_casts"].nodes_added == 3 and recs["insert_casts"].modified
    assert not recs["verify_plan"].modified


def test_fold_drops_own_noop_cast_keeps_user_cast():
    """fold removes an inserted cast that changes nothing, never a user's cast."""
    from amp_compiler.passes import fold_casts

    gm, backend = rewrite(lambda x, w: (x @ w).float().softmax(-1), x, w)
    user = next(n for n in gm.graph.nodes if n.target is aten.to.dtype)
    with gm.graph.inserting_after(user):
        extra = gm.graph.call_function(CAST_OP, (user,), {"dtype": fp32})
    extra.meta.update(
        val=user.meta["val"], amp=type(info(user))(Precision.FP32, "test", inserted=True, planned=fp32, orig=fp32)
    )
    sm = next(iter(user.users.keys() - {extra}))
    sm.replace_input_with(user, extra)
    ctx = PassContext(policy=backend.records[0].options.policy(bf16), options=backend.records[0].options)
    result = fold_casts(gm, ctx)
    assert result.modified and result.detail == {"noop": 1}
    assert extra not in gm.graph.nodes and user in gm.graph.nodes


def test_verify_names_the_node_that_breaks_an_invariant():
    """Feeding an fp32 value straight into a LOW matmul fails verification, naming it."""
    gm, backend = rewrite(lambda x, w: x @ w, x, w)
    (mm,) = nodes_of(gm, aten.matmul)
    cast = mm.args[0]
    mm.replace_input_with(cast, cast.args[0])
    ctx = PassContext(policy=backend.records[0].options.policy(bf16), options=backend.records[0].options)
    with pytest.raises(AmpVerifyError, match=r"node 'matmul'.*arrives as fp32.*LOW"):
        verify_plan(gm, ctx)


def test_unknown_op_fp32_and_reported():
    """Ops in no table run in FP32 and are counted once per graph."""
    gm, backend = rewrite(lambda x, w: torch.special.bessel_j0(x @ w), x, w)
    (j0,) = nodes_of(gm, aten.special_bessel_j0)
    assert info(j0).precision is Precision.FP32 and "unknown" in info(j0).reason
    assert backend.plan().summary()["unknown_ops"] == {"aten.special_bessel_j0.default": 1}
    with OpRecorder() as rec:  # what runs: the product in BF16, the unknown op on FP32
        gm(x, w)
    assert rec.dtypes_of(aten.mm) == [[bf16, bf16]] and rec.dtypes_of(aten.special_bessel_j0) == [[torch.float32]]


def test_strict_unknown_op_raises_naming_it():
    with pytest.raises(AmpPolicyError, match=r"unknown op aten.special_bessel_j0.default.*low_ops"):
        rewrite(lambda x, w: torch.special.bessel_j0(x @ w), x, w, strict=True)


def test_banned_bce_raises_with_advice():
    with pytest.raises(AmpPolicyError, match="binary_cross_entropy_with_logits"):
        rewrite(lambda x, w: F.binary_cross_entropy(torch.sigmoid(x @ w), torch.rand(4, 8)), x, w)


def test_low_precision_outputs_option():
    """With low_precision_outputs the matmul result is returned in bf16, no cast back."""
    gm, _ = rewrite(lambda x, w: x @ w, x, w, low_precision_outputs=True)
    assert out_dtypes(gm) == [bf16] and len(casts(gm)) == 2


def test_fp16_plan_uses_fp16_and_moves_div_to_fp32():
    """FP16 casts to float16; division (overflow-prone) runs in FP32 under FP16 only."""
    f = lambda x, w: (x @ w) / 3.0  # noqa: E731
    gm16, _ = rewrite(f, x, w, dtype="fp16")
    (div,) = nodes_of(gm16, aten.div)
    assert info(div).precision is Precision.FP32
    assert {d for _, d in cast_pairs(gm16)} == {torch.float16, fp32}
    gm_bf, _ = rewrite(f, x, w)
    (div,) = nodes_of(gm_bf, aten.div)
    assert info(div).precision is Precision.PROMOTE and div.meta["val"].dtype == bf16


def test_override_pins_matmul_to_fp32():
    gm, _ = rewrite(lambda x, w: x @ w, x, w, fp32_ops=["aten.matmul"])
    assert casts(gm) == []
    (mm,) = nodes_of(gm, aten.matmul)
    assert info(mm).reason == "user override: in fp32_ops"


def test_every_node_has_decision_and_reason():
    gm, _ = rewrite(lambda x, w: F.layer_norm(x + torch.relu(x @ w), (8,)).sum(), x, w)
    for node in gm.graph.nodes:
        assert info(node) is not None and info(node).reason, node.name


def cast_elements(gm):
    return sum(n.meta["val"].numel() for n in casts(gm))


def test_min_cut_casts_before_an_expand_not_after():
    """FP32 softmax -> expand x16 -> matmul: greedy casts the expanded tensor; the cut
    moves the expand to 16 bit and casts the small one (exact: the matmul rounds anyway)."""

    def fn(s, w):
        p = torch.softmax(s, -1)  # FP32, (4, 8)
        big = p.unsqueeze(0).expand(16, 4, 8)  # flexible, 16x larger
        return big @ w

    gm, backend = rewrite(fn, x, w)
    (expand,) = nodes_of(gm, aten.expand)
    assert info(expand).planned == bf16 and "minimum cut" in info(expand).reason
    # to bf16: the (4, 8) softmax output and w; never the (16, 4, 8) expanded value
    down = [n.meta["val"].numel() for n in casts(gm) if n.kwargs["dtype"] == bf16]
    assert sorted(down) == [32, 64]
    record = next(r for r in backend.records[0].passes if r.name == "place_flexible")
    assert record.detail["elements_cast"]["min_cut"] < record.detail["elements_cast"]["greedy"]


def test_min_cut_never_rounds_what_greedy_kept_fp32():
    """An FP32 value read by an FP32 op and by a matmul through a view keeps its FP32
    path: the view may not move to 16 bit when another reader needs FP32."""

    def fn(s, w):
        p = torch.softmax(s, -1)
        v = p.view(4, 8)
        return (v @ w).sum() + v.exp().sum()

    gm, _ = rewrite(fn, x, w)
    (view,) = nodes_of(gm, aten.view)
    (exp,) = nodes_of(gm, aten.exp)
    assert info(view).planned == fp32 and exp.args[0].meta["val"].dtype == fp32


def test_min_cut_leaves_greedy_plan_when_it_is_already_best():
    """Linear -> GELU -> Linear: nothing to gain, nothing moves."""
    gm, backend = rewrite(lambda x, w1, w2: F.gelu(x @ w1) @ w2, x, w, w)
    record = next(r for r in backend.records[0].passes if r.name == "place_flexible")
    assert not record.modified


def test_min_cut_never_moves_a_fill_of_fp32_min_into_16_bit():
    """Falcon's ALiBi mask: masked_fill(scores, mask, finfo(float32).min) then matmul. Casting
    after the fill costs as much as before it; a tie must not move the fill into 16 bit,
    where the constant does not fit (it did, in the zoo's Falcon)."""
    from amp_compiler.passes.place_flexible import _candidate

    mask = torch.rand(4, 8) > 0.5

    def fn(s, m, w):
        return torch.softmax(s, -1).masked_fill(m, torch.finfo(torch.float32).min) @ w

    gm, _ = rewrite(fn, x, mask, w)
    (fill,) = nodes_of(gm, aten.masked_fill)
    assert info(fill).planned == fp32 and not _candidate(fill, bf16)
    gm(x, mask, w)  # runs: no constant overflow


def _sdpa_cases():
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    rows_masked = torch.rand(5, 7, generator=g) > 0.4
    rows_masked[2] = False  # a query that may attend nothing: the fused op gives zeros
    float_mask = r(2, 1, 5, 7)
    float_mask[..., 3, :] = float("-inf")
    return {
        "causal": ((r(2, 3, 5, 8), r(2, 3, 5, 8), r(2, 3, 5, 8)), dict(is_causal=True)),
        "causal_fewer_queries": ((r(2, 3, 3, 8), r(2, 3, 5, 8), r(2, 3, 5, 8)), dict(is_causal=True)),
        "bool_mask_row_all_masked": ((r(2, 3, 5, 8), r(2, 3, 7, 8), r(2, 3, 7, 4)), dict(attn_mask=rows_masked)),
        "float_mask_row_all_inf": ((r(2, 3, 5, 8), r(2, 3, 7, 8), r(2, 3, 7, 8)), dict(attn_mask=float_mask)),
        "scale_and_gqa": (
            (r(2, 4, 5, 8), r(2, 2, 5, 8), r(2, 2, 5, 8)),
            dict(scale=0.3, enable_gqa=True, is_causal=True),
        ),
        "no_batch_dim": ((r(3, 5, 8), r(3, 5, 8), r(3, 5, 8)), {}),
    }


def _decomposed(fn, inputs, **options):
    """(pass detail, graph) of decompose_attention on ``fn`` traced as ATen."""
    from amp_compiler.capture import to_aten
    from amp_compiler.passes import decompose_attention

    gm, fake_mode, _ = to_aten(torch.fx.symbolic_trace(fn), inputs)
    opts = AmpBackend(**options).options
    result = decompose_attention(gm, PassContext(policy=opts.policy(bf16), options=opts, fake_mode=fake_mode))
    return result.detail, gm


def test_attention_option_overrides_the_measured_rule():
    """ "fused" keeps a short SDPA that "auto" writes out; "explicit" writes out a long one that
    "auto" keeps."""
    from amp_compiler.passes.decompose_attention import SHORT_SCORES

    def sdpa(q):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    short, long = torch.randn(1, 2, 8, 4), torch.randn(1, 1, 2048, 4)
    assert 2048 * 2048 > SHORT_SCORES
    assert _decomposed(sdpa, [short])[0] == {"decomposed": {"short_sequence": 1}}
    detail, gm = _decomposed(sdpa, [short], attention="fused")
    assert detail == {} and nodes_of(gm, aten.scaled_dot_product_attention)
    assert _decomposed(sdpa, [long])[0] == {}
    detail, gm = _decomposed(sdpa, [long], attention="explicit")
    assert detail == {"decomposed": {"asked": 1}} and not nodes_of(gm, aten.scaled_dot_product_attention)


@pytest.mark.parametrize("case", list(_sdpa_cases()))
def test_decomposed_attention_matches_the_fused_op(case):
    """The written-out attention (run in FP32 here) gives SDPA's values and gradients,
    fully masked rows (zeros, not NaN) and grouped-query heads included."""
    (q, k, v), kw = _sdpa_cases()[case]

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, **kw)

    detail, gm = _decomposed(fn, [q, k, v])
    assert detail == {"decomposed": {"short_sequence": 1}}
    assert not nodes_of(gm, aten.scaled_dot_product_attention)
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_ins = [t.clone().requires_grad_() for t in (q, k, v)]
    out, ref = gm(*ins), fn(*ref_ins)
    out = out[0] if isinstance(out, (tuple, list)) else out
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(ref)
    out.backward(g)
    ref.backward(g)
    for a, b in zip(ins, ref_ins):
        torch.testing.assert_close(a.grad, b.grad)
