"""What ``AmpCallback`` does to the Trainer around it: take the Trainer's own mixed precision
out of the way, and put every second forward of the model (a reference model, a frozen
teacher) under the policy's plan.

``TrainingArguments(bf16=True)`` / ``fp16=True`` turn on Accelerate's native AMP: an
autocast wrapped around each prepared model's forward (and entered by ``accelerator.autocast()``
in TRL's reference forwards) and, for FP16, a ``GradScaler`` in ``accelerator.backward`` and
the optimizer step. Under amp that would be a second rewrite on top of the plan, so the
flag is read as the dtype request and Accelerate's AMP is switched off before ``train()``
prepares anything.
"""

from __future__ import annotations

import sys

import torch

# attributes of TRL trainers that hold a second model whose forward feeds the loss
SECOND_MODELS = ("ref_model", "teacher_model")


def find_trainer(callback) -> object | None:
    """The ``transformers.Trainer`` whose callbacks include ``callback``, found on the call
    stack of a Trainer event (the events carry the model and optimizer, not the Trainer)."""
    from transformers import Trainer

    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer) and callback in getattr(owner.callback_handler, "callbacks", ()):
            return owner
        frame = frame.f_back
    return None


def without_autocast_wrapper(model: torch.nn.Module) -> None:
    """Undo Accelerate's autocast around a model's forward (``prepare_model`` with native AMP
    keeps the original as ``_original_forward``)."""
    original = vars(model).get("_original_forward")
    if original is not None:
        model.forward = original
        del model._original_forward


def take_over_mixed_precision(trainer) -> None:
    """Switch Accelerate's native AMP off for ``trainer``: no autocast (around forwards or
    from ``accelerator.autocast()``), no GradScaler; amp's plan and loss scaling run instead."""
    accelerator = trainer.accelerator
    accelerator.native_amp = False
    accelerator.scaler = None  # prepare() hands this to the optimizer; backward() scales with it
    for model in (trainer.model, *(getattr(trainer, name, None) for name in SECOND_MODELS)):
        if isinstance(model, torch.nn.Module):
            without_autocast_wrapper(model)


def second_models(trainer) -> dict[str, torch.nn.Module]:
    """The trainer's other models whose forward feeds the loss, by attribute name (none
    without a trainer)."""
    found = {}
    if trainer is None:
        return found
    for name in SECOND_MODELS:
        model = getattr(trainer, name, None)
        if isinstance(model, torch.nn.Module) and model is not trainer.model:
            found[name] = model
    return found


def mirror_checkpointing(model: torch.nn.Module, other: torch.nn.Module) -> None:
    """Checkpoint ``other``'s layers as ``model``'s are (a reference model is a copy of the
    policy, which TRL checkpoints by default): a checkpointed layer is a region of its own in
    the traced graph, whose casts and fusions round differently from the same layer inline,
    so identical weights would give log-probs that differ by ~1e-6 per sequence."""
    theirs = dict(other.named_modules())
    for name, module in model.named_modules():
        twin = theirs.get(name)
        if twin is None or not hasattr(module, "gradient_checkpointing") or not hasattr(twin, "gradient_checkpointing"):
            continue
        twin.gradient_checkpointing = module.gradient_checkpointing
        func = getattr(module, "_gradient_checkpointing_func", None)
        if func is not None:
            twin._gradient_checkpointing_func = func


def as_in_training(forward):
    """``forward`` run the way the policy's training forward runs: with autograd on, outputs
    detached. A no-grad call compiles an inference graph, whose 16-bit kernels (another
    fusion, another matmul layout) round differently from the training graph's: identical
    weights then give log-probs that differ by ~1e-4 nats per sequence. The autograd graph
    built here is dropped with the detached outputs."""

    def run(*args, **kwargs):
        with torch.enable_grad():
            out = forward(*args, **kwargs)
        return _detached(out)

    run.__wrapped__ = forward
    return run


def _detached(out):
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, dict):  # ModelOutput is a dict: keep its type and attributes
        for key, value in out.items():
            out[key] = _detached(value)
        return out
    if isinstance(out, tuple) and not hasattr(out, "_fields"):
        return type(out)(_detached(v) for v in out)
    return out
