"""The optimizer half of the training step as one program: the same update as the
optimizer's own step(), skips decided on the device, one host synchronisation."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from amp_compiler import LossScaler, make_train_step
from amp_compiler.optim import FusedUpdate, unsupported

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adam_l2": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.05, betas=(0.8, 0.99)),
    "adam_maximize": lambda ps: torch.optim.Adam(ps, lr=1e-3, maximize=True),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "sgd_plain": lambda ps: torch.optim.SGD(ps, lr=0.05),
}


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def set_grads(m, step, scale=1.0, poison=None):
    g = torch.Generator().manual_seed(step)
    for p in m.parameters():
        p.grad = torch.randn(p.shape, generator=g) * scale
    if poison is not None:
        next(m.parameters()).grad[0, 0] = poison


def state_of(opt):
    return {k: v.clone() for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v)}


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("max_norm", [None, 0.5])
def test_fused_update_matches_the_optimizers_own_step(name, max_norm):
    """Unscale (2^10) -> clip -> update, five steps: the optimizer's own step() is the oracle."""
    ours, ref = model(), model()
    opt, ref_opt = OPTIMIZERS[name](ours.parameters()), OPTIMIZERS[name](ref.parameters())
    update = FusedUpdate(opt, max_norm)
    scale = torch.tensor(1024.0)
    for step in range(5):
        set_grads(ours, step, scale=1024.0)
        set_grads(ref, step)
        found, norm = update(scale)
        ref_norm = (
            nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
            if max_norm
            else nn.utils.get_total_norm([p.grad for p in ref.parameters()])
        )
        ref_opt.step()
        assert not found
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state_of(opt), state_of(ref_opt), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("poison", [float("inf"), float("nan")])
@pytest.mark.parametrize("name", ["adamw", "sgd_nesterov"])
def test_fused_update_skip_leaves_parameters_and_state_bit_identical(name, poison):
    m = model()
    opt = OPTIMIZERS[name](m.parameters())
    update = FusedUpdate(opt, 1.0)
    set_grads(m, 0)
    update(torch.tensor(1.0))
    params, state = [p.clone() for p in m.parameters()], state_of(opt)
    set_grads(m, 1, poison=poison)
    found, norm = update(torch.tensor(1.0))
    assert found and not torch.isfinite(norm)
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), params))
    after = state_of(opt)
    assert all(torch.equal(after[k], state[k]) for k in state)


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "name, kernel", [("adamw", "_fused_adamw_"), ("adam_l2", "_fused_adam_"), ("sgd_nesterov", "_fused_sgd_")]
)
def test_update_runs_one_fused_kernel_over_all_parameters(name, kernel):
    """What executed: one fused optimizer kernel for the group, no per-parameter op chains."""
    m = model()
    update = FusedUpdate(OPTIMIZERS[name](m.parameters()), 1.0)
    set_grads(m, 0)
    with OpCounter() as seen:
        update(torch.tensor(4.0))
    assert seen.ops.count(kernel) == 1
    assert not {"mul_", "lerp_", "addcdiv_", "_foreach_mul_", "_foreach_lerp_"} & set(seen.ops)


def test_learning_rate_changes_take_effect():
    a, b = model(), model()
    oa, ob = torch.optim.AdamW(a.parameters(), lr=1e-2), torch.optim.AdamW(b.parameters(), lr=1e-2)
    sa, sb = (torch.optim.lr_scheduler.LambdaLR(o, lambda i: 1.0 / (i + 1)) for o in (oa, ob))
    update = FusedUpdate(oa, None)
    for step in range(4):
        set_grads(a, step)
        set_grads(b, step)
        update(torch.tensor(1.0))
        oa._opt_called = True
        ob.step()
        sa.step(), sb.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_state_loaded_into_a_plain_optimizer_resumes():
    """A checkpoint from the optimizer's own step() (steps kept on the CPU) resumes here."""
    a, b = model(), model()
    oa, ob = torch.optim.AdamW(a.parameters(), lr=1e-2), torch.optim.AdamW(b.parameters(), lr=1e-2)
    set_grads(a, 0), set_grads(b, 0)
    oa.step(), ob.step()
    fresh = torch.optim.AdamW(a.parameters(), lr=1e-2)
    fresh.load_state_dict(oa.state_dict())
    update = FusedUpdate(fresh, None)
    set_grads(a, 1), set_grads(b, 1)
    update(torch.tensor(1.0))
    ob.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert all(float(s["step"]) == 2 for s in fresh.state.values())


def test_other_optimizers_fall_back_to_their_own_step():
    m = model()
    rms = torch.optim.RMSprop(m.parameters(), lr=1e-3)
    assert "RMSprop" in unsupported(rms)
    assert "amsgrad" in unsupported(torch.optim.Adam(m.parameters(), amsgrad=True))
    step = make_train_step(m, rms, F.mse_loss, dtype="bf16", compile_options={"inner": "aot_eager"})
    assert step.fused is None
    before = [p.clone() for p in m.parameters()]
    step(torch.randn(4, 8), torch.randn(4, 1))
    assert any(not torch.equal(p, q) for p, q in zip(m.parameters(), before))
    with pytest.raises(ValueError, match="RMSprop has no fused update"):
        make_train_step(m, rms, F.mse_loss, dtype="bf16", fused_update=True)


class SyncCounter(TorchDispatchMode):
    """Host synchronisations: .item()/bool() (aten._local_scalar_dense) and .tolist()."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.count = 0
        original = torch.Tensor.tolist

        def tolist(t):
            self.count += 1
            return original(t)

        monkeypatch.setattr(torch.Tensor, "tolist", tolist)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_one_host_sync_per_optimizer_step_none_between_micro_steps(dtype, monkeypatch):
    m = model()
    scaler = LossScaler("cpu", init_scale=2.0**8) if dtype == "fp16" else None
    step = make_train_step(
        m,
        torch.optim.AdamW(m.parameters(), lr=1e-2),
        F.mse_loss,
        dtype=dtype,
        scaler=scaler,
        max_grad_norm=1.0,
        grad_accum=2,
        compile_options={"inner": "aot_eager"},
    )
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    step(x, y), step(x, y)  # compile and first step
    counter = SyncCounter(monkeypatch)
    with counter:
        r = step(x, y)
        assert counter.count == 0 and not r.stepped  # accumulation micro-step
        r = step(x, y)
    assert counter.count == 1 and r.stepped
    assert r.scale == (2.0**8 if dtype == "fp16" else 1.0)


def test_fused_step_skips_and_the_scale_backs_off():
    """FP16: an Inf gradient skips the step on the device, the scaler halves, the
    scheduler does not advance, and the parameters are untouched."""
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    step = make_train_step(
        m,
        opt,
        F.mse_loss,
        dtype="fp16",
        lr_scheduler=sched,
        scaler=LossScaler("cpu", init_scale=2.0**8),
        compile_options={"inner": "aot_eager"},
    )
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    step(x, y)
    params, lr = [p.clone() for p in m.parameters()], opt.param_groups[0]["lr"]
    r = step(x, y * float("inf"))
    assert r.skipped and r.scale == 2.0**8 and step.scaler.get_scale() == 2.0**7
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), params))
    assert opt.param_groups[0]["lr"] == lr and step.scaler.skipped_steps == 1
    r = step(x, y)
    assert not r.skipped and r.scale == 2.0**7


def test_fused_and_unfused_training_steps_agree():
    a, b = model(), model()
    sa = make_train_step(
        a,
        torch.optim.AdamW(a.parameters(), lr=1e-2),
        F.mse_loss,
        dtype="bf16",
        max_grad_norm=0.5,
        compile_options={"inner": "aot_eager"},
    )
    sb = make_train_step(
        b,
        torch.optim.AdamW(b.parameters(), lr=1e-2),
        F.mse_loss,
        dtype="bf16",
        max_grad_norm=0.5,
        compile_options={"inner": "aot_eager"},
        fused_update=False,
    )
    assert sa.fused is not None and sb.fused is None
    for i in range(4):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
        ra, rb = sa(x, y), sb(x, y)
        torch.testing.assert_close(ra.loss, rb.loss, rtol=1e-5, atol=0)
        torch.testing.assert_close(ra.grad_norm, rb.grad_norm, rtol=1e-5, atol=0)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
