"""The plan a user reads: explain(), summary(), to_dict(), the backend's records."""

from __future__ import annotations

import json

import torch
from helpers import ConvNet, TinyLM

import amp_compiler
from amp_compiler.plan import SCHEMA

ids = torch.randint(0, 64, (2, 8))


def test_explain_returns_plan_with_reason_per_node():
    plan = amp_compiler.explain(TinyLM(), ids)
    assert plan.dtype == "bf16" and plan.nodes
    for n in plan.nodes:
        assert n.precision in {"LOW", "FP32", "PROMOTE", "PASSTHROUGH"} and n.reason
        assert n.op.startswith("aten.")
    head = next(n for n in plan.nodes if n.module == "lm_head")
    assert head.precision == "LOW" and head.dtype == "bf16" and len(head.casts) == 2


def test_plan_to_dict_is_json_with_documented_schema():
    d = json.loads(json.dumps(amp_compiler.explain(TinyLM(), ids).to_dict()))
    assert d["schema"] == SCHEMA and d["dtype"] == "bf16"
    assert set(d["nodes"][0]) == {
        "graph",
        "name",
        "op",
        "module",
        "precision",
        "reason",
        "compute_dtype",
        "dtype",
        "casts",
    }
    by_op = {n["op"]: n for n in d["nodes"]}
    assert by_op["aten.linear.default"]["compute_dtype"] == "bf16"
    assert by_op["aten.softmax.int"]["compute_dtype"] == "fp32"
    assert set(d["summary"]) == {"graphs", "nodes", "casts", "cast_bytes", "unknown_ops"}
    assert set(d["casts"][0]) == {"graph", "name", "source", "to", "for", "bytes"}
    assert d["summary"]["casts"] == len(d["casts"])
    assert d["graphs"][0]["dtype_reason"]


def test_plan_summary_counts_match_nodes():
    plan = amp_compiler.explain(TinyLM(), ids)
    s = plan.summary()
    assert sum(s["nodes"].values()) == len(plan.nodes)
    assert s["nodes"]["LOW"] == sum(n.precision == "LOW" for n in plan.nodes)
    assert s["cast_bytes"] == sum(c.bytes for c in plan.casts) > 0
    text = plan.format_table()
    assert "lm_head" in text and "casts inserted" in text.splitlines()[-1]


def test_explain_leaves_model_untouched():
    """explain runs the model once but restores BatchNorm running stats."""
    model = ConvNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = amp_compiler.explain(model, torch.randn(2, 3, 8, 8))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    bn = [n for n in plan.nodes if n.op.startswith("aten.batch_norm")]
    assert bn and all(n.precision == "FP32" for n in bn)
    assert all(n.precision == "LOW" for n in plan.by_op("aten.conv2d"))


def test_backend_records_each_graph():
    backend = amp_compiler.AmpBackend(inner="eager")
    torch.compile(TinyLM(), backend=backend)(ids)
    (rec,) = backend.records
    assert rec.index == 0 and rec.dtype == "bf16" and rec.plan.nodes
    assert [p.name for p in rec.passes] == [
        "decompose_attention",
        "tag_precision",
        "place_flexible",
        "insert_casts",
        "fold_casts",
        "fuse_loss_head",
        "verify_plan",
    ]
    assert isinstance(rec.graph, torch.fx.GraphModule)


def test_backend_keeps_newest_records_only():
    """Long jobs recompile; the backend keeps the newest max_records graphs, indices keep counting."""
    backend = amp_compiler.AmpBackend(inner="eager")
    backend.max_records = 2

    def f(x, w):
        x = torch.softmax(x @ w, -1)
        torch._dynamo.graph_break()
        x = torch.softmax(x @ w, -1)
        torch._dynamo.graph_break()
        return x @ w

    torch.compile(f, backend=backend)(torch.randn(2, 4), torch.randn(4, 4))
    assert backend.compiled == 3
    assert [r.index for r in backend.records] == [1, 2]
