"""Table tests: the policy is data, every entry a real ATen op, one decision each."""

import itertools

import pytest
import torch

from amp_compiler import AmpPolicyError, Policy, Precision
from amp_compiler.policy import (
    BANNED_OPS,
    FP16_EXTRA_FP32_OPS,
    FP32_OPS,
    LOW_OPS,
    PASSTHROUGH_OPS,
    PROMOTE_OPS,
    TABLES,
    resolve_op,
    why,
)

aten = torch.ops.aten
ALL = sorted({op for ops in TABLES.values() for op in ops}, key=lambda p: p.__name__)


@pytest.mark.parametrize("op", ALL, ids=lambda p: p.__name__)
def test_table_entry_is_a_real_aten_packet(op):
    """Every entry is a torch.ops.aten packet with at least one overload."""
    assert isinstance(op, torch._ops.OpOverloadPacket)
    assert op._qualified_op_name.startswith("aten::")
    assert op.overloads()


def test_tables_are_disjoint():
    """No op is in two tables."""
    for (a, x), (b, y) in itertools.combinations(TABLES.items(), 2):
        assert not (x & y), f"{a} and {b} share {sorted(o.__name__ for o in x & y)}"


@pytest.mark.parametrize("precision,ops", list(TABLES.items()), ids=lambda v: str(v)[:12])
def test_policy_bf16_decides_each_table_entry(precision, ops):
    """Under BF16 every op gets exactly its table's decision."""
    policy = Policy(torch.bfloat16)
    for op in ops:
        assert policy.decide(op) is precision, op


def test_policy_fp16_moves_overflow_prone_ops_to_fp32():
    """FP16 differs from BF16 only in the overflow-prone ops, which go to FP32."""
    bf16, fp16 = Policy(torch.bfloat16), Policy(torch.float16)
    for op in ALL:
        if op in FP16_EXTRA_FP32_OPS:
            assert fp16.decide(op) is Precision.FP32
            assert bf16.decide(op) in (Precision.PROMOTE, Precision.PASSTHROUGH)
            assert "FP16" in why(op, Precision.FP32, fp16)
        else:
            assert fp16.decide(op) is bf16.decide(op), op


@pytest.mark.parametrize(
    "op,precision",
    [
        (aten.mm, Precision.LOW),
        (aten.linear, Precision.LOW),
        (aten.convolution, Precision.LOW),
        (aten.scaled_dot_product_attention, Precision.LOW),
        (aten.einsum, Precision.LOW),
        (aten.softmax, Precision.FP32),
        (aten.layer_norm, Precision.FP32),
        (aten.rms_norm, Precision.FP32),
        (aten.sum, Precision.FP32),
        (aten.exp, Precision.FP32),
        (aten.cross_entropy_loss, Precision.FP32),
        (aten.log_sigmoid, Precision.FP32),
        (aten.cat, Precision.PROMOTE),
        (aten.add, Precision.PROMOTE),
        (aten.where, Precision.PROMOTE),
        (aten.index_put, Precision.PROMOTE),
        (aten.addcmul, Precision.PROMOTE),
        (aten.view, Precision.PASSTHROUGH),
        (aten.gelu, Precision.PASSTHROUGH),
        (aten.relu, Precision.PASSTHROUGH),
        (aten.embedding, Precision.PASSTHROUGH),
        (aten.embedding_bag, Precision.FP32),
        (aten.linalg_inv, Precision.FP32),
        (aten.nan_to_num, Precision.FP32),
        (aten.multinomial, Precision.FP32),
        (aten.searchsorted, Precision.PROMOTE),
        (aten.scatter_reduce, Precision.PROMOTE),
        (aten.isnan, Precision.PASSTHROUGH),
        (aten.reflection_pad2d, Precision.PASSTHROUGH),
    ],
)
def test_policy_key_ops(op, precision):
    """The ops the design note names land where it says."""
    assert Policy(torch.bfloat16).decide(op) is precision


def test_policy_inplace_variant_shares_functional_decision():
    """aten.add_ is decided like aten.add, aten.exp_ like aten.exp."""
    policy = Policy(torch.bfloat16)
    assert policy.decide(aten.add_) is Precision.PROMOTE
    assert policy.decide(aten.exp_) is Precision.FP32


def test_policy_unknown_op_is_none():
    """Ops in no table are unknown (the tagger runs them in FP32 or raises)."""
    assert Policy(torch.bfloat16).decide(aten.special_bessel_j0) is None


def test_policy_binary_cross_entropy_banned_with_advice():
    """binary_cross_entropy raises and names the logits form."""
    assert aten.binary_cross_entropy in BANNED_OPS
    with pytest.raises(AmpPolicyError, match="binary_cross_entropy_with_logits"):
        Policy(torch.bfloat16).decide(aten.binary_cross_entropy)


def test_policy_overrides_move_ops_between_tables():
    """An override moves an op into one table and out of the others."""
    policy = Policy.build(torch.bfloat16, fp32_ops=["aten.mm"], low_ops=[aten.histc], remove_ops=["gelu"])
    assert policy.decide(aten.mm) is Precision.FP32
    assert policy.decide(aten.histc) is Precision.LOW
    assert policy.decide(aten.gelu) is None
    assert "user override" in why(aten.mm, Precision.FP32, policy)


def test_policy_override_into_two_tables_is_an_error():
    with pytest.raises(ValueError, match="both"):
        Policy.build(torch.bfloat16, fp32_ops=["mm"], low_ops=["aten.mm"])


@pytest.mark.parametrize("spelling", ["aten.mm", "mm", "aten::mm", "torch.ops.aten.mm"])
def test_resolve_op_spellings(spelling):
    assert resolve_op(spelling) is aten.mm
    assert resolve_op(aten.mm.default) is aten.mm


def test_resolve_op_unknown_name_says_how_to_spell_it():
    with pytest.raises(ValueError, match="no ATen op named 'aten.mmm'.*aten.<name>"):
        resolve_op("aten.mmm")


def test_table_groups_cover_the_design_note():
    """LOW holds matmul/conv/attention; FP32 holds softmax, norms, reductions, math, losses."""
    assert {aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten.matmul, aten.linear} <= LOW_OPS
    assert {
        aten.softmax,
        aten.log_softmax,
        aten.layer_norm,
        aten.group_norm,
        aten.batch_norm,
        aten.sum,
        aten.mean,
        aten.var,
        aten.prod,
        aten.cumsum,
        aten.exp,
        aten.log,
        aten.pow,
        aten.rsqrt,
        aten.reciprocal,
        aten.mse_loss,
        aten.nll_loss,
    } <= FP32_OPS
    assert {aten.cat, aten.stack, aten.index_put, aten.addcmul, aten.where} <= PROMOTE_OPS
    assert {aten.view, aten.permute, aten.transpose, aten.reshape} <= PASSTHROUGH_OPS


def test_resolve_op_custom_namespace():
    """Custom ops are named '<namespace>::<name>'."""
    assert resolve_op("prims::convert_element_type") is torch.ops.prims.convert_element_type


def test_external_op_decided_by_qualified_name():
    """transformers' MoE grouped matmul is LOW without importing transformers here."""
    from amp_compiler.policy import EXTERNAL_OPS

    class FakePacket:
        _qualified_op_name = "transformers::grouped_mm_fallback"

    assert EXTERNAL_OPS["transformers::grouped_mm_fallback"] is Precision.LOW
    assert Policy(torch.bfloat16).decide(FakePacket()) is Precision.LOW
