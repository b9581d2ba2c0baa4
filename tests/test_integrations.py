"""Hugging Face Trainer: AmpCallback compiles with the amp backend, logs the plan, scales FP16,
refuses the flags that would stack a second precision system on ours."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from helpers import NormHead, OpRecorder, cosine, grads, recording_backend, tiny_gpt2, two_ranks  # noqa: E402

import amp_compiler.device  # noqa: E402
from amp_compiler.integrations.transformers import AmpCallback  # noqa: E402

aten = torch.ops.aten


class Ids(torch.utils.data.Dataset):
    def __init__(self, n=16, t=16, vocab=96):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, vocab, (n, t), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def gpt2():
    return tiny_gpt2(seed=0)


def args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    return transformers.TrainingArguments(**{**base, **kw})


def test_trainer_trains_through_amp_with_bf16_matmuls_and_logs_the_plan(tmp_path):
    rec = OpRecorder()
    cb = AmpCallback("bf16", inner=recording_backend(rec))
    model = gpt2()
    trainer = transformers.Trainer(model=model, args=args(tmp_path), train_dataset=Ids(), callbacks=[cb])
    trainer.train()
    history = trainer.state.log_history
    losses = [h["loss"] for h in history if "loss" in h]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert any("amp_plan" in h and "bf16" in h["amp_plan"] for h in history)
    ran = rec.dtypes_of(aten.mm, aten.addmm, aten.bmm)
    assert ran and all(c[:2] == [torch.bfloat16] * 2 for c in ran), "a matmul executed in FP32"
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_trainer_default_is_fp32_where_16_bit_is_emulated(tmp_path, monkeypatch):
    """AmpCallback() on a CPU that only emulates BF16/FP16: FP32 (no scaler), nothing runs in
    16 bit, and the logged plan says why once."""
    monkeypatch.setattr(amp_compiler.device, "native_dtypes", lambda device: (frozenset(), "fake CPU emulating 16 bit"))
    rec = OpRecorder()
    cb = AmpCallback(inner=recording_backend(rec))
    trainer = transformers.Trainer(model=gpt2(), args=args(tmp_path, max_steps=2), train_dataset=Ids(), callbacks=[cb])
    trainer.train()
    assert cb.dtype == "fp32" and cb.scaler is None
    assert "fake CPU emulating 16 bit" in cb.reason
    logged = [h["amp_plan"] for h in trainer.state.log_history if "amp_plan" in h]
    assert len(logged) == 1 and logged[0].startswith("fp32:")
    assert logged[0].count("fake CPU emulating 16 bit") == 1, logged[0]
    assert not any(g.applied for g in cb.plan().graphs)
    ran = rec.dtypes_of(aten.mm, aten.addmm, aten.bmm)
    assert ran and all(torch.float32 in c and torch.bfloat16 not in c for c in ran), ran


class EagerLM(nn.Module):
    """All of its compute in a function Dynamo is told not to compile (as a graph break it
    gives up on leaves a model's forward)."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(96, 16), nn.Linear(16, 96)

    def forward(self, input_ids, labels):
        return {"loss": _eager_loss(self, input_ids, labels)}


@torch.compiler.disable
def _eager_loss(model, ids, labels):
    return nn.functional.cross_entropy(model.head(model.emb(ids)).flatten(0, 1), labels.flatten())


def test_trainer_refuses_a_model_dynamo_does_not_compile(tmp_path):
    """Under the callback such a model would train in FP32: the first optimizer step is
    refused instead, before any parameter moves."""
    model = EagerLM()
    before = copy.deepcopy(model.state_dict())
    trainer = transformers.Trainer(
        model=model, args=args(tmp_path), train_dataset=Ids(), callbacks=[AmpCallback("bf16", inner="aot_eager")]
    )
    with pytest.raises(RuntimeError, match=r"AmpCallback: 100\.0% of the model's matmul/conv weight .*: head\."):
        trainer.train()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_trainer_torch_compile_flag_is_refused(tmp_path):
    """torch_compile=True would compile the model a second time, with Inductor alone."""
    with pytest.raises(ValueError, match=r"TrainingArguments\(torch_compile=True\)"):
        transformers.Trainer(
            model=gpt2(), args=args(tmp_path, torch_compile=True), train_dataset=Ids(), callbacks=[AmpCallback()]
        )


def _autocast_seen(model) -> list[bool]:
    """Whether torch.autocast was on at each call of ``model`` (a forward pre-hook)."""
    seen = []
    model.register_forward_pre_hook(lambda m, a: seen.append(torch.is_autocast_enabled("cpu")))
    return seen


@pytest.mark.parametrize("flag", ["bf16", "fp16"])
def test_trainer_precision_flag_is_the_dtype_request_and_its_autocast_stands_aside(tmp_path, flag):
    """bf16=True / fp16=True ask for that dtype; Accelerate's autocast and GradScaler are off, so
    amp's plan alone runs: matmuls 16 bit, softmax and norms FP32, no autocast around the call."""
    rec = OpRecorder()
    cb = AmpCallback(inner=recording_backend(rec))
    model = gpt2()
    autocast = _autocast_seen(model)
    trainer = transformers.Trainer(
        model=model, args=args(tmp_path, **{flag: True}), train_dataset=Ids(), callbacks=[cb]
    )
    assert trainer.accelerator.native_amp is False and trainer.accelerator.scaler is None
    trainer.train()
    low = torch.bfloat16 if flag == "bf16" else torch.float16
    assert cb.dtype == flag and f"TrainingArguments({flag}=True)" in cb.reason
    matmuls = rec.dtypes_of(aten.mm, aten.addmm, aten.bmm)
    assert matmuls and all(d[0] == low for d in matmuls)
    fp32 = rec.dtypes_of(aten._softmax, aten.native_layer_norm)
    assert fp32 and all(d[0] == torch.float32 for d in fp32)
    assert autocast and not any(autocast)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert (cb.scaler is not None) == (flag == "fp16")  # amp's own scaling, not the Trainer's
    assert "forwards under the plan: model" in trainer.state.log_history[0]["amp_plan"]


def test_trainer_explicit_dtype_that_disagrees_with_the_flag_is_refused(tmp_path):
    """AmpCallback(dtype=...) and the Trainer's flag must agree: one clear error, before training."""
    with pytest.raises(ValueError, match=r"AmpCallback\(dtype='fp16'\) disagrees with TrainingArguments\(bf16=True\)"):
        transformers.Trainer(
            model=gpt2(), args=args(tmp_path, bf16=True), train_dataset=Ids(), callbacks=[AmpCallback("fp16")]
        )


class Regression(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x, y):
        return {"loss": nn.functional.mse_loss(self.b(torch.relu(self.a(x))), y)}


def test_fp16_scaling_hooks_leave_true_gradients_and_skip_on_inf():
    """The loss's gradient is scaled into backward and divided out per parameter, so the
    Trainer's clipping and optimizer see true gradients; Inf/NaN drops the step."""
    torch.manual_seed(0)
    model = Regression()
    ref = copy.deepcopy(model)
    cb = AmpCallback("fp16", inner="aot_eager")
    cb.on_train_begin(None, None, None, model=model)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    model(x, y)["loss"].backward()
    ref(x, y)["loss"].backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=1e-4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cb.on_pre_optimizer_step(None, None, None, model=model, optimizer=opt)
    assert cb.skipped_steps == 0 and cb.scaler.get_scale() == 2.0**16
    opt.zero_grad()
    model(x, y * float("inf"))["loss"].backward()
    cb.on_pre_optimizer_step(None, None, None, model=model, optimizer=opt)
    assert cb.skipped_steps == 1 and cb.scaler.get_scale() == 2.0**15
    assert all(p.grad is None for p in model.parameters())
    logs = {}
    cb.on_log(None, None, None, logs=logs)
    assert logs["amp_loss_scale"] == 2.0**15 and logs["amp_skipped_steps"] == 1


def test_fp16_dropped_steps_do_not_advance_the_trainers_lr_schedule(tmp_path):
    """A loss scale far too large overflows the first steps, which amp drops; the Trainer's
    linear decay advances only on the steps that ran (as under the Trainer's own fp16),
    so the logged learning rates are the schedule at (steps taken - steps dropped)."""
    cb = AmpCallback(config={"fp16": {"enabled": True, "initial_scale_power": 20, "hysteresis": 1}}, inner="aot_eager")
    trainer = transformers.Trainer(
        model=gpt2(),
        args=args(tmp_path, max_steps=6, learning_rate=1e-3, lr_scheduler_type="linear"),
        train_dataset=Ids(n=24),
        callbacks=[cb],
    )
    trainer.train()
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    skipped = [h["amp_skipped_steps"] for h in trainer.state.log_history if "learning_rate" in h]
    assert 0 < cb.skipped_steps < 6, cb.skipped_steps
    # the Trainer logs the rate of each optimizer step (before its scheduler step): linear
    # decay from 1e-3 over 6 steps, advanced once per step before this one that ran
    advanced = [step - (skipped[step - 1] if step else 0) for step in range(len(lrs))]
    assert lrs == pytest.approx([1e-3 * (1 - k / 6) for k in advanced]), (lrs, skipped)


def _trainer_worker(rank, port, out_dir, results):
    import os

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2"
    )
    try:
        # the memory the loss head's choice weighs differs by rank; the ranks agree on the least
        import amp_compiler.distributed

        amp_compiler.distributed.memory_bytes = lambda device: 1 << (20 if rank == 0 else 40)
        # aot_eager under a recorder: what each rank executed; Inductor's code is tested elsewhere
        rec = OpRecorder()
        cb = AmpCallback(config={"bf16": {"enabled": True}}, inner=recording_backend(rec))
        model = gpt2()
        trainer = transformers.Trainer(
            model=model, args=args(out_dir, max_steps=4, learning_rate=5e-3), train_dataset=Ids(), callbacks=[cb]
        )
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        results[rank] = (
            losses,
            rec.dtypes_of(aten.mm, aten.addmm, aten.bmm),
            [p.detach().clone() for p in model.parameters()][:3],
            all(p.dtype == torch.float32 for p in model.parameters()),
            cb.backend.options.memory_bytes,
        )
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def test_trainer_with_two_processes_trains_one_plan(tmp_path):
    """Two gloo processes under the Trainer (Accelerate's DDP) with a config-built GPT-2 and a
    DeepSpeed-style config: the plan is applied, the loss falls, the ranks stay identical and
    weigh the loss head against one memory."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_trainer_worker, args=(port, tmp_path, results), nprocs=2, join=True)
    (l0, gemms0, p0, fp32, mem0), (_, gemms1, p1, _, mem1) = results[0], results[1]
    for gemms in (gemms0, gemms1):  # every rank's GEMMs ran in BF16, forward and backward
        assert gemms and all(d[-2:] == [torch.bfloat16] * 2 for d in gemms), gemms
    assert fp32 and l0[-1] < l0[0]
    assert mem0 == mem1 == 1 << 20  # one choice of loss head on every rank
    for a, b in zip(p0, p1):
        assert torch.equal(a, b)


def _set_up_differently(rank, out_dir):
    """Each way two ranks' amp settings can differ under the Trainer, one Trainer after another
    in the same two processes: what each raised, the steps it took, whether any parameter moved."""
    from amp_compiler import PrecisionMismatchError

    said = {}
    for scenario in ("dtype", "pin", "flag"):
        flags, options = {}, {"inner": "aot_eager"}
        if scenario == "dtype":
            options["dtype"] = ("bf16", "fp16")[rank]
        elif scenario == "pin":
            options.update(dtype="bf16", **({"fp32_modules": ["lm_head"]} if rank else {}))
        else:  # the Trainer's own flag, read as the dtype request
            flags[("bf16", "fp16")[rank]] = True
        model = gpt2()
        before = [p.detach().clone() for p in model.parameters()]
        callback = AmpCallback(**options)
        trainer = transformers.Trainer(
            model=model, args=args(out_dir, max_steps=2, **flags), train_dataset=Ids(), callbacks=[callback]
        )
        try:
            trainer.train()
            error = None
        except PrecisionMismatchError as e:
            error = str(e)
        moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        said[scenario] = (error, trainer.state.global_step, moved)
    return said


def test_trainer_ranks_set_up_differently_stop_before_any_update(tmp_path):
    """Two ranks launched as torchrun launches them, each with its own AmpCallback: a dtype, a
    pin on one rank only, the Trainer's bf16 flag against its fp16: every rank stops before
    the first step with the same message, naming what differs; no parameter moves. (The
    ranks that agree train identically: test_trainer_with_two_processes_trains_one_plan.)"""
    ranks = two_ranks(_set_up_differently, str(tmp_path))
    names = {"dtype": "rank 0: bf16, rank 1: fp16", "pin": "fp32_modules: rank 0: (), rank 1: ('lm_head',)"}
    names["flag"] = names["dtype"]
    for scenario, named in names.items():
        (error0, steps0, moved0), (error1, steps1, moved1) = ranks[0][scenario], ranks[1][scenario]
        assert error0 == error1 and named in error0, scenario
        assert steps0 == steps1 == 0 and not moved0 and not moved1, scenario


def test_accelerate_mixed_precision_around_the_amp_backend_trains():
    """Accelerate's mixed_precision="bf16" wraps forward in torch.autocast: a user who keeps it
    and compiles with amp gets a compiled BF16 step (it used to fail amp's plan check)."""
    import torch.nn.functional as F
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from amp_compiler import AmpBackend

    torch.manual_seed(0)
    model = NormHead()
    ref = copy.deepcopy(model)
    rec = OpRecorder()
    backend = AmpBackend(inner=recording_backend(rec))
    # Accelerate keeps one process-wide state; a Trainer earlier in the suite set it up
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        accelerator = Accelerator(mixed_precision="bf16", cpu=True)
        compiled = accelerator.prepare(torch.compile(model, backend=backend))
        x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
        accelerator.backward(F.cross_entropy(compiled(x), y))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    F.cross_entropy(ref(x), y).backward()
    record = backend.records[0]
    assert record.dtype == "bf16" and record.plan.applied and "torch.autocast(cpu, bf16)" in record.dtype_reason
    assert rec.dtypes_of(torch.ops.aten.addmm) and all(
        set(d) == {torch.bfloat16} for d in rec.dtypes_of(torch.ops.aten.addmm, torch.ops.aten.mm)
    )
    assert cosine(grads(model), grads(ref)) > 0.999
