"""``NonFiniteMonitor``: watch the Inf/NaN ratio, lower the loss scale and alert.

The ratio. Every optimizer step is finite or non-finite (its gradients held an
Inf/NaN and the step was skipped). Dynamic loss scaling overflows on purpose:
after each growth of the scale it probes whether the larger scale still fits,
and at the start it backs off from ``init_scale`` until it does. Those
overflows are the mechanism working, so they are *explained* and not counted:

- the first non-finite step after each growth of the scale (about one per
  growth interval);
- the opening streak of non-finite steps before the first finite one, up to
  log2(init_scale) + 1 steps (enough to back off from 2^16 to 1).

    ratio = unexplained non-finite steps in the last ``window`` steps / ``window``

checked every ``check_every`` steps (default 100) over a window of 1000 steps.
Normal scaling gives 0; one stray overflow in 1000 steps is 0.1%, at the
threshold and not above it; a problem that makes even 2 steps of the last 1000
non-finite trips it at the next check, so a persistent one alerts within
``check_every`` steps. Under BF16 nothing is explained: there is no scale.

Above the threshold the monitor lowers the loss scale by ``extra_backoff``
(default 1/8, beyond the scaler's own 1/2), logs a WARNING on the
``amp_compiler`` logger and calls each ``on_alert`` callback with an
``AlertEvent``. Under BF16 it alerts only. When the scale is at its minimum,
or the previous check alerted too, the message says what the design note says:
the cause is the learning rate, the data or missing gradient clipping, not AMP.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

log = logging.getLogger("amp_compiler")

NOT_AMP = (
    "non-finite gradients persist at the minimum loss scale: the cause is the learning "
    "rate, the data, or missing gradient clipping (set max_grad_norm), not AMP"
)
NOT_AMP_PERSIST = (
    "non-finite gradients persist across checks: the cause is likely the learning "
    "rate, the data, or missing gradient clipping (set max_grad_norm), not AMP"
)


@dataclass(frozen=True)
class AlertEvent:
    step: int
    ratio: float
    nonfinite: int
    window: int
    scale_before: float | None
    scale_after: float | None
    dtype: str
    persistent: bool
    message: str
    # filled off the hot path by whoever knows the model (the training step):
    first_nonfinite: str | None = None  # the first node whose output was Inf/NaN on the offending batch
    suggested_pin: dict | None = None  # e.g. {"fp32_modules": ["^h\\.3\\.attn$"]}

    def to_dict(self) -> dict:
        return asdict(self)


class NonFiniteMonitor:
    def __init__(
        self,
        check_every: int = 100,
        threshold: float = 0.001,
        *,
        window: int = 1000,
        extra_backoff: float = 0.125,
        min_scale: float = 1.0,
        on_alert: Callable[[AlertEvent], None] | Iterable[Callable] | None = None,
    ):
        if check_every < 1 or window < check_every:
            raise ValueError(f"need 1 <= check_every ({check_every}) <= window ({window})")
        if not 0 <= threshold < 1:
            raise ValueError(f"threshold is a fraction in [0, 1), got {threshold}")
        if not 0 < extra_backoff < 1:
            raise ValueError(f"extra_backoff must be in (0, 1), got {extra_backoff}")
        self.check_every, self.threshold, self.window = check_every, threshold, window
        self.extra_backoff, self.min_scale = extra_backoff, min_scale
        if on_alert is None:
            on_alert = []
        elif callable(on_alert):
            on_alert = [on_alert]
        self.on_alert = list(on_alert)
        # explain(event) -> event: set by the training step to name the node and the pin
        self.explain: Callable[[AlertEvent], AlertEvent] | None = None
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.history: deque[bool] = deque(maxlen=self.window)  # True = unexplained non-finite
        self.raw_nonfinite = 0
        self.seen_finite = False
        self.opening_streak = 0
        self.grew = False
        self.opening_allowance: int | None = None
        self.last_alerted = False
        self.alerts: list[AlertEvent] = []

    def observe(
        self,
        nonfinite: bool,
        *,
        scale_before: float | None = None,
        scale_after: float | None = None,
        scaler=None,
        dtype: str = "fp16",
    ) -> AlertEvent | None:
        """Record one optimizer step; every ``check_every`` steps, check and maybe act."""
        self.steps += 1
        self.raw_nonfinite += nonfinite
        scaled = scale_before is not None
        explained = False
        if scaled and self.opening_allowance is None:
            self.opening_allowance = int(math.log2(max(scale_before, 1.0))) + 1
        if nonfinite and scaled:
            if not self.seen_finite and self.opening_streak < self.opening_allowance:
                self.opening_streak += 1
                explained = True
            elif self.grew:
                explained = True
            self.grew = False
        if not nonfinite:
            self.seen_finite = True
        if scaled and scale_after is not None and scale_after > scale_before:
            self.grew = True
        self.history.append(nonfinite and not explained)
        if self.steps % self.check_every == 0:
            return self.check(scaler=scaler, dtype=dtype)
        return None

    @property
    def ratio(self) -> float:
        return sum(self.history) / self.window

    def check(self, scaler=None, dtype: str = "fp16") -> AlertEvent | None:
        ratio = self.ratio
        if ratio <= self.threshold:
            self.last_alerted = False
            return None
        enabled = scaler is not None and scaler.is_enabled()
        before = scaler.get_scale() if enabled else None
        after = before
        floor = max(self.min_scale, getattr(scaler, "min_scale", None) or 0.0)
        if enabled:
            after = max(floor, before * self.extra_backoff)
            scaler.update(new_scale=float(after))
        at_min = enabled and before <= floor
        persistent = at_min or self.last_alerted
        what = f"Inf/NaN in {ratio:.2%} of the last {self.window} steps (threshold {self.threshold:.2%})"
        if enabled:
            action = f"loss scale {before:g} -> {after:g}"
        else:
            action = f"no loss scale under {dtype}; alerting only"
        advice = NOT_AMP if at_min else NOT_AMP_PERSIST if persistent else ""
        if dtype == "bf16" and not advice:
            advice = "BF16 has FP32's range: check the learning rate, the data, or gradient clipping"
        message = f"step {self.steps}: {what}; {action}" + (f". {advice}" if advice else "")
        event = AlertEvent(self.steps, ratio, sum(self.history), self.window, before, after, dtype, persistent, message)
        # The history (state_dict) keeps the monitor's own decision; the explanation (which
        # node, which pin) depends on the batch at hand and goes to the log and callbacks.
        self.alerts.append(event)
        if self.explain is not None:
            try:
                event = self.explain(event)
            except Exception as e:  # an explanation must never stop training
                log.warning("amp: could not locate the Inf/NaN: %s: %s", type(e).__name__, e)
        message = event.message
        self.last_alerted = True
        log.warning("amp: %s", message)
        for callback in self.on_alert:
            callback(event)
        return event

    def state_dict(self) -> dict:
        return {
            "steps": self.steps,
            "history": list(self.history),
            "raw_nonfinite": self.raw_nonfinite,
            "seen_finite": self.seen_finite,
            "opening_streak": self.opening_streak,
            "grew": self.grew,
            "opening_allowance": self.opening_allowance,
            "last_alerted": self.last_alerted,
            "alerts": [a.to_dict() for a in self.alerts],
        }

    def load_state_dict(self, state: dict) -> None:
        self.reset()
        self.steps = state["steps"]
        self.history.extend(state["history"])
        self.raw_nonfinite = state["raw_nonfinite"]
        self.seen_finite, self.opening_streak = state["seen_finite"], state["opening_streak"]
        self.grew, self.last_alerted = state["grew"], state["last_alerted"]
        self.opening_allowance = state["opening_allowance"]
        self.alerts = [AlertEvent(**a) for a in state["alerts"]]
