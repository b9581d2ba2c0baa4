"""GradScaler's behavioural scenarios, on CPU, run against LossScaler (kept apart).

Each scenario trains a control model without scaling and a scaled model, skipping one
iteration with an injected Inf; the scaled run must match the control and the scale
must have grown and backed off exactly as GradScaler's contract says. Every scenario
also runs with torch.amp.GradScaler itself, so the two are held to the same test.
"""

from __future__ import annotations

import pickle
from functools import partial

import pytest
import torch

from amp_compiler import LossScaler


def models_optimizers(optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None):
    """A control model (no scaling) and an identical one to scale, each with its optimizer."""
    control = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    scaling = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    scaling.load_state_dict(control.state_dict())
    kwargs = {"lr": 1.0, **(optimizer_kwargs or {})}
    return (
        control,
        scaling,
        optimizer_ctor(control.parameters(), **kwargs),
        optimizer_ctor(scaling.parameters(), **kwargs),
    )


def _create_scaling_case(device="cpu", optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None):
    data = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(4)]
    return models_optimizers(optimizer_ctor, optimizer_kwargs) + (data, torch.nn.MSELoss(), 2)


SCALERS = {"LossScaler": LossScaler, "GradScaler": torch.amp.GradScaler}
OPTIMIZERS = [
    (torch.optim.SGD, {}),
    (torch.optim.SGD, {"foreach": True}),
    (torch.optim.Adam, {}),
    (torch.optim.Adam, {"fused": True}),
    (torch.optim.AdamW, {"foreach": True}),
    (torch.optim.AdamW, {"fused": True}),
]


def run_case(scaler_cls, run, unskipped, skipped, optimizer=(torch.optim.SGD, {}), atol=1e-6):
    for enabled in (True, False):
        torch.manual_seed(0)
        (mod_control, mod_scaling, opt_control, opt_scaling, data, loss_fn, skip_iter) = _create_scaling_case(
            device="cpu", optimizer_ctor=optimizer[0], optimizer_kwargs=optimizer[1]
        )
        scaler = scaler_cls("cpu", init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)
        run(data, mod_control, opt_control, scaler, loss_fn, skip_iter, False)
        run(data, mod_scaling, opt_scaling, scaler, loss_fn, skip_iter, True)
        if enabled:
            assert scaler.get_scale() == 128.0 * 2.0**unskipped * 0.5**skipped
        else:
            assert scaler.get_scale() == 1.0
        for c, s in zip(mod_control.parameters(), mod_scaling.parameters()):
            torch.testing.assert_close(c.grad, s.grad, atol=atol, rtol=1e-5)
            for k in opt_control.state[c]:
                torch.testing.assert_close(opt_control.state[c][k], opt_scaling.state[s][k], atol=atol, rtol=1e-5)
            torch.testing.assert_close(c, s, atol=atol, rtol=1e-5)


def training_loop(clip_norm=None, penalty=False):
    """One run over the data, scaled or as the unscaled control; iteration ``skip_iter``
    gets an Inf in the scaled run's gradients and is skipped by hand in the control.

    clip_norm: clip after unscale_ (scaled) / after backward (control).
    penalty: add a gradient-norm penalty computed from (unscaled) first-order grads.
    """

    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (x, target) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), target)
            if penalty:
                if try_scaling_api:
                    grads = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
                    grads = [g * (1.0 / scaler.get_scale()) for g in grads]
                else:
                    grads = torch.autograd.grad(loss, model.parameters(), create_graph=True)
                loss = loss + sum(g.pow(2).sum() for g in grads).sqrt()
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(float("inf"))
                if clip_norm is not None:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                if clip_norm is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
                if not scaler.is_enabled() or i != skip_iter:
                    optimizer.step()

    return run


@pytest.mark.parametrize("scaler_cls", SCALERS.values(), ids=SCALERS)
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: f"{o[0].__name__}{o[1]}")
def test_scaling_skips_the_bad_iteration_and_matches_control(scaler_cls, optimizer):
    run_case(scaler_cls, training_loop(), unskipped=3, skipped=1, optimizer=optimizer)


@pytest.mark.parametrize("scaler_cls", SCALERS.values(), ids=SCALERS)
def test_scaling_with_clipping_after_unscale(scaler_cls):
    run_case(scaler_cls, training_loop(clip_norm=0.2), unskipped=3, skipped=1, atol=1e-5)


@pytest.mark.parametrize("scaler_cls", SCALERS.values(), ids=SCALERS)
def test_scaling_gradient_penalty(scaler_cls):
    run_case(scaler_cls, training_loop(penalty=True), unskipped=3, skipped=1, atol=1e-5)


@pytest.mark.parametrize("scaler_cls", SCALERS.values(), ids=SCALERS)
def test_scaling_gradient_accumulation(scaler_cls):
    iters_to_accumulate = 2

    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (x, target) in enumerate(data):
            loss = loss_fn(model(x), target) / iters_to_accumulate
            if try_scaling_api:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            if (i + 1) % iters_to_accumulate == 0:
                if try_scaling_api:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.zero_grad()

    run_case(scaler_cls, run, unskipped=2, skipped=0)


@pytest.mark.parametrize("scaler_cls", SCALERS.values(), ids=SCALERS)
def test_scaling_state_dict_and_pickle(scaler_cls):
    for lazy_init in (True, False):
        s0 = scaler_cls("cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
        s1 = scaler_cls("cpu", init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
        s1.scale(torch.full((1,), 4.0))  # lazily initialises s1's scale tensor
        if not lazy_init:
            s0.scale(torch.full((1,), 4.0))
        s1.load_state_dict(s0.state_dict())
        assert (s1.get_scale(), s1.get_growth_factor(), s1.get_backoff_factor(), s1.get_growth_interval()) == (
            3.0,
            4.0,
            0.5,
            2,
        )
        s2 = pickle.loads(pickle.dumps(s0))
        assert s2.state_dict() == s0.state_dict()
    disabled = scaler_cls("cpu", enabled=False)
    assert disabled.state_dict() == {}
    with pytest.raises(RuntimeError):
        scaler_cls("cpu").load_state_dict({})


@pytest.mark.parametrize("scaler_cls", SCALERS.values(), ids=SCALERS)
def test_scaling_getters_setters(scaler_cls):
    s = scaler_cls("cpu")
    s.set_growth_factor(3.0)
    s.set_backoff_factor(0.25)
    s.set_growth_interval(7)
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (3.0, 0.25, 7)
    assert s.is_enabled() and s.get_scale() == 2.0**16
    outputs = s.scale([torch.ones(2), (torch.ones(1), torch.ones(1))])
    assert outputs[0].tolist() == [2.0**16, 2.0**16] and outputs[1][1].item() == 2.0**16


@pytest.mark.parametrize("scaler_cls", SCALERS.values(), ids=SCALERS)
def test_scaling_multiple_models_losses_optimizers(scaler_cls):
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        model0, model1 = model
        opt0, opt1 = optimizer
        for i, (x, target) in enumerate(data):
            opt0.zero_grad()
            opt1.zero_grad()
            out0, out1 = model0(x), model1(x)
            loss0 = loss_fn(0.3 * out0 + 0.7 * out1, target)
            loss1 = loss_fn(0.6 * out0 - 0.4 * out1, target)
            if try_scaling_api:
                scaler.scale(loss0).backward(retain_graph=True)
                scaler.scale(loss1).backward()
                if i == skip_iter and scaler.is_enabled():
                    model1[1].weight.grad.data.fill_(float("inf"))
                scaler.unscale_(opt0)
                scaler.step(opt0)
                scaler.step(opt1)
                scaler.update()
            else:
                loss0.backward(retain_graph=True)
                loss1.backward()
                opt0.step()  # the Inf is in model1's gradients: only opt1 skips
                if not scaler.is_enabled() or i != skip_iter:
                    opt1.step()

    for enabled in (True, False):
        torch.manual_seed(0)
        (c0, s0, oc0, os0, data, loss_fn, skip_iter) = _create_scaling_case(device="cpu")
        (c1, s1, oc1, os1) = models_optimizers()
        scaler = scaler_cls("cpu", init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)
        run(data, (c0, c1), (oc0, oc1), scaler, loss_fn, skip_iter, False)
        run(data, (s0, s1), (os0, os1), scaler, loss_fn, skip_iter, True)
        if enabled:
            assert scaler.get_scale() == 128.0 * 2.0**3 * 0.5**1
        for c, s in zip(list(c0.parameters()) + list(c1.parameters()), list(s0.parameters()) + list(s1.parameters())):
            torch.testing.assert_close(c, s, atol=1e-6, rtol=1e-5)


def test_loss_scaler_signature_takes_gradscaler_keywords():
    make = partial(
        LossScaler, "cpu", init_scale=2.0**10, growth_factor=3.0, backoff_factor=0.25, growth_interval=5, enabled=True
    )
    s = make()
    assert (s.get_scale(), s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (
        2.0**10,
        3.0,
        0.25,
        5,
    )
