"""The training step: LossScaler vs GradScaler, fault injection, the monitor, FP16/BF16 learning."""

from __future__ import annotations

import copy
import inspect
import logging
import math
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import OpRecorder, cosine, recording_backend

import amp_compiler
from amp_compiler import LossScaler, MasterWeightsError, NonFiniteMonitor, make_train_step

INNER = {"inner": "aot_eager"}
aten = torch.ops.aten


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))


def data(seed=0, n=64, noise=0.1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :1] * 2 - x[:, 1:2]).tanh() + noise * torch.randn(n, 1, generator=g)
    return x, y


# ---- LossScaler as a GradScaler drop-in -------------------------------------------------


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


# ---- make_train_step -----------------------------------------------------------------------


def inject(model, bad_steps, kind="inf"):
    """A gradient hook that poisons the first weight's gradient on chosen calls."""
    calls = {"n": 0}
    w = next(model.parameters())

    def hook(grad):
        calls["n"] += 1
        if calls["n"] in bad_steps:
            grad = grad.clone()
            grad[0, 0] = float(kind)
        return grad

    w.register_hook(hook)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("kind", ["inf", "nan"])
def test_fault_injection_skips_step_and_leaves_state_bit_identical(dtype, kind):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    scaler = LossScaler("cpu", init_scale=256.0, dtype=dtype)
    step = make_train_step(
        model, opt, F.mse_loss, dtype=dtype, scaler=scaler, lr_scheduler=sched, compile_options=INNER
    )
    inject(model, {3, 6}, kind)
    x, y = data()
    for i in range(1, 8):
        params = copy.deepcopy(model.state_dict())
        opt_state = copy.deepcopy(opt.state_dict())
        epoch, scale = sched.last_epoch, scaler.get_scale()
        r = step(x, y)
        assert r.skipped == (i in (3, 6)), i
        if r.skipped:
            for k, v in model.state_dict().items():
                assert torch.equal(v, params[k]), k
            assert repr(opt.state_dict()) == repr(opt_state)
            assert sched.last_epoch == epoch
            if dtype == "fp16":
                assert scaler.get_scale() == scale / 2
        else:
            assert sched.last_epoch == epoch + 1
    assert step.skipped_steps == 2
    assert all(p.dtype == torch.float32 for p in model.parameters())


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


def test_fp16_underflow_loss_scaling_is_what_makes_it_learn():
    """Gradients ~1e-9 flush to zero in FP16; with loss scaling they survive and the model learns."""
    x, y = data()
    tiny = lambda out, target: 1e-6 * F.mse_loss(out, target)  # noqa: E731
    results = {}
    for name, scaler in (("scaled", LossScaler("cpu")), ("unscaled", LossScaler("cpu", enabled=False))):
        model = mlp()
        w0 = model[0].weight.detach().clone()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        step = make_train_step(model, opt, tiny, dtype="fp16", scaler=scaler, compile_options=INNER)
        losses = [step(x, y).loss.item() for _ in range(60)]
        results[name] = (losses, torch.equal(model[0].weight, w0))
    scaled, unscaled = results["scaled"], results["unscaled"]
    assert unscaled[1], "first layer must not move: its FP16 gradients underflowed to zero"
    assert not scaled[1]
    assert scaled[0][-1] < 0.7 * scaled[0][0]
    assert unscaled[0][-1] > scaled[0][-1] * 1.2


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_training_reaches_fp32_loss(dtype):
    """300 Adam steps on a noisy regression; held-out FP32 loss within 1% of FP32 training's."""
    x, y = data(n=4096, noise=0.3)
    x_test, y_test = data(seed=1, n=4096, noise=0.3)
    ref = mlp()
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = make_train_step(model, opt, F.mse_loss, dtype=dtype, compile_options=INNER)
    for _ in range(300):
        loss = F.mse_loss(ref(x), y)
        opt_ref.zero_grad()
        loss.backward()
        opt_ref.step()
        step(x, y)
    with torch.no_grad():
        ours = F.mse_loss(model(x_test), y_test).item()
        theirs = F.mse_loss(ref(x_test), y_test).item()
    assert abs(ours - theirs) <= 0.01 * theirs, (ours, theirs)
    assert step.skipped_steps <= 2


def test_auto_dtype_falls_back_to_fp16_with_scaling(monkeypatch, caplog):
    monkeypatch.setattr(amp_compiler.device, "native_dtypes", lambda d: (frozenset({"fp16"}), "fake: no BF16"))
    model = mlp()
    with caplog.at_level(logging.INFO, logger="amp_compiler"):
        step = make_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, compile_options=INNER)
    assert step.dtype == "fp16" and step.scaler.is_enabled()
    assert "fake: no BF16" in step.dtype_reason and "FP16" in step.dtype_reason
    assert any("fp16" in r.getMessage() for r in caplog.records)
    r = step(*data())
    assert r.scale == 2.0**16 and step.backend.records[0].dtype == "fp16"


def test_auto_dtype_bf16_has_no_scaling(monkeypatch):
    monkeypatch.setattr(amp_compiler.device, "native_dtypes", lambda d: (frozenset({"bf16"}), "fake: BF16"))
    model = mlp()
    step = make_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, compile_options=INNER)
    assert step.dtype == "bf16" and not step.scaler.is_enabled()
    assert step(*data()).scale == 1.0


def test_auto_dtype_trains_fp32_without_scaler_where_16_bit_is_emulated(monkeypatch):
    """No fast 16 bit: the step trains the FP32 program itself (a plain FP32 loop's losses,
    up to the fused update's rounding), with no scaler, and says why."""
    monkeypatch.setattr(amp_compiler.device, "native_dtypes", lambda d: (frozenset(), "fake: emulated 16 bit"))
    model, ref = mlp(), mlp()
    step = make_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), F.mse_loss, compile_options=INNER)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    assert step.dtype == "fp32" and not step.scaler.is_enabled()
    assert "fake: emulated 16 bit" in step.dtype_reason
    for i in range(3):
        x, y = data(seed=i)
        r = step(x, y)
        loss = F.mse_loss(ref(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert r.scale == 1.0 and not r.skipped
        assert abs(r.loss.item() - loss.item()) <= 1e-5 * abs(loss.item())
    graph = step.backend.plan().graphs[0]
    assert not graph.applied
    assert "fake: emulated 16 bit" in graph.dtype_reason  # the step's reason, not "requested"


def test_checkpoint_resume_reproduces_uninterrupted_run():
    x, y = data()

    def build(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = make_train_step(
            model,
            opt,
            F.mse_loss,
            dtype="fp16",
            scaler=LossScaler("cpu", init_scale=512.0, growth_interval=3),
            monitor=NonFiniteMonitor(check_every=4, window=8),
            compile_options=INNER,
        )
        return opt, step

    full = mlp()
    opt, step = build(full)
    inject(full, {2, 5, 9})
    for _ in range(12):
        step(x, y)

    part = mlp()
    opt1, step1 = build(part)
    inject(part, {2, 5, 9})
    for _ in range(6):
        step1(x, y)
    ckpt = copy.deepcopy({"model": part.state_dict(), "opt": opt1.state_dict(), "step": step1.state_dict()})
    resumed = mlp(seed=1)
    opt2, step2 = build(resumed)
    resumed.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    step2.load_state_dict(ckpt["step"])
    inject(resumed, {9 - 6})
    for _ in range(6):
        step2(x, y)
    for (k, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), k
    assert step2.scaler.get_scale() == step.scaler.get_scale()
    assert step2.monitor.state_dict() == step.monitor.state_dict()
    assert step2.skipped_steps == step.skipped_steps == 3


def test_half_model_is_refused_with_advice():
    model = mlp().half()
    with pytest.raises(MasterWeightsError, match=r"FP32 master.*model.float\(\)"):
        make_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss)


def test_grad_accumulation_steps_every_n_calls():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = make_train_step(model, opt, F.mse_loss, dtype="bf16", grad_accum=2, compile_options=INNER)
    x, y = data()
    w0 = model[0].weight.detach().clone()
    r1 = step(x[:32], y[:32])
    assert not r1.stepped and r1.grad_norm is None and torch.equal(model[0].weight, w0)
    r2 = step(x[32:], y[32:])
    assert r2.stepped and step.optimizer_steps == 1
    ref = mlp()
    F.mse_loss(ref(x), y).backward()
    torch.testing.assert_close(
        r2.grad_norm, torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]), rtol=0.02, atol=1e-3
    )


def test_max_grad_norm_clips():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    step = make_train_step(
        model, opt, lambda o, t: 1e3 * F.mse_loss(o, t), dtype="bf16", max_grad_norm=0.5, compile_options=INNER
    )
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    r = step(*data())
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert r.grad_norm > 0.5
    assert (after - before).norm() <= 0.5 + 1e-4


def test_loss_scaler_skip_signal_with_fused_optimizer():
    """A fused optimizer skips on the device; the signal is read from there on first access."""
    p = nn.Parameter(torch.ones(4))
    opt = torch.optim.Adam([p], lr=0.1, fused=True)
    s = LossScaler("cpu", init_scale=64.0)
    for bad in (False, True):
        before = p.detach().clone()
        opt.zero_grad()
        s.scale(p.sum()).backward()
        if bad:
            p.grad[0] = float("inf")
        s.step(opt)
        s.update()
        assert s.last_step_skipped is bad
        assert torch.equal(p, before) is bad
    assert s.skipped_steps == 1 and s.get_scale() == 32.0


def test_alert_names_the_first_inf_node_and_suggests_a_pin():
    """FP16: a layer whose outputs leave FP16's range makes steps skip; the alert (computed
    after the fact, off the hot path) names that node and the pin that keeps it FP32."""

    class Blowup(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.big, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)

        def forward(self, x):
            return self.out(self.big(torch.relu(self.inp(x))) * 1e-3)

    torch.manual_seed(0)
    model = Blowup()
    events = []
    monitor = NonFiniteMonitor(check_every=1, threshold=0.0, window=1, on_alert=events.append)
    step = make_train_step(
        model,
        torch.optim.SGD(model.parameters(), lr=1e-3),
        F.mse_loss,
        dtype="fp16",
        monitor=monitor,
        compile_options=INNER,
        scaler=LossScaler("cpu", init_scale=1.0),
    )
    x, y = data()
    for _ in range(3):
        step(x[:, :8], y)
    assert not events
    r = step(x[:, :8] * 1e5, y)  # the big layer's output leaves FP16's range
    assert r.skipped and events
    event = events[-1]
    assert event.suggested_pin is not None and "first Inf/NaN at node" in event.message
    assert list(event.suggested_pin.values())[0][0] in (r"^big$", r"^inp$")


# ---- the loss compiled into the model's graph -------------------------------------------


class TinyLM(nn.Module):
    def __init__(self, vocab=64, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.body = nn.Sequential(nn.Linear(d, d), nn.GELU())
        self.head = nn.Linear(d, vocab)

    def forward(self, ids, shift=None):
        h = self.body(self.emb(ids))
        return self.head(h if shift is None else h + shift)


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


LOSS_OPS = (aten._log_softmax, aten._log_softmax_backward_data, aten.nll_loss_forward, aten.nll_loss_backward)


def _lm_steps(compile_loss, loss_fn=lm_loss, inputs=lambda ids: ids, n=3):
    """n steps of TinyLM; ``rec`` saw every op the compiled graphs executed."""
    torch.manual_seed(0)
    model, rec = TinyLM(), OpRecorder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = make_train_step(
        model, opt, loss_fn, dtype="bf16", compile_loss=compile_loss, compile_options={"inner": recording_backend(rec)}
    )
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (4, 8), generator=g)
    losses = [step(inputs(ids), torch.roll(ids, -1, 1)).loss.item() for _ in range(n)]
    return losses, rec, step, model


def test_loss_reaches_the_code_generator_in_fp32_with_the_model():
    losses, rec, step, _ = _lm_steps(compile_loss=True)
    assert step.backend.compiled == 1  # one graph: model and loss
    matmuls = rec.dtypes_of(aten.addmm, aten.mm)
    assert matmuls and all(d[:2] == [torch.bfloat16] * 2 for d in matmuls)
    loss_ops = rec.dtypes_of(*LOSS_OPS)
    assert loss_ops and all(d and set(d) == {torch.float32} for d in loss_ops)
    plan = step.backend.plan()
    assert any(n.precision == "FP32" and n.reason.startswith("loss") for n in plan.nodes)

    eager_losses, eager_rec, _, _ = _lm_steps(compile_loss=False)
    assert not eager_rec.dtypes_of(*LOSS_OPS)  # the loss ran outside the compiled graphs
    assert losses == pytest.approx(eager_losses, rel=1e-3)


def test_compiled_loss_keeps_keyword_inputs_graph_breaks_and_module_pins():
    def noisy_loss(logits, targets):  # a loss Dynamo cannot trace whole
        torch._dynamo.graph_break()
        return lm_loss(logits, targets)

    def inputs(ids):
        return {"ids": ids, "shift": torch.zeros(16)}

    joint, _, step, _ = _lm_steps(True, noisy_loss, inputs)
    plain, _, _, _ = _lm_steps(False, noisy_loss, inputs)
    assert joint == pytest.approx(plain, rel=1e-3)
    assert step.backend.plan().nodes  # the model's part stayed planned

    # module paths seen from the joint frame are the model's own ("body.0", not "_orig_mod.body.0")
    torch.manual_seed(0)
    model = TinyLM()
    step = make_train_step(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        lm_loss,
        dtype="bf16",
        compile_options={**INNER, "fp32_modules": [r"^body\.0$"]},
    )
    ids = torch.randint(0, 64, (2, 8))
    step(ids, ids)
    linears = {n.module: n.precision for n in step.backend.plan().nodes if "linear" in n.op}
    assert linears == {"body.0": "FP32", "head": "LOW"}


def _sequence_logp(logits, ids):
    logp = torch.log_softmax(logits.float(), -1)
    return logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1).sum(-1)


LOSSES = {
    "ce-ignore-smooth": lambda lo, t: F.cross_entropy(
        lo.flatten(0, 1), torch.where(t.flatten() % 5 == 0, -100, t.flatten()), label_smoothing=0.1
    ),
    "bce-logits": lambda lo, t: F.binary_cross_entropy_with_logits(lo, F.one_hot(t, 64).float()),
    "kl-div": lambda lo, t: F.kl_div(
        torch.log_softmax(lo, -1), F.one_hot(t, 64).float() * 0.9 + 0.1 / 64, reduction="batchmean"
    ),
    "masked-mse": lambda lo, t: (
        ((lo.softmax(-1) - F.one_hot(t, 64)) ** 2 * (t > 3).unsqueeze(-1)).sum() / (t > 3).sum()
    ),
    # DPO's shape: a sigmoid of differences of sequence log-probabilities of two halves
    "dpo-like": lambda lo, t: (
        -F.logsigmoid(0.1 * (_sequence_logp(lo[:2], t[:2]) - _sequence_logp(lo[2:], t[2:]))).mean()
    ),
}


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_compiled_loss_trains_as_the_loss_run_as_written(loss, dtype):
    """Property: compiling a loss into the graph changes where it runs, not what it computes."""
    runs = {}
    for compile_loss in (True, False):
        torch.manual_seed(0)
        model = TinyLM()
        step = make_train_step(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            LOSSES[loss],
            dtype=dtype,
            compile_loss=compile_loss,
            compile_options=INNER,
        )
        ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
        losses = [step(ids, torch.roll(ids, -1, 1)).loss.item() for _ in range(3)]
        runs[compile_loss] = losses, [p.detach().clone() for p in model.parameters()]
        plan = step.backend.plan()
        assert not any(g.unknown_ops for g in plan.graphs), [g.unknown_ops for g in plan.graphs]
    (joint, pj), (plain, pp) = runs[True], runs[False]
    assert all(math.isfinite(v) for v in joint)
    assert joint == pytest.approx(plain, rel=2e-3, abs=1e-4)
    for a, b in zip(pj, pp):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


def test_dpo_with_a_frozen_reference_inside_the_loss():
    """DPO as TRL computes it: the loss calls a frozen copy of the model under no_grad, so
    the reference forward compiles into the loss's graph. Its matmuls run BF16 too, its
    weights take no gradient and do not move, and the policy's gradient matches FP32's
    as closely as autocast's does."""
    torch.manual_seed(0)
    policy = TinyLM()
    reference = copy.deepcopy(policy).requires_grad_(False)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    frozen = copy.deepcopy(reference.state_dict())
    g = torch.Generator().manual_seed(1)
    chosen, rejected = torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g)

    def dpo(logits, chosen, rejected):
        with torch.no_grad():
            ref_logits = reference(torch.cat([chosen, rejected]))
        ids = torch.cat([chosen, rejected])
        margin = _sequence_logp(logits, ids) - _sequence_logp(ref_logits, ids)
        return -F.logsigmoid(0.1 * (margin[:2] - margin[2:])).mean()

    def policy_grads(model):
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    ref32, auto = copy.deepcopy(policy), copy.deepcopy(policy)
    dpo(ref32(torch.cat([chosen, rejected])), chosen, rejected).backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_auto = dpo(auto(torch.cat([chosen, rejected])), chosen, rejected)
    loss_auto.backward()
    rec = OpRecorder()
    step = make_train_step(
        policy,
        torch.optim.SGD(policy.parameters(), lr=0.1),
        dpo,
        dtype="bf16",
        grad_accum=2,
        compile_options={"inner": recording_backend(rec)},
    )
    step(torch.cat([chosen, rejected]), chosen, rejected)  # a micro-step: gradients kept
    # policy forward, reference forward, policy backward: 2 + 2 + 4 matmuls, all BF16
    low = [d for d in rec.dtypes_of(aten.mm, aten.addmm, aten.bmm) if d[:2] == [torch.bfloat16] * 2]
    assert len(low) >= 8
    assert all(p.grad is None for p in reference.parameters())
    cos_amp = cosine(policy_grads(policy), policy_grads(ref32))
    assert cos_amp >= cosine(policy_grads(auto), policy_grads(ref32)) - 1e-3 and cos_amp >= 0.999
    step(torch.cat([chosen, rejected]), chosen, rejected)  # the update
    assert all(torch.equal(frozen[k], v) for k, v in reference.state_dict().items())


def test_every_training_step_in_a_process_keeps_its_loss_compiled():
    """Each step compiles with a backend of its own: one shared frame would exhaust Dynamo's
    recompile limit at the ninth step and run the loss as written from then on."""
    ids = torch.randint(0, 64, (2, 8))
    for _ in range(torch._dynamo.config.recompile_limit + 1):
        model = TinyLM()
        step = make_train_step(
            model, torch.optim.SGD(model.parameters(), lr=0.1), lm_loss, dtype="bf16", compile_options=INNER
        )
        step(ids, ids)
    assert any(n.reason.startswith("loss") for n in step.backend.plan().nodes)


class EagerOnly(nn.Module):
    """A forward Dynamo does not compile (disabled, as a graph break it gives up on does to
    nn.Transformer with mismatched padding and attention masks)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    @torch.compiler.disable
    def forward(self, x):
        return self.fc(x)


@pytest.mark.parametrize("compile_loss", [True, False])
def test_a_model_dynamo_does_not_compile_is_refused_not_trained_in_fp32(compile_loss):
    """With the loss compiled beside the model, the loss alone makes a graph: the step must
    still see that no graph used the parameters, and refuse before anything is updated."""
    model = EagerOnly()
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    step = make_train_step(model, opt, F.cross_entropy, dtype="bf16", compile_loss=compile_loss)
    match = "only the loss was compiled" if compile_loss else "compiled no graph"
    with pytest.raises(RuntimeError, match=match):
        step(torch.randn(4, 8), torch.tensor([0, 1, 2, 3]))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not opt.state


class RoutedExperts(nn.Module):
    """Experts dispatched by a data-dependent torch.where inside a loop (Mixtral's
    pattern): Dynamo cannot resume inside the loop, so it runs the whole routing
    function eagerly; the embedding-side layer before it compiles."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.router = nn.Linear(8, 2)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 4)
        self.spare = nn.Linear(8, 8)  # built, never called (as a checkpoint's unused head)

    def route(self, h):
        chosen = self.router(h).argmax(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = torch.where(chosen == e)[0]
            out = out.index_add(0, rows, expert(h[rows]))
        return out

    def forward(self, x):
        return self.head(self.route(self.inp(x)))


def test_parameters_left_outside_every_graph_are_named_in_a_warning(caplog):
    """Training goes on (the eager part is right, in FP32), but the user is told which
    parameters got no 16-bit speed-up and why, once, at the first step."""
    torch.manual_seed(0)
    model = RoutedExperts()
    step = make_train_step(
        model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, dtype="bf16", compile_options=INNER
    )
    x, y = torch.randn(6, 8), torch.tensor([0, 1, 2, 3, 0, 1])
    with caplog.at_level(logging.WARNING, logger="amp_compiler"):
        step(x, y)
        step(x, y)
    warned = [r.getMessage() for r in caplog.records if "taken by no compiled graph" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "4 of 12 trainable parameters" in warned[0] and "experts.0.weight" in warned[0]
    # the router gets no gradient (argmax), the spare layer is never called: neither is named
    assert "inp." not in warned[0] and "head." not in warned[0] and "router." not in warned[0]
    assert "spare." not in warned[0]
    assert set(step.backend.coverage.parameters_outside(model)) == {
        f"{m}.{k}" for m in ("router", "experts.0", "experts.1", "spare") for k in ("weight", "bias")
    }


def test_a_fully_compiled_model_gets_no_outside_warning(caplog):
    model = TinyLM()
    step = make_train_step(
        model, torch.optim.SGD(model.parameters(), lr=0.1), lm_loss, dtype="bf16", compile_options=INNER
    )
    ids = torch.randint(0, 64, (2, 8))
    with caplog.at_level(logging.WARNING, logger="amp_compiler"):
        step(ids, ids)
    assert not [r for r in caplog.records if "taken by no compiled graph" in r.getMessage()]
    assert step.backend.coverage.parameters_outside(model) == []
