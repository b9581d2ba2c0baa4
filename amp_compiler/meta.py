"""The one metadata key every pass reads and writes: ``node.meta["amp"]``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .policy import Precision

META_KEY = "amp"
# node.meta key on a graph input: whether backward will want a gradient for it (capture.to_aten)
REQUIRES_GRAD = "amp_requires_grad"


@dataclass(slots=True)  # one per node of every planned graph
class NodeInfo:
    """The decision for one node and why.

    orig: output dtype(s) before the rewrite (a dtype, a tuple for multi-output
        nodes, or None for non-tensors); planned: the same after it.
    compute: the dtype every floating input must arrive in (None: no
        requirement, as for PASSTHROUGH).
    boundary: every floating input must arrive in the dtype the FP32 program
        gave it (higher-order ops: their bodies see the program as written).
    casts: names of the casts inserted in front of this node.
    constants: scalar arguments to replace (argument index or name -> value):
        FP32's extreme as a fill becomes the low dtype's extreme.
    placed: a flexible node whose dtype the minimum cut chose (kept on a re-run).
    replaces: the node of the program as written whose value this one computes (a
        rewrite's result: the fused loss head's loss), for side-by-side comparison.
    """

    precision: Precision
    reason: str
    op: str = ""
    module: str = ""
    orig: object = None
    planned: object = None
    compute: torch.dtype | None = None
    region: int = 0
    inserted: bool = False
    boundary: bool = False
    unknown: bool = False
    user_cast: bool = False
    placed: bool = False  # dtype chosen by place_flexible's minimum cut, not by arrival
    casts: list[str] = field(default_factory=list)
    constants: dict = field(default_factory=dict)
    replaces: str = ""


def info(node: torch.fx.Node) -> NodeInfo | None:
    return node.meta.get(META_KEY)


def dtype_name(dtype: object) -> str:
    if isinstance(dtype, torch.dtype):
        return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
            dtype, str(dtype).removeprefix("torch.")
        )
    if isinstance(dtype, (tuple, list)):
        return "(" + ", ".join(dtype_name(d) for d in dtype) + ")"
    return "-"
