"""The Inf/NaN monitor: quiet under normal dynamic scaling, alerts (and lowers the scale) on
what scaling cannot explain, and says when it is not AMP."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import data, inject, mlp

from amp_compiler import LossScaler, NonFiniteMonitor, make_train_step

INNER = {"inner": "aot_eager"}


def test_monitor_alerts_on_persistent_problem_within_check_every(caplog):
    """Inf in every other gradient from step 30: WARNING and callback at the next check."""
    events = []
    monitor = NonFiniteMonitor(check_every=20, window=100, on_alert=events.append)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    step = make_train_step(
        model,
        opt,
        F.mse_loss,
        dtype="fp16",
        monitor=monitor,
        scaler=LossScaler("cpu", init_scale=1024.0),
        compile_options=INNER,
    )
    inject(model, set(range(30, 200, 2)))
    x, y = data()
    with caplog.at_level(logging.WARNING, logger="amp_compiler"):
        for _ in range(60):
            step(x, y)
    assert events and events[0].step == 40
    e = events[0]
    assert e.ratio > 0.001 and e.dtype == "fp16" and e.scale_after == e.scale_before / 8
    assert any("Inf/NaN" in r.message and r.levelno == logging.WARNING for r in caplog.records)
    assert events[-1].persistent and "not AMP" in events[-1].message


def simulate_scaling(steps, growth_interval, fits_below, monitor, start_bad=None):
    """Gradients overflow whenever the scale exceeds ``fits_below`` (dynamic scaling at work)."""
    scaler = LossScaler("cpu", init_scale=2.0**16, growth_interval=growth_interval)
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.0)
    for i in range(steps):
        opt.zero_grad()
        scaler.scale(p.sum()).backward()
        before = scaler.get_scale()
        if before > fits_below or (start_bad is not None and i >= start_bad):
            p.grad.fill_(float("inf"))
        scaler.step(opt)
        scaler.update()
        monitor.observe(scaler.last_step_skipped, scale_before=before, scale_after=scaler.get_scale(), scaler=scaler)
    return scaler


@pytest.mark.parametrize("growth_interval", [2000, 50])
def test_monitor_quiet_on_normal_dynamic_scaling(growth_interval):
    """The opening back-off and one probe overflow per growth interval never alert."""
    monitor = NonFiniteMonitor()
    simulate_scaling(3000, growth_interval, 2.0**10, monitor)
    assert monitor.raw_nonfinite >= 7 and monitor.alerts == []


def test_monitor_trips_on_problem_that_scaling_cannot_explain():
    monitor = NonFiniteMonitor()
    simulate_scaling(600, 50, 2.0**10, monitor, start_bad=510)
    assert monitor.alerts and monitor.alerts[0].step == 600


def test_monitor_at_min_scale_says_not_amp():
    monitor = NonFiniteMonitor(check_every=10, window=10)
    scaler = simulate_scaling(40, 2000, 2.0**10, monitor, start_bad=0)
    assert monitor.alerts and scaler.get_scale() == 1.0
    assert "minimum loss scale" in monitor.alerts[-1].message
    assert "learning rate, the data, or missing gradient clipping" in monitor.alerts[-1].message


def test_monitor_bf16_alerts_only():
    monitor = NonFiniteMonitor(check_every=10, window=10)
    for i in range(10):
        monitor.observe(i % 2 == 0, dtype="bf16")
    (e,) = monitor.alerts
    assert e.scale_before is None and e.scale_after is None and "alerting only" in e.message


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_the_threshold_is_one_step_in_a_thousand_by_default(dtype):
    """The README's promise, at its edge, with the defaults (checked every 100 steps over the
    last 1000): one unexplained Inf/NaN step in 1000 (0.1%) is quiet, a second trips the
    next check; under FP16 the alert lowers the scale by 1/8 beyond the scaler's backoff."""
    scaled = dtype == "fp16"
    scaler = LossScaler("cpu", init_scale=1024.0) if scaled else None
    if scaled:
        scaler.scale(torch.ones(()))  # its scale exists from the first scaled loss on
    monitor = NonFiniteMonitor()
    bad = {600, 1450}  # finite steps first: neither is the opening back-off
    events = []
    for i in range(1, 1601):
        scale = 1024.0 if scaled else None
        event = monitor.observe(i in bad, scale_before=scale, scale_after=scale, scaler=scaler, dtype=dtype)
        if event is not None:
            events.append(event)
    assert [e.step for e in events] == [1500]  # both in the window 501-1500 only: 0.2%
    assert events[0].ratio == pytest.approx(0.002)
    if scaled:
        assert events[0].scale_after == events[0].scale_before / 8 == 128.0
