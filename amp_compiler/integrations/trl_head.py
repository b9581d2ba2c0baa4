"""TRL's fused LM head under amp's plan.

TRL (>= 1.16) trainers compute per-token log-probs through ``add_fused_lm_head``: an autograd
Function (``ChunkedLogProbFunction``) that projects in tiles with ``torch.mm(..., out=)`` and
folds each tile into online statistics. Dynamo cannot trace it (``out=`` into a view, a
generator), so the LM head ran eagerly in FP32 outside every graph. While Dynamo traces a
forward, the Function is replaced by the same statistics written traceably: the vocabulary
projection joins the plan (16 bit) and the statistics are amp's own op on the logits
(``amp::logits_stats``: FP32 inside, one generated kernel, no FP32 copy of the logits), which
amp's loss-head pass turns into its blocked head op (``amp::head_stats``: the logits never
whole, as in TRL's tiles) where ``loss_head`` fuses. Called outside a compile, TRL's own
Function runs unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from amp_compiler.loss_head import NO_IGNORE

# TRL's outputs -> amp's statistics (log-probs and the mean logit come from the loss's own)
_EXTRAS = {"entropy": "entropy", "log_sum_sq_probs": "log_sum_sq", "is_top1": "top1"}


def log_prob_statistics(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    chunk_size: int,
    final_logit_softcapping: float | None = None,
    logit_scale: float = 1.0,
    outputs: tuple[str, ...] = (),
):
    """What ``ChunkedLogProbFunction.apply`` returns (log-probs, entropy, log of the sum of
    squared probabilities, mean logit, whether the target is the first argmax; ``None`` for
    what ``outputs`` does not ask for), traceably. ``chunk_size`` is TRL's tiling: the
    plan does its own."""
    del chunk_size
    z = F.linear(hidden, weight, bias) * logit_scale
    if final_logit_softcapping is not None:
        z = final_logit_softcapping * torch.tanh(z / final_logit_softcapping)
    z = z / temperature
    extras = ",".join(amp for trl, amp in _EXTRAS.items() if trl in outputs)
    mean = "mean_logits" in outputs
    picked, lse, total, entropy, log_sum_sq, top1 = torch.ops.amp.logits_stats(z, targets, "", NO_IGNORE, mean, extras)
    return (
        picked - lse,
        entropy if "entropy" in outputs else None,
        log_sum_sq.detach() if "log_sum_sq_probs" in outputs else None,  # TRL marks these non-differentiable
        (total / z.shape[-1]).detach() if mean else None,
        top1 if "is_top1" in outputs else None,
    )


def plan_trl_head() -> bool:
    """Route TRL's fused head through ``log_prob_statistics`` while Dynamo traces (once per
    process; TRL's Function runs unchanged outside a compile). False where TRL is not
    installed or has no fused head."""
    try:
        from trl.trainer import utils
    except ImportError:
        return False
    original = getattr(utils, "_ChunkedLogProbFunction", None)
    if original is None:
        return False
    if getattr(original, "amp_planned", False):
        return True

    class PlannedChunkedLogProb:
        amp_planned = True
        wrapped = original

        @staticmethod
        def apply(*args):
            if torch.compiler.is_compiling():
                return log_prob_statistics(*args)
            return original.apply(*args)

    utils._ChunkedLogProbFunction = PlannedChunkedLogProb
    return True
