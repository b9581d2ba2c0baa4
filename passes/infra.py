"""Pass contract and the tiny runner that records what each pass did."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from amp_compiler.hops import rewritten_bodies
from amp_compiler.options import AmpOptions
from amp_compiler.policy import Policy

log = logging.getLogger("amp_compiler.passes")


@dataclass
class PassContext:
    """What every pass may read: the policy for this graph and its fake mode."""

    policy: Policy
    options: AmpOptions = field(default_factory=AmpOptions)
    fake_mode: object = None
    user_casts: set[str] = field(default_factory=set)
    graph_index: int = 0

    @property
    def low_dtype(self) -> torch.dtype:
        return self.policy.low_dtype


@dataclass
class PassResult:
    modified: bool
    detail: dict = field(default_factory=dict)


@dataclass
class PassRecord:
    name: str
    seconds: float
    nodes_added: int
    nodes_removed: int
    modified: bool
    detail: dict


Pass = Callable[[torch.fx.GraphModule, PassContext], PassResult]


def run_pipeline(gm: torch.fx.GraphModule, ctx: PassContext, pipeline: Sequence[Pass]) -> list[PassRecord]:
    """Run passes in order; record name, time, nodes added/removed, modified.

    Subgraphs the capture marked for rewriting (checkpoint bodies) go through
    the same pipeline first, as graphs of their own whose outputs keep the FP32
    program's dtypes; their records are named ``<body>/<pass>``.
    """
    records = []
    for name, body in rewritten_bodies(gm):
        body_ctx = replace(ctx, user_casts=set(), options=ctx.options.replace(low_precision_outputs=False))
        for rec in run_pipeline(body, body_ctx, pipeline):
            records.append(replace(rec, name=f"{name}/{rec.name}"))
        body.recompile()
    for step, p in enumerate(pipeline):
        before = {id(n) for n in gm.graph.nodes}
        t0 = time.perf_counter()
        result = p(gm, ctx)
        seconds = time.perf_counter() - t0
        after = {id(n) for n in gm.graph.nodes}
        rec = PassRecord(p.__name__, seconds, len(after - before), len(before - after), result.modified, result.detail)
        records.append(rec)
        log.debug(
            "graph %d: %s modified=%s +%d -%d nodes in %.3fs %s",
            ctx.graph_index,
            rec.name,
            rec.modified,
            rec.nodes_added,
            rec.nodes_removed,
            seconds,
            rec.detail,
        )
        if ctx.options.dump_dir:
            os.makedirs(ctx.options.dump_dir, exist_ok=True)
            path = os.path.join(ctx.options.dump_dir, f"graph{ctx.graph_index}_{step}_{rec.name}.txt")
            with open(path, "w") as f:
                f.write(gm.print_readable(print_output=False))
    return records
