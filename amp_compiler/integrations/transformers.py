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
The Trainer's own ``bf16=True`` / ``fp16=True`` (every TRL config's default) are read as
the dtype request: Accelerate's autocast and GradScaler are switched off when the Trainer
is built, so amp's plan (and, for FP16, amp's loss scaling) alone runs; an explicit
``AmpCallback(dtype=...)`` that disagrees with the flag is an error. A second model whose
forward feeds the loss (TRL's ``ref_model``, a distillation teacher) runs under the same
plan as the policy, so identical weights give identical log-probabilities; reference
log-probs precomputed in ``__init__`` (``precompute_ref_log_probs=True``) are computed again
under the plan. ``torch_compile=True`` (a second compile) is refused. Before the first update, a model of
which more than ``max_uncompiled_share`` (default 5%) of the matmul/conv weight elements ran
outside the compiled graphs (as written, in FP32) is refused with the modules and Dynamo's
graph breaks named; nothing is updated. On CPU, freed memory is kept for reuse as
``make_train_step`` keeps it (the ``reuse_cpu_memory`` option; ``callback.memory_reuse``).
"""

from __future__ import annotations

import logging
import weakref

import torch
from transformers import TrainerCallback

from ..coverage import MAX_UNCOMPILED_SHARE
from ..cpu_memory import MemoryReuse, ReuseRule
from ..device import module_device
from ..monitor import NonFiniteMonitor
from ..plan import PrecisionPlan
from ..scaler import nonfinite
from ..training_setup import TrainingSetup
from .trainer_hooks import (
    as_in_training,
    find_trainer,
    mirror_checkpointing,
    second_models,
    take_over_mixed_precision,
    without_autocast_wrapper,
)
from .trl_head import plan_trl_head

log = logging.getLogger("amp_compiler")


class AmpCallback(TrainerCallback):
    """See the module docstring. ``options``: backend options (``fp32_modules``, ...)."""

    def __init__(
        self,
        dtype: str | None = None,
        *,
        config=None,
        monitor: NonFiniteMonitor | None = None,
        max_uncompiled_share: float = MAX_UNCOMPILED_SHARE,
        **options,
    ):
        self.setup = TrainingSetup(
            "AmpCallback", dtype=dtype, config=config, options=options, max_uncompiled_share=max_uncompiled_share
        )
        self._reuse: ReuseRule | None = None
        self.trainer = None
        self.forwards: list[str] = []  # the forwards compiled under the plan
        self._planned = weakref.WeakSet()
        self.monitor = monitor or NonFiniteMonitor()
        self._pending: list[str] = []
        self._plan_logged = False
        self.skipped_steps = 0
        self.monitor.on_alert.append(lambda event: self._pending.append(event.message))

    # what the setup decided, once the Trainer started training
    dtype = property(lambda self: self.setup.dtype)
    reason = property(lambda self: self.setup.reason)
    scaler = property(lambda self: self.setup.scaler)
    backend = property(lambda self: self.setup.backend)

    def plan(self) -> PrecisionPlan:
        if self.backend is None:
            raise RuntimeError("no plan yet: the model compiles at the first training step")
        return self.backend.plan()

    # -- Trainer events

    def on_init_end(self, args, state, control, **kwargs):
        if getattr(args, "torch_compile", False):
            raise ValueError(
                "AmpCallback: TrainingArguments(torch_compile=True) compiles the model a second time with "
                "Inductor; set torch_compile=False: AmpCallback compiles it with the amp backend"
            )
        self.trainer = find_trainer(self)
        flag = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else None
        if flag is None:
            return
        if self.setup.requested not in ("auto", flag):
            raise ValueError(
                f"AmpCallback(dtype={self.setup.requested!r}) disagrees with TrainingArguments({flag}=True): the "
                f"flag asks for {flag}; set the precision in one place"
            )
        if self.trainer is None:
            raise ValueError(
                f"AmpCallback: TrainingArguments({flag}=True) turns on Accelerate's autocast, which AmpCallback "
                f"takes over only inside a transformers.Trainer; set {flag}=False and pass "
                f"AmpCallback(dtype={flag!r})"
            )
        take_over_mixed_precision(self.trainer)
        self.setup.request(flag, f"TrainingArguments({flag}=True)")
        if getattr(args, "precompute_ref_log_probs", False):
            self._plan_precomputed_reference(self.trainer)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            return
        plan_trl_head()  # TRL's fused LM head, traced as plain ops into the plan
        self._plan_forward(model)
        self._reuse = self.setup.reuse_rule()
        for name, other in second_models(self.trainer).items():
            self._plan_forward(other, name)
        log.info("AmpCallback: %s (%s); forwards under the plan: %s", self.dtype, self.reason, ", ".join(self.forwards))

    def _plan_forward(self, module: torch.nn.Module, name: str = "model") -> None:
        """Compile ``module``'s forward with the backend (once). The trained model's comes first:
        it resolves the dtype and, under FP16, gets the loss scaling hooks."""
        if module in self._planned:
            return
        # every rank reaches train begin together: the ranks agree here, before any step
        self.setup.start(module)
        without_autocast_wrapper(module)
        self.setup.compile(module)
        forward = module.forward
        if name == "model" and self.dtype == "fp16":
            self.scaler._lazy_init_scale_growth_tracker(module_device(module))  # the hooks read its tensor
            self._install_scaling(module)
            forward = self._scaled(forward)
        if name != "model":
            if self.trainer is not None:
                mirror_checkpointing(self.trainer.model, module)
            # the training graph's kernels, not an inference graph's: parameters must ask for
            # gradients for autograd to build it (none is ever computed: outputs are detached)
            for p in module.parameters():
                p.requires_grad_(True)
            forward = as_in_training(forward)
        module.forward = forward
        self._planned.add(module)
        self.forwards.append(name)

    def _plan_precomputed_reference(self, trainer) -> None:
        """TRL computes reference log-probs once, in ``__init__`` after this event: the
        reference forward then runs under the plan too, and the cache TRL keeps them in is
        keyed apart from log-probs computed without it."""
        precompute = getattr(trainer, "_precompute_ref_logps", None)
        if precompute is None:
            raise ValueError(
                f"AmpCallback: precompute_ref_log_probs=True with {type(trainer).__name__}, whose precomputed "
                "reference log-probs AmpCallback cannot put under the plan; set precompute_ref_log_probs=False "
                "(the reference forward then runs under the plan at each step)"
            )

        def planned(dataset, name, batch_size):
            plan_trl_head()  # as in training: the precomputed log-probs are TRL's head's under the plan too
            reference = trainer.ref_model or trainer.model
            self._plan_forward(reference, "model" if reference is trainer.model else "ref_model")
            if not str(trainer._precompute_model_hash).endswith(f"-amp-{self.dtype}"):
                trainer._precompute_model_hash = f"{trainer._precompute_model_hash}-amp-{self.dtype}"
            policy_forward = trainer.model.forward
            if reference is trainer.model:  # the policy's own forward, as it runs in training
                trainer.model.forward = as_in_training(policy_forward)
            try:
                out = precompute(dataset, name, batch_size)
            finally:
                trainer.model.forward = policy_forward
            if "precomputed reference log-probs" not in self.forwards:
                self.forwards.append("precomputed reference log-probs")
            return out

        trainer._precompute_ref_logps = planned

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if self.backend is not None:  # before the first update, on every rank: nothing is lost
            self.setup.before_first_update(model)
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

    @property
    def memory_reuse(self) -> MemoryReuse | None:
        """Whether freed CPU memory is kept for reuse, and why (the ``reuse_cpu_memory`` option)."""
        return None if self._reuse is None else self._reuse.decision

    def on_step_begin(self, args, state, control, **kwargs):
        if self._reuse is not None:
            self._reuse.tick()

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
            summary = f"{plan.format_summary()} ({self.reason})" if applied else plan.format_summary()
            extra["amp_plan"] = f"{summary}; forwards under the plan: {', '.join(self.forwards)}"
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
