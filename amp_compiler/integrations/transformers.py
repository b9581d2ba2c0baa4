"""``AmpCallback``: the amp backend inside a Hugging Face ``Trainer`` (and its subclasses).

    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                      callbacks=[AmpCallback()])          # dtype="auto", or config="ds.json"
    trainer.train()

Before the first step it compiles the model's forward with the amp backend; the plan
summary, the loss scale and every Inf/NaN alert go into the Trainer's logs.
``torch_compile_backend="amp"`` cannot work: Accelerate validates the name against a
closed enum of backends before any of our code runs.

FP16 gets amp's own dynamic loss scaling, Trainer-agnostic: a hook on the loss the
forward returns multiplies the gradient entering backward by the scale, a hook on each
parameter divides it out as it is accumulated (so the Trainer's clipping and its
optimizer see true gradients), and before the optimizer step (after clipping) one
finite check decides: Inf/NaN drops this step's gradients (the optimizer leaves those
parameters and their state untouched), backs the scale off and holds the Trainer's LR
scheduler for that step, as the Trainer's own fp16 does. Under BF16 nothing is scaled.
The Trainer's own ``bf16=True`` / ``fp16=True`` (its autocast on top of our casts) and
``torch_compile=True`` (a second compile) are refused when the Trainer is built, naming
the flag.
"""

from __future__ import annotations

import logging

import torch
from transformers import TrainerCallback

from ..backend import AmpBackend
from ..config import AmpConfig, merge
from ..device import resolve_dtype
from ..monitor import NonFiniteMonitor
from ..plan import PrecisionPlan
from ..scaler import LossScaler, nonfinite

log = logging.getLogger("amp_compiler")


class AmpCallback(TrainerCallback):
    """See the module docstring. ``options``: backend options (``fp32_modules``, ...)."""

    def __init__(self, dtype: str | None = None, *, config=None, monitor: NonFiniteMonitor | None = None, **options):
        self.config = AmpConfig.load(config)
        self.requested = merge(dtype, self.config.dtype, "dtype", "auto")
        self.options = {**self.config.options, **options}
        self.monitor = monitor or NonFiniteMonitor()
        self.backend: AmpBackend | None = None
        self.scaler: LossScaler | None = None
        self.dtype = self.reason = None
        self._pending: list[str] = []
        self._plan_logged = False
        self._compile_checked = False
        self.skipped_steps = 0
        self.monitor.on_alert.append(lambda event: self._pending.append(event.message))

    def plan(self) -> PrecisionPlan:
        if self.backend is None:
            raise RuntimeError("no plan yet: the model compiles at the first training step")
        return self.backend.plan()

    # -- Trainer events

    def on_init_end(self, args, state, control, **kwargs):
        for flag, why in (
            ("bf16", "adds the Trainer's torch.autocast on top of amp's casts"),
            ("fp16", "adds the Trainer's autocast and GradScaler on top of amp's casts and loss scaling"),
            ("torch_compile", "compiles the model a second time with Inductor"),
        ):
            if getattr(args, flag, False):
                raise ValueError(
                    f"AmpCallback: TrainingArguments({flag}=True) {why}; set {flag}=False "
                    f"and let AmpCallback choose the precision (dtype='auto', 'bf16' or "
                    f"'fp16')"
                )

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None or self.backend is not None:
            return
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        low = {p.dtype for p in model.parameters() if p.is_floating_point() and p.dtype != torch.float32}
        if low:
            raise ValueError(
                f"AmpCallback: the model's parameters are {sorted(map(str, low))}; amp keeps "
                "FP32 master weights: load the model in float32 (torch_dtype=torch.float32)"
            )
        self.dtype, self.reason = resolve_dtype(self.requested, device)
        self.backend = AmpBackend(self.options, dtype=self.dtype)
        self.backend.decided = (self.dtype, self.reason)  # the plan states why, not "requested"
        forward = torch.compile(model.forward, backend=self.backend)
        if self.dtype == "fp16":
            self.scaler = self.config.scaler(device.type) or LossScaler(device.type)
            self.scaler._lazy_init_scale_growth_tracker(device)  # the hooks read its tensor
            self._install_scaling(model)
            model.forward = self._scaled(forward)
        else:
            model.forward = forward
        log.info("AmpCallback: %s (%s)", self.dtype, self.reason)

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if not self._compile_checked and self.backend is not None:
            self._compile_checked = True  # before the first update: nothing is lost
            why = self.backend.coverage.model_not_compiled()
            if why is not None:
                raise RuntimeError(why)
            self.backend.coverage.warn_parameters_outside(model)
        if self.scaler is None:
            return
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        found = nonfinite(grads, self.scaler._scale.device)
        skipped, before, after = self.scaler.update_outside_step(optimizer, found)
        if skipped:  # parameters without a gradient are left alone by every torch optimizer
            self.skipped_steps += 1
            for p in model.parameters():
                p.grad = None
            _hold_once(lr_scheduler)
        self.monitor.observe(skipped, scale_before=before, scale_after=after, scaler=self.scaler, dtype=self.dtype)

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        _release(lr_scheduler)  # a hold the Trainer did not use (a scheduler it steps on metrics)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or self.backend is None:
            return
        extra = {}
        if not self._plan_logged and self.backend.records:
            plan = self.plan()
            # a plan not applied (FP32) states its reason in its own summary
            applied = any(g.applied for g in plan.graphs)
            extra["amp_plan"] = f"{plan.format_summary()} ({self.reason})" if applied else plan.format_summary()
            self._plan_logged = True
        if self.scaler is not None:
            extra["amp_loss_scale"] = self.scaler.get_scale()
            extra["amp_skipped_steps"] = self.skipped_steps
        if self._pending:
            extra["amp_alert"] = " | ".join(self._pending)
            self._pending.clear()
        logs.update(extra)  # what the reporting integrations see
        history = getattr(state, "log_history", None)
        if history:  # the Trainer recorded this entry before calling us
            history[-1].update(extra)

    # -- FP16 loss scaling through hooks

    def _install_scaling(self, model) -> None:
        scaler = self.scaler

        def unscale(grad):
            return grad / scaler._scale.to(grad.dtype) if scaler.is_enabled() else grad

        for p in model.parameters():
            if p.requires_grad:
                p.register_hook(unscale)

    def _scaled(self, forward):
        scaler = self.scaler

        def run(*args, **kwargs):
            out = forward(*args, **kwargs)
            loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
            if isinstance(loss, torch.Tensor) and loss.requires_grad:
                loss.register_hook(lambda g: g * scaler._scale.to(g.dtype))
            return out

        return run


def _hold_once(scheduler) -> None:
    """The next ``scheduler.step()`` does nothing. The Trainer steps its LR scheduler after
    every optimizer step Accelerate did not see skipped, and Accelerate sees only its own
    scaler: without this, each step amp dropped would still advance the schedule (warm-up
    and decay shifted by the number of dropped steps), unlike the Trainer's own fp16."""
    if scheduler is None or "step" in vars(scheduler):
        return

    def held(*args, **kwargs):
        _release(scheduler)

    scheduler.step = held


def _release(scheduler) -> None:
    if scheduler is not None and "step" in vars(scheduler):
        del scheduler.step
