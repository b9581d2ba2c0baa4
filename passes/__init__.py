"""The graph passes, in the order that is the spec.

Each pass takes a GraphModule and a PassContext and returns a PassResult; the
pipeline is the list below, run by ``run_pipeline``.
"""

from __future__ import annotations

from .decompose_attention import decompose_attention
from .fold_casts import fold_casts
from .fuse_loss_head import fuse_loss_head
from .infra import PassContext, PassRecord, PassResult, run_pipeline
from .insert_casts import insert_casts
from .place_flexible import place_flexible
from .tag import tag_precision
from .verify import AmpVerifyError, verify_plan

PIPELINE = (decompose_attention, tag_precision, place_flexible, insert_casts, fold_casts, fuse_loss_head, verify_plan)

__all__ = [
    "PIPELINE",
    "AmpVerifyError",
    "decompose_attention",
    "PassContext",
    "PassRecord",
    "PassResult",
    "fold_casts",
    "fuse_loss_head",
    "insert_casts",
    "place_flexible",
    "run_pipeline",
    "tag_precision",
    "verify_plan",
]
