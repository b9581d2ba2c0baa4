"""``AmpPrecision``: amp as a Lightning precision plugin.

    trainer = lightning.pytorch.Trainer(plugins=[AmpPrecision()])   # dtype="auto"; or "bf16", "fp16"
    fabric = lightning.fabric.Fabric(plugins=[AmpFabricPrecision()])

When the strategy sets the module up, its ``forward`` and each child module's are compiled
with the amp backend (a ``training_step`` calling ``self.encoder(x)`` runs planned); no
``torch.autocast`` is entered around steps (the plan decides every op). FP16 gets amp's
``LossScaler`` (a ``GradScaler`` subclass, so Lightning's scaling, unscaling before clipping,
skipped steps and checkpointing of the scaler apply) and the Inf/NaN monitor, whose alerts
go to the Python logger and whose scale and skipped-step counts go to the Trainer's logger.
The first optimizer step refuses, before anything is updated, a module of which more than
``max_uncompiled_share`` (default 5%) of the matmul/conv weight elements ran outside the
compiled graphs (as written, in FP32), naming the modules and Dynamo's graph breaks.
On CPU, freed memory is kept for reuse as ``make_train_step`` keeps it (the
``reuse_cpu_memory`` option; ``plugin.memory_reuse`` says why).

Lightning refuses ``precision=`` beside a precision plugin ("Received both precision=... and
plugins=..."): give the dtype to ``AmpPrecision`` instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.pytorch.plugins.precision import MixedPrecision

from ..coverage import MAX_UNCOMPILED_SHARE
from ..cpu_memory import MemoryReuse, ReuseRule
from ..monitor import NonFiniteMonitor
from ..plan import PrecisionPlan
from ..training_setup import TrainingSetup

LIGHTNING_PRECISION = {"bf16": "bf16-mixed", "fp16": "16-mixed", "fp32": "32-true"}


class _AmpPlugin:
    """What both plugins do the same way: one ``TrainingSetup`` (resolved when built, agreed by
    every rank when the strategy sets the module up), no autocast, the plan shown."""

    setup: TrainingSetup
    _reuse: ReuseRule

    def _set_up(self, dtype, device, config, options, max_uncompiled_share) -> tuple[str, Any]:
        """The setup resolved for ``device``; returns (device, FP16's scaler or None)."""
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.setup = TrainingSetup(
            type(self).__name__, dtype=dtype, config=config, options=options, max_uncompiled_share=max_uncompiled_share
        ).resolve(device)
        self._reuse = self.setup.reuse_rule()
        return device, self.setup.scaler

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dtype={self.dtype!r})"

    dtype = property(lambda self: self.setup.dtype)
    reason = property(lambda self: self.setup.reason)
    backend = property(lambda self: self.setup.backend)  # None until the module is set up
    max_uncompiled_share = property(lambda self: self.setup.max_uncompiled_share)

    def plan(self) -> PrecisionPlan:
        if self.backend is None:
            raise RuntimeError(f"{type(self).__name__}: no plan yet: the module compiles when the strategy sets it up")
        return self.backend.plan()

    @property
    def memory_reuse(self) -> MemoryReuse | None:
        """Whether freed CPU memory is kept for reuse, and why (the ``reuse_cpu_memory``
        option); None until the step after the first update has been measured."""
        return self._reuse.decision

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Every rank agrees on the precision (the strategy calls this on each, with the
        process group up), then the module's ``forward`` and each child's holding parameters
        are compiled: a ``training_step`` (or a Fabric loop) that calls ``self.encoder(x)``
        rather than ``self(x)`` runs planned too; a forward that calls its children traces
        them into its own graph."""
        before = self.dtype
        self.setup.start(module)
        if self.dtype != before:  # dtype="auto" on a mixed fleet: the weakest rank's choice
            self.scaler = self.setup.scaler
            self.precision = LIGHTNING_PRECISION[self.dtype]
        self.setup.compile(module, children=True)
        self._module = module
        return module

    def _enforce(self, model) -> None:
        """Before the first update, on every rank: one plan everywhere, and not too much of
        the module ran outside the compiled graphs."""
        self.setup.before_first_update(model)

    def forward_context(self):
        return contextlib.nullcontext()  # the plan, not autocast, decides each op's precision


class AmpPrecision(_AmpPlugin, MixedPrecision):
    """See the module docstring. ``dtype``: "auto" (what the device runs fast), "bf16", "fp16"
    or "fp32"; ``device``: where training runs ("cuda" if available, else "cpu"), for "auto";
    ``options``: backend options (``fp32_modules``, ...); ``config``: a DeepSpeed-style config."""

    def __init__(self, dtype: str | None = None, *, device: str | None = None, config=None,
                 monitor: NonFiniteMonitor | None = None, max_uncompiled_share: float = MAX_UNCOMPILED_SHARE,
                 **options: Any) -> None:  # fmt: skip
        device, scaler = self._set_up(dtype, device, config, options, max_uncompiled_share)
        # MixedPrecision knows only its two mixed modes; FP32 (the plan recorded, not applied)
        # takes its no-scaler path and then says what it is
        super().__init__(precision="16-mixed" if scaler else "bf16-mixed", device=device, scaler=scaler)
        self.precision = LIGHTNING_PRECISION[self.dtype]
        self.monitor = monitor or NonFiniteMonitor()
        self.skipped_steps = 0

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        self._reuse.tick()  # forward and backward run inside: one tick a step

        def checked():  # after forward and backward, before the update
            out = closure()
            self._enforce(model)
            return out

        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=checked, **kwargs)
        before = self.scaler.get_scale()
        out = super().optimizer_step(optimizer, model=model, closure=checked, **kwargs)
        after = self.scaler.get_scale()
        skipped = bool(self.scaler.last_step_skipped)
        self.skipped_steps += skipped
        self.monitor.observe(skipped, scale_before=before, scale_after=after, scaler=self.scaler, dtype=self.dtype)
        logger = getattr(getattr(model, "trainer", None), "logger", None)
        if logger is not None:
            step = model.trainer.global_step
            logger.log_metrics({"amp_loss_scale": after, "amp_skipped_steps": self.skipped_steps}, step=step)
        return out


class AmpFabricPrecision(_AmpPlugin, FabricMixedPrecision):
    """``AmpPrecision`` for ``lightning.fabric.Fabric(plugins=[...])``: ``fabric.setup(model)``
    compiles the model's forward with the amp backend; no autocast, inputs and outputs left as
    they are (the plan casts); FP16 scaled by amp's ``LossScaler`` in ``fabric.backward``."""

    def __init__(self, dtype: str | None = None, *, device: str | None = None, config=None,
                 max_uncompiled_share: float = MAX_UNCOMPILED_SHARE, **options: Any) -> None:  # fmt: skip
        device, scaler = self._set_up(dtype, device, config, options, max_uncompiled_share)
        super().__init__(precision="16-mixed" if scaler else "bf16-mixed", device=device, scaler=scaler)
        self.precision = LIGHTNING_PRECISION[self.dtype]

    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        self._reuse.tick()  # between two updates: the loop's forward and backward
        if getattr(self, "_module", None) is not None:  # what fabric.setup handed us, after backward
            self._enforce(self._module)
        return super().optimizer_step(optimizer, **kwargs)

    def convert_input(self, data: Any) -> Any:
        return data  # FP32 in: the plan casts where it decided to

    def convert_output(self, data: Any) -> Any:
        return data
