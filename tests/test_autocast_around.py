"""A user's ``torch.autocast`` around the compiled call: a region of the graph, amp adds its plan."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import (
    NormHead,
    OpRecorder,
    cosine,
    grads,
    recording_backend,
)

import amp_compiler
import amp_compiler.autocast_region
import amp_compiler.backend
import amp_compiler.device
from amp_compiler import AmpBackend

aten = torch.ops.aten


@pytest.mark.parametrize(
    "around,asked,plan,matmuls",
    [
        (torch.bfloat16, "auto", "bf16", torch.bfloat16),  # amp not told a dtype: autocast's is asked
        (torch.float16, "bf16", "bf16", torch.float16),  # autocast's casts stay: its matmuls FP16
        (torch.bfloat16, "fp32", "fp32", torch.bfloat16),  # FP32 asked: autocast's program as written
    ],
)
@pytest.mark.parametrize("backward_inside", [False, True])
def test_called_under_the_users_autocast_is_a_region_of_the_graph(
    around, asked, plan, matmuls, backward_inside, caplog, monkeypatch
):
    """A training loop that keeps its torch.autocast around the amp-compiled model. Traced
    under the ambient autocast, the pipeline saw autocast's dtypes where the plan had its own and
    refused the graph ('layer_norm computes fp32 but the plan says bf16'). Now the autocast is a
    region of the graph, as one inside the model: its casts stay, amp adds its own."""
    monkeypatch.setattr(amp_compiler.autocast_region, "_warned_autocast", set())
    torch.manual_seed(0)
    model, x, y = NormHead(), torch.randn(8, 32), torch.randint(0, 10, (8,))
    ref = copy.deepcopy(model)
    F.cross_entropy(ref(x), y).backward()
    rec = OpRecorder()
    backend = AmpBackend(dtype=asked, inner=recording_backend(rec))
    with caplog.at_level("WARNING", logger="amp_compiler"):
        with torch.autocast("cpu", dtype=around):
            out = torch.compile(model, backend=backend)(x)
            loss = F.cross_entropy(out, y)
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
    assert backend.records[0].dtype == plan
    assert (plan != "fp32") == backend.records[0].plan.applied
    ran = rec.dtypes_of(aten.addmm, aten.mm)  # forward and backward
    assert ran and all(set(d) == {matmuls} for d in ran), ran
    if plan != "fp32":  # amp's FP32 LayerNorm (CPU autocast alone runs it in BF16)
        assert all(d == [torch.float32] * 3 for d in rec.dtypes_of(aten.native_layer_norm))
    assert torch.isfinite(loss) and cosine(grads(model), grads(ref)) > 0.999
    said = [r.getMessage() for r in caplog.records if "under torch.autocast" in r.getMessage()]
    assert len(said) == 1 and f"amp's plan ({plan})" in said[0], said


def test_called_under_the_users_autocast_through_inductor_trains_like_fp32(no_caches):
    torch.manual_seed(0)
    model, x, y = NormHead(), torch.randn(8, 32), torch.randint(0, 10, (8,))
    ref = copy.deepcopy(model)
    F.cross_entropy(ref(x), y).backward()
    backend = AmpBackend(dtype="auto")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(torch.compile(model, backend=backend)(x), y)
    loss.backward()
    assert backend.records[0].dtype == "bf16" and backend.records[0].plan.applied
    assert "torch.autocast(cpu, bf16) around the call" in backend.records[0].dtype_reason
    assert cosine(grads(model), grads(ref)) > 0.999


class _BiasOfQueryDtype(nn.Module):
    """Builds an attention bias as zeros of the query's dtype, as T5 does for cross-attention."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(16, 16)

    def forward(self, x):
        q = self.q(x).view(2, 4, 2, 8).transpose(1, 2)
        bias = torch.zeros(1, 2, 4, 4, dtype=q.dtype)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=bias).float().pow(2).mean()


def test_a_graph_amp_cannot_plan_under_the_users_autocast_runs_as_autocast_makes_it(caplog):
    """Under autocast Dynamo bakes BF16 into the bias (the query's dtype then); amp's trace sees
    an FP32 query there and cannot plan the graph. It runs as plain torch.compile would under
    that autocast, with a warning, instead of failing the compile."""
    torch.manual_seed(0)
    model, x = _BiasOfQueryDtype(), torch.randn(2, 4, 16)
    ref = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = ref(x)
    expected.backward()
    rec = OpRecorder()
    backend = AmpBackend(inner=recording_backend(rec))
    with caplog.at_level("WARNING", logger="amp_compiler"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.compile(model, backend=backend)(x)
        loss.backward()
    record = backend.records[0]
    assert not record.plan.applied and "amp's plan not applied" in record.dtype_reason
    assert any("could not be planned" in r.getMessage() for r in caplog.records)
    assert all(set(d) == {torch.bfloat16} for d in rec.dtypes_of(aten.addmm, aten.mm))
    assert loss.item() == pytest.approx(expected.item(), rel=1e-2)
    assert cosine(grads(model), grads(ref)) > 0.999


def test_under_the_users_autocast_what_the_user_configured_still_raises():
    """The fallback to autocast's program is for graphs amp cannot trace, not for options: an
    unknown op under strict=True raises as it does without autocast."""
    backend = AmpBackend(dtype="bf16", strict=True, inner="aot_eager")
    fn = torch.compile(lambda x, w: torch.special.bessel_j0(x @ w), backend=backend)
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        pytest.raises(Exception, match="AmpPolicyError: unknown op aten.special_bessel_j0"),
    ):
        fn(torch.randn(4, 8), torch.randn(8, 8))
    assert backend.records == []


def test_slowdown_probe_measures_a_ratio():
    factor = amp_compiler.device.slowdown("bf16", torch.device("cpu"), n=64, reps=3)
    assert factor is not None and factor > 0
