"""``LossScaler``: torch.amp.GradScaler, plus bounds, hysteresis and a skipped-step signal.

It *is* a GradScaler (a subclass), so every loop, checkpoint and test written for
GradScaler works unchanged: same constructor (device first, same keywords),
same defaults (2^16, x2, x0.5, every 2000 steps), same methods and state dict
keys. What it adds:

- ``min_scale`` / ``max_scale``: the scale is clamped after every update (an
  in-place tensor op: no host synchronisation).
- ``hysteresis`` (DeepSpeed's "delayed shift"): the scale backs off only on the
  ``hysteresis``-th overflow; earlier overflows skip the step and restart the
  growth count. Reset to full when the scale grows. Default 1 = GradScaler.
- ``last_step_skipped`` / ``skipped_steps``: read after ``step()``; the value
  comes from the one ``.item()`` GradScaler already does, so reading it costs
  nothing more.
- ``dtype``: ``"bf16"`` / ``torch.bfloat16`` (or FP32) turns scaling off, a
  documented no-op (BF16 has FP32's exponent range: nothing underflows that FP32 keeps).
  ``scale()`` returns its input, ``step()`` calls ``optimizer.step()``.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import torch
from torch.amp import GradScaler

from .upstream.torch_private import private

log = logging.getLogger(__name__)
_UNSCALED = ("bf16", "bfloat16", torch.bfloat16, "fp32", "float32", torch.float32)


class LossScaler(GradScaler):
    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        min_scale: float | None = None,
        max_scale: float | None = None,
        hysteresis: int = 1,
        dtype: str | torch.dtype | None = None,
    ) -> None:
        if min_scale is not None and max_scale is not None and min_scale > max_scale:
            raise ValueError(f"min_scale={min_scale} is above max_scale={max_scale}")
        if not isinstance(hysteresis, int) or hysteresis < 1:
            raise ValueError(f"hysteresis must be an int >= 1, got {hysteresis!r}")
        self.dtype = dtype
        if dtype in _UNSCALED and enabled:
            log.info("LossScaler: %s needs no loss scaling; scaling is off (a no-op)", dtype)
            enabled = False
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
        self.min_scale, self.max_scale = min_scale, max_scale
        self.hysteresis = hysteresis
        self._hysteresis_left: torch.Tensor | None = None
        self._init_hysteresis_left = hysteresis
        self._last_skipped: bool | None = None
        self._pending_found: torch.Tensor | None = None
        self._skipped_steps = 0

    @property
    def last_step_skipped(self) -> bool | None:
        """Whether the last ``step()`` skipped ``optimizer.step()`` (None before any step).

        With a fused optimizer (which checks Inf/NaN on the device itself) the
        answer is read from the device on first access, not during ``step()``.
        """
        if self._pending_found is not None:
            self._last_skipped = bool(self._pending_found.item())
            self._skipped_steps += self._last_skipped
            self._pending_found = None
        return self._last_skipped

    @property
    def skipped_steps(self) -> int:
        self.last_step_skipped  # noqa: B018 - resolves a pending fused-optimizer answer
        return self._skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped_steps = value

    def _maybe_opt_step(self, optimizer, optimizer_state, *args: Any, **kwargs: Any):
        found = sum(v.item() for v in optimizer_state["found_inf_per_device"].values())
        self._last_skipped = bool(found)
        self._stepped_on_host = True
        if self._last_skipped:
            self._skipped_steps += 1
            return None
        return optimizer.step(*args, **kwargs)

    def step(self, optimizer, *args: Any, **kwargs: Any):
        if not self._enabled:
            self._last_skipped = False
            return super().step(optimizer, *args, **kwargs)
        self.last_step_skipped  # noqa: B018 - settle the previous step first
        self._stepped_on_host = False
        retval = super().step(optimizer, *args, **kwargs)
        if not self._stepped_on_host:  # fused optimizer: it skipped (or not) on the device
            found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values()
            self._pending_found = sum(found) if found else None
        return retval

    def update_outside_step(self, optimizer, found_inf: torch.Tensor) -> tuple[bool, float, float]:
        """After an update done outside ``step()`` that already skipped itself where
        ``found_inf`` (the training step's fused update, the Trainer callback's dropped
        gradients): back off or grow the scale as ``update()`` does after ``step()``, then
        read (skipped, scale used, next scale) in one host synchronisation."""
        before = self._scale.clone()
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = {found_inf.device: found_inf.float()}
        state["stage"] = private("torch.amp.grad_scaler.OptState").STEPPED
        self.update()
        skipped, used, after = torch.stack(
            [found_inf.float().reshape(()), before.reshape(()), self._scale.reshape(())]
        ).tolist()
        self._last_skipped = bool(skipped)
        self._skipped_steps += self._last_skipped
        return self._last_skipped, used, after

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if not self._enabled:
            return
        if new_scale is not None or self.hysteresis == 1:
            super().update(new_scale)
        else:
            self._update_with_hysteresis()
        if self.min_scale is not None or self.max_scale is not None:
            self._scale.clamp_(min=self.min_scale, max=self.max_scale)

    def _update_with_hysteresis(self) -> None:
        scale, tracker = self._check_scale_growth_tracker("update")
        found = sum(
            f.to(scale.device) for s in self._per_optimizer_states.values() for f in s["found_inf_per_device"].values()
        )
        if not torch.is_tensor(found):
            raise AssertionError("No inf checks were recorded prior to update.")
        if self._hysteresis_left is None:
            self._hysteresis_left = torch.full((), self._init_hysteresis_left, dtype=torch.int32, device=scale.device)
        left = self._hysteresis_left
        absorbed = (found > 0) & (left > 1)
        # An absorbed overflow keeps the scale and restarts the growth count:
        # the tracker goes to -1 so the update's +1 lands on 0.
        tracker.copy_(torch.where(absorbed, torch.full_like(tracker, -1), tracker))
        before = scale.clone()
        private("torch._amp_update_scale_")(
            scale, tracker, found * (~absorbed), self._growth_factor, self._backoff_factor, self._growth_interval
        )
        left.copy_(
            torch.where(absorbed, left - 1, torch.where(scale > before, torch.full_like(left, self.hysteresis), left))
        )
        self._per_optimizer_states = defaultdict(private("torch.amp.grad_scaler._refresh_per_optimizer_state"))

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if state:
            left = self._hysteresis_left
            state.update(
                min_scale=self.min_scale,
                max_scale=self.max_scale,
                hysteresis=self.hysteresis,
                _hysteresis_left=int(left.item()) if left is not None else self._init_hysteresis_left,
                skipped_steps=self.skipped_steps,
            )
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if not self._enabled:
            return
        self.min_scale = state_dict.get("min_scale", self.min_scale)
        self.max_scale = state_dict.get("max_scale", self.max_scale)
        self.hysteresis = state_dict.get("hysteresis", self.hysteresis)
        self._init_hysteresis_left = state_dict.get("_hysteresis_left", self.hysteresis)
        if self._hysteresis_left is not None:
            self._hysteresis_left.fill_(self._init_hysteresis_left)
        self.skipped_steps = state_dict.get("skipped_steps", self.skipped_steps)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        if self._enabled and self._hysteresis_left is not None:
            state["_init_hysteresis_left"] = int(self._hysteresis_left.item())
        state["_hysteresis_left"] = None
        return state


def nonfinite(grads: list[torch.Tensor], device) -> torch.Tensor:
    """A 0-dim float tensor on ``device``, nonzero if any of ``grads`` holds Inf/NaN (the
    check GradScaler runs, with nothing to unscale; no host synchronisation)."""
    found = torch.zeros((), device=device)
    if grads:
        private("torch._amp_foreach_non_finite_check_and_unscale_")(grads, found, torch.ones_like(found))
    return found
