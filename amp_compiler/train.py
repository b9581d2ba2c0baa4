"""``make_train_step``: the design note's three rules as one object a training loop calls.

FP32 master weights (the optimizer updates the FP32 parameters; the model
computes through the amp backend's casts), loss scaling for FP16 (none for
BF16), the allow/deny lists (the backend's policy). Each call runs:

    forward and loss (compiled together, amp) -> loss in FP32 -> scaled backward
    -> [every grad_accum calls] unscale -> finite check -> optional clipping
    -> optimizer step on the FP32 master parameters, or a skip
    -> scale update -> scheduler step (only if the optimizer stepped)
    -> Inf/NaN monitor

and returns ``StepResult(loss, skipped, scale, grad_norm)``. For Adam, AdamW and
SGD everything after backward runs on the device as PyTorch's fused optimizer
kernels (``optim.FusedUpdate``: norm, Inf/NaN check, unscale, clip, update; the
skip is decided on the device) followed by the scale update, and the one host
synchronisation per optimizer step reads skipped / scale before / scale after
together; accumulation micro-steps synchronise nothing. Other optimizers run
their own ``step()`` behind GradScaler's finite check.

The loss is compiled into the model's graph (``compile_loss=True``, a plain model):
Inductor then fuses the cast of the 16-bit logits into log-softmax, the loss and
their backward, instead of eager kernels writing FP32 logits, log-probabilities and
their gradient (each tokens x vocabulary x 4 bytes) one after the other. A loss
Dynamo cannot trace graph-breaks and runs as written; the forward stays compiled.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .coverage import MAX_UNCOMPILED_SHARE
from .cpu_memory import MemoryReuse
from .device import module_device
from .distributed import any_rank, install_comm_hook
from .ds_config import AmpConfig, merge
from .monitor import NonFiniteMonitor
from .optim import FusedUpdate, unsupported
from .scaler import LossScaler, nonfinite
from .training_setup import MasterWeightsError, TrainingSetup
from .upstream.torch_private import private

log = logging.getLogger("amp_compiler")


__all__ = ["MasterWeightsError", "StepResult", "TrainStep", "make_train_step"]


@dataclass(frozen=True)
class StepResult:
    loss: torch.Tensor  # FP32, detached, unscaled (the micro-batch's loss)
    skipped: bool  # the optimizer step was skipped (Inf/NaN gradients)
    scale: float  # loss scale used for this step (1.0 under BF16)
    grad_norm: torch.Tensor | None  # total gradient norm before clipping; None between accumulation steps
    stepped: bool = True  # False on accumulation micro-steps and on skips


class TrainStep:
    """Built by ``make_train_step``; call it with a batch: ``step(inputs, *targets)``.

    ``inputs`` is a tensor, a tuple (splatted into the model) or a dict (keywords);
    the loss is ``loss_fn(model_output, *targets)``.
    """

    def __init__(
        self,
        model,
        optimizer,
        loss_fn,
        *,
        setup: TrainingSetup,
        monitor,
        max_grad_norm,
        grad_accum,
        lr_scheduler,
        fused=None,
        compile_loss=True,
    ):
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.setup, self.backend = setup, setup.backend
        self.dtype, self.dtype_reason = setup.dtype, setup.reason
        # the step reads the scale either way; disabled (a no-op) unless FP16
        self.scaler = setup.scaler or LossScaler(setup.device.type, dtype=setup.dtype)
        self.monitor = monitor
        self.max_grad_norm, self.grad_accum, self.lr_scheduler = max_grad_norm, grad_accum, lr_scheduler
        self.max_uncompiled_share = setup.max_uncompiled_share
        self.compiled = setup.compile(model, whole=True)
        # DDP and FSDP2 compile the forwards inside their wrappers: the loss stays outside
        joint = compile_loss and isinstance(self.compiled, private("torch._dynamo.eval_frame.OptimizedModule"))
        self._forward_loss = torch.compile(_own_code(_forward_loss), backend=self.backend) if joint else None
        if joint and self.backend.options.low_precision_outputs:
            log.warning(
                "amp: low_precision_outputs has no effect here: the compiled graph returns "
                "the loss, which stays FP32; pass compile_loss=False to have the model's "
                "outputs returned in 16 bit"
            )
        self.micro_step = 0
        self.plan_fingerprint: str | None = None  # set after the first compile, equal on all ranks
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        self._last_scale = self.scaler.get_scale() if self.scaler.is_enabled() else 1.0
        self._batch = self._offending = None  # the offending batch: the last one skipped
        if monitor is not None and monitor.explain is None:
            monitor.explain = self._explain_alert
        self.fused = fused  # FusedUpdate, or None: the optimizer's own step()
        self.comm = None  # CommStats when gradients are all-reduced through our DDP hook
        self._one = torch.ones((), device=self._params[0].device) if self._params else None
        self._reuse = setup.reuse_rule(at=grad_accum)

    @property
    def memory_reuse(self) -> MemoryReuse | None:
        """Whether freed CPU memory is kept for reuse, and why (the ``reuse_cpu_memory``
        option); None until the step after the first update has been measured."""
        return self._reuse.decision

    def __call__(self, inputs: Any, *targets: Any) -> StepResult:
        self._reuse.tick()
        self._batch = inputs
        loss = self.loss(inputs, *targets)
        first = self.plan_fingerprint is None  # this process's first step (also after a resume)
        if first:
            self.plan_fingerprint = self.setup.check_plan()
        loss = loss.float()
        self.scaler.scale(loss / self.grad_accum).backward()
        if first:  # the first backward shows which parameters the model used; nothing is updated yet
            if any(p.requires_grad for p in self._params):
                self.setup.check_coverage(self.model)
        self.micro_step += 1
        if self.micro_step % self.grad_accum:
            # no sync between accumulation steps: report the scale known at the last step
            return StepResult(loss.detach(), False, self._last_scale, None, stepped=False)
        if self.fused is not None:
            return self._fused_step(loss.detach())
        scale = self.scaler.get_scale() if self.scaler.is_enabled() else 1.0
        return self._optimizer_step(loss.detach(), scale)

    def loss(self, inputs: Any, *targets: Any) -> torch.Tensor:
        """The loss of a batch as the step computes it (the same compiled program), without
        backward or update: e.g. a validation loss under the training plan."""
        with self.backend.tracing():
            if self._forward_loss is not None:
                return self._forward_loss(self.compiled, self.loss_fn, inputs, targets)
            return self.loss_fn(_forward(self.compiled, inputs), *targets)

    def _fused_step(self, loss: torch.Tensor) -> StepResult:
        """Unscale, check, clip, update (or skip) and the scale update all on the device;
        one host synchronisation reads what happened."""
        scaler = self.scaler
        if scaler.is_enabled():
            found, grad_norm = self.fused(scaler._scale)
            skipped, scale, scale_after = scaler.update_outside_step(self.optimizer, found)
        else:
            found, grad_norm = self.fused(self._one)
            skipped, scale, scale_after = bool(found.item()), 1.0, None  # the one sync
        if not skipped:
            self.optimizer._opt_called = True  # what optimizer.step() tells an LR scheduler
        return self._after_step(loss, skipped, scale, scale_after, grad_norm)

    def _optimizer_step(self, loss: torch.Tensor, scale: float) -> StepResult:
        scaler = self.scaler
        if scaler.is_enabled():
            scaler.unscale_(self.optimizer)
        else:
            self._check_finite_unscaled()
        grad_norm = self._grad_norm()
        if scaler.is_enabled():
            scaler.step(self.optimizer)
            skipped = bool(scaler.last_step_skipped)
            scaler.update()
            scale_after = scaler.get_scale()
        else:
            skipped = self._found_inf
            if not skipped:
                self.optimizer.step()
            scale_after = None
        return self._after_step(loss, skipped, scale, scale_after, grad_norm)

    def _after_step(self, loss, skipped: bool, scale: float, scale_after: float | None, grad_norm) -> StepResult:
        if skipped:
            self._offending = self._batch
        if not skipped and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        self.skipped_steps += skipped
        enabled = self.scaler.is_enabled()
        event = None
        if self.monitor is not None:
            event = self.monitor.observe(
                skipped,
                scale_before=scale if enabled else None,
                scale_after=scale_after,
                scaler=self.scaler,
                dtype=self.dtype,
            )
        # scale for the next micro-steps: the update's, or the monitor's lower one after an alert
        if not enabled:
            self._last_scale = 1.0
        elif event is not None and event.scale_after is not None:
            self._last_scale = event.scale_after
        else:
            self._last_scale = scale_after
        return StepResult(loss, skipped, scale, grad_norm, stepped=not skipped)

    def _explain_alert(self, event):
        """After an alert only: replay the offending batch FP32 vs amp, node by node; name
        the first node whose output is Inf/NaN and the pin that would keep it FP32."""
        import dataclasses

        from .compare import pin_of, run_side_by_side

        if self._offending is None:
            return event
        batch = self._offending
        args, kwargs = _arguments(batch)
        # the training step's own options (every override and pin), without its graph dumps
        run = run_side_by_side(self.model, args, kwargs, self.dtype, self.backend.options.replace(dump_dir=None))
        bad = run.first_nonfinite
        if bad is None:
            note = (
                "; the forward pass is finite on the offending batch: the overflow is in "
                "backward (loss scale) or in the data"
            )
            return dataclasses.replace(event, message=event.message + note)
        option, pattern = pin_of(bad)
        where = f"node '{bad.name}' ({bad.op}){' in module ' + repr(bad.module) if bad.module else ''}"
        note = f"; first Inf/NaN at {where}: suggested pin {option}=[{pattern!r}]"
        return dataclasses.replace(
            event, message=event.message + note, first_nonfinite=where, suggested_pin={option: [pattern]}
        )

    def _check_finite_unscaled(self) -> None:
        """BF16: no scaler, but a step with Inf/NaN gradients is still skipped, on every rank
        (sharded gradients: an Inf in one rank's shard is that rank's alone until reduced)."""
        grads = [_local(p.grad) for p in self._params if p.grad is not None]
        found = nonfinite(grads, grads[0].device if grads else "cpu")
        self._found_inf = bool(any_rank(found).item())

    def _grad_norm(self) -> torch.Tensor:
        params = [p for p in self._params if p.grad is not None]
        if self.max_grad_norm is not None:
            return torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        return torch.nn.utils.get_total_norm([p.grad for p in params])

    def state_dict(self) -> dict:
        """Scaler, monitor and counters (save model/optimizer/scheduler states beside it)."""
        return {
            "dtype": self.dtype,
            "scaler": self.scaler.state_dict(),
            "monitor": self.monitor.state_dict() if self.monitor is not None else None,
            "micro_step": self.micro_step,
            "optimizer_steps": self.optimizer_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["dtype"] != self.dtype:
            raise ValueError(
                f"checkpoint was trained in {state['dtype']}, this step runs {self.dtype}: "
                f"pass dtype={state['dtype']!r} to make_train_step to resume it"
            )
        self.scaler.load_state_dict(state["scaler"])
        if self.monitor is not None and state["monitor"] is not None:
            self.monitor.load_state_dict(state["monitor"])
        self.micro_step = state["micro_step"]
        self.optimizer_steps, self.skipped_steps = state["optimizer_steps"], state["skipped_steps"]


def make_train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[..., torch.Tensor],
    *,
    dtype: str | None = None,
    scaler: LossScaler | None = None,
    monitor: NonFiniteMonitor | None = None,
    max_grad_norm: float | None = None,
    grad_accum: int | None = None,
    lr_scheduler=None,
    compile_options: dict | None = None,
    fused_update: bool | None = None,
    config=None,
    ddp_comm_dtype: str | None = None,
    compile_loss: bool = True,
    max_uncompiled_share: float = MAX_UNCOMPILED_SHARE,
) -> TrainStep:
    """Build a ``TrainStep`` (see the module docstring).

    ``dtype``: "auto" (the default: what the device runs fast: BF16, else FP16 with loss
    scaling, else FP32 without a scaler), "bf16", "fp16" or "fp32".
    ``config``: a DeepSpeed-style dict or JSON path (``amp_compiler.ds_config``) giving the
    dtype, the FP16 scaler, the policy ("amp" section), clipping and accumulation; an
    argument given here as well must agree with it; ``compile_options`` win over its "amp"
    section.
    ``fused_update``: None (default) runs norm/check/unscale/clip/update on the device
    with PyTorch's fused kernels for Adam, AdamW and SGD (``optim.FusedUpdate``) and
    ``optimizer.step()`` for any other optimizer;
    True requires it, False always uses ``optimizer.step()``.
    ``ddp_comm_dtype``: "bf16"/"fp16" all-reduces a DDP model's gradients in 16 bit
    (PyTorch's compress hooks; ``step.comm`` counts the bytes); the update stays FP32.
    ``compile_loss``: True (default) compiles ``loss_fn`` into the model's graph (planned
    like the model: the loss runs in FP32); False runs it as written on the compiled
    model's output. DDP and FSDP2 models always run it as written.
    ``max_uncompiled_share``: the first step refuses (``UncompiledModelError``, nothing
    updated) a model of which more than this share of the matmul/conv weight elements ran
    outside the compiled graphs, as written in FP32 (0: refuse any).
    On CPU, freed memory is kept for reuse where a step maps large blocks afresh (the
    ``reuse_cpu_memory`` compile option); ``step.memory_reuse`` says what was decided and why.
    """
    cfg = AmpConfig.load(config)
    max_grad_norm = merge(max_grad_norm, cfg.max_grad_norm, "max_grad_norm")
    grad_accum = merge(grad_accum, cfg.grad_accum, "grad_accum", 1)
    if not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"grad_accum must be an int >= 1, got {grad_accum!r}")
    setup = TrainingSetup(
        "make_train_step",
        dtype=dtype,
        config=cfg,
        options=compile_options,
        scaler=scaler,
        max_uncompiled_share=max_uncompiled_share,
    )
    setup.start(model, module_device(model))
    fused = _fused_update(optimizer, max_grad_norm, fused_update)
    comm = install_comm_hook(model, ddp_comm_dtype) if ddp_comm_dtype else None
    step = TrainStep(
        model,
        optimizer,
        loss_fn,
        setup=setup,
        monitor=monitor or NonFiniteMonitor(),
        max_grad_norm=max_grad_norm,
        grad_accum=grad_accum,
        lr_scheduler=lr_scheduler,
        fused=fused,
        compile_loss=compile_loss,
    )
    step.comm = comm
    return step


def _arguments(inputs) -> tuple[tuple, dict]:
    """A batch as the model's (args, kwargs): a dict is keywords, a tuple is splatted."""
    if isinstance(inputs, dict):
        return (), inputs
    return (inputs if isinstance(inputs, tuple) else (inputs,)), {}


def _forward(model, inputs):
    args, kwargs = _arguments(inputs)
    return model(*args, **kwargs)


def _forward_loss(model, loss_fn, inputs, targets):
    # ``model`` is the compiled module: Dynamo inlines it here, and should this frame
    # ever run as written (a recompile limit), its call still runs amp's graph.
    return loss_fn(_forward(model, inputs), *targets)


def _own_code(fn):
    """``fn`` with a code object of its own. Dynamo keeps compiled code per code object and
    recompiles for each new backend: shared, the eighth training step built in a process
    would hit the recompile limit and run its loss as written."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _fused_update(optimizer, max_grad_norm, wanted: bool | None) -> FusedUpdate | None:
    if wanted is False:
        return None
    why = unsupported(optimizer)
    if why:
        if wanted:
            raise ValueError(
                f"fused_update=True: {why}; pass fused_update=None to fall back to the optimizer's own step()"
            )
        log.info("amp training step: optimizer.step() (%s)", why)
        return None
    return FusedUpdate(optimizer, max_grad_norm)
