"""Joint-graph pass: the fused loss head's ops run once, in forward.

Under a memory budget below 1 (amp's default: 0.8) the partitioner may recompute in backward
ops outside its allowlist where that saves bytes. For ``amp::head_stats`` that is the head's
projection again and, for the one-pass head, its gradient GEMMs too (three GEMMs a block
where backward needed none): it happened to a small head (8192 x 32, 128 tokens) whose FP32
weight gradient outweighed the other activations. ``amp::logits_stats`` recomputed would
read the kept logits once more. Their outputs are per-token statistics and the gradients
backward reads anyway, so each is marked MUST_SAVE: computed in forward, its outputs saved.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy

import amp_compiler.loss_head  # noqa: F401  (registers the ops)

HEAD_OPS = (torch.ops.amp.head_stats.default, torch.ops.amp.logits_stats.default)


def keep_head_stats(graph: torch.fx.Graph) -> int:
    """Mark the loss head's ops MUST_SAVE (never recomputed in backward); returns how many."""
    done = 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target in HEAD_OPS:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            done += 1
    return done
