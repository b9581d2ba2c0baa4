"""LossScaler: a GradScaler drop-in (signature, trajectory, state), bounds, hysteresis, and the
skipped-step signal."""

from __future__ import annotations

import inspect
import pickle

import pytest
import torch
import torch.nn as nn

from amp_compiler import LossScaler


def test_loss_scaler_is_gradscaler_with_same_signature_and_defaults():
    s = LossScaler("cpu")
    assert isinstance(s, torch.amp.GradScaler)
    assert (s.get_scale(), s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (
        2.0**16,
        2.0,
        0.5,
        2000,
    )
    theirs = list(inspect.signature(torch.amp.GradScaler.__init__).parameters)
    ours = list(inspect.signature(LossScaler.__init__).parameters)
    assert ours[: len(theirs)] == theirs


def run_scaler(scaler, flags):
    """One parameter, SGD; flags[i] True puts an Inf in the gradient at step i."""
    p = nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1)
    scales, params = [], []
    for bad in flags:
        opt.zero_grad()
        scaler.scale((p * 2).sum()).backward()
        if bad:
            p.grad[0] = float("inf") if bad == "inf" else float("nan")
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        params.append(p.detach().clone())
    return scales, params


FLAGS = [False, "inf", False, False, False, False, "nan", "inf", False, False, False, False, False]


def test_loss_scaler_trajectory_identical_to_gradscaler():
    """Same finite / non-finite sequence -> the same scales and the same parameters."""
    kw = dict(init_scale=1024.0, growth_interval=3)
    ours = run_scaler(LossScaler("cpu", **kw), FLAGS)
    theirs = run_scaler(torch.amp.GradScaler("cpu", **kw), FLAGS)
    assert ours[0] == theirs[0]
    assert all(torch.equal(a, b) for a, b in zip(ours[1], theirs[1]))
    assert ours[0][:3] == [1024.0, 512.0, 512.0]


def test_loss_scaler_skipped_step_signal():
    s = LossScaler("cpu", init_scale=8.0)
    assert s.last_step_skipped is None
    run_scaler(s, [False, "inf"])
    assert s.last_step_skipped is True and s.skipped_steps == 1


def test_loss_scaler_min_max_bounds():
    grow = LossScaler("cpu", init_scale=4.0, growth_interval=1, max_scale=16.0)
    assert max(run_scaler(grow, [False] * 6)[0]) == 16.0
    shrink = LossScaler("cpu", init_scale=64.0, min_scale=8.0)
    assert run_scaler(shrink, ["inf"] * 6)[0][-1] == 8.0


def test_loss_scaler_with_hysteresis_still_grows():
    """hysteresis=2 takes its own update path: clean steps still double the scale every
    growth_interval (GradScaler's trajectory), and an absorbed overflow restarts the count."""
    s = LossScaler("cpu", init_scale=64.0, growth_interval=2, hysteresis=2)
    clean = run_scaler(s, [False] * 4)[0]
    assert clean == run_scaler(torch.amp.GradScaler("cpu", init_scale=64.0, growth_interval=2), [False] * 4)[0]
    assert clean == [64.0, 128.0, 128.0, 256.0]
    s = LossScaler("cpu", init_scale=64.0, growth_interval=2, hysteresis=2)
    assert run_scaler(s, [False, "inf", False, False])[0] == [64.0, 64.0, 64.0, 128.0]


def test_loss_scaler_hysteresis_backs_off_on_second_overflow():
    """hysteresis=2: the first overflow skips the step but keeps the scale; the second halves it."""
    s = LossScaler("cpu", init_scale=64.0, growth_interval=100, hysteresis=2)
    scales, params = run_scaler(s, [False, "inf", "inf", False])
    assert scales == [64.0, 64.0, 32.0, 32.0]
    assert torch.equal(params[1], params[0]) and torch.equal(params[2], params[0])


def test_loss_scaler_bf16_is_a_documented_noop():
    s = LossScaler("cpu", dtype="bf16")
    assert not s.is_enabled()
    t = torch.ones(2)
    assert s.scale(t) is t
    _, params = run_scaler(s, [False])
    assert not torch.equal(params[0], torch.ones(4))  # the optimizer stepped
    assert s.state_dict() == {}


def test_loss_scaler_state_dict_and_pickle_roundtrip():
    s = LossScaler("cpu", init_scale=256.0, growth_interval=2, min_scale=2.0, hysteresis=2)
    run_scaler(s, [False, "inf", False, False])
    state = s.state_dict()
    assert set(torch.amp.GradScaler("cpu").state_dict()) <= set(state)
    fresh = LossScaler("cpu")
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    clone = pickle.loads(pickle.dumps(s))
    assert clone.get_scale() == s.get_scale() and clone.hysteresis == 2
    assert run_scaler(clone, [False, "inf"])[0] == run_scaler(s, [False, "inf"])[0]


def test_loss_scaler_loads_a_gradscaler_checkpoint():
    g = torch.amp.GradScaler("cpu", init_scale=128.0)
    run_scaler(g, [False, "inf"])
    s = LossScaler("cpu")
    s.load_state_dict(g.state_dict())
    assert s.get_scale() == g.get_scale() == 64.0


def test_loss_scaler_bad_arguments():
    with pytest.raises(ValueError, match="min_scale=8 is above max_scale=4"):
        LossScaler("cpu", min_scale=8, max_scale=4)
    with pytest.raises(ValueError, match="hysteresis"):
        LossScaler("cpu", hysteresis=0)
