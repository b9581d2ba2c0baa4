"""The loss compiled with the model: it reaches the code generator in FP32, keeps keyword inputs,
graph breaks and module pins, and trains as the loss run as written."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import OpRecorder, ShiftLM, cosine, lm_loss, recording_backend

from amp_compiler import make_train_step

aten = torch.ops.aten
INNER = {"inner": "aot_eager"}


LOSS_OPS = (aten._log_softmax, aten._log_softmax_backward_data, aten.nll_loss_forward, aten.nll_loss_backward)


def _lm_steps(compile_loss, loss_fn=lm_loss, inputs=lambda ids: ids, n=3):
    """n steps of ShiftLM; ``rec`` saw every op the compiled graphs executed."""
    torch.manual_seed(0)
    model, rec = ShiftLM(), OpRecorder()
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
    model = ShiftLM()
    step = make_train_step(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        lm_loss,
        dtype="bf16",
        compile_options={"inner": recording_backend(rec := OpRecorder()), "fp32_modules": [r"^body\.0$"]},
    )
    ids = torch.randint(0, 64, (2, 8))
    step(ids, ids)
    linears = {n.module: n.precision for n in step.backend.plan().nodes if "linear" in n.op}
    assert linears == {"body.0": "FP32", "head": "LOW"}
    # what ran: body.0's GEMMs (16 x 16 weight) in FP32, the head's (64 wide) in BF16
    gemms = (torch.ops.aten.addmm, torch.ops.aten.mm)
    body = rec.dtypes_where(gemms, lambda shapes: not any(64 in s for s in shapes))
    head = rec.dtypes_where(gemms, lambda shapes: any(64 in s for s in shapes))
    assert len(body) >= 2 and all(set(d) == {torch.float32} for d in body), body
    assert len(head) == 3 and all(d[-2:] == [torch.bfloat16] * 2 for d in head), head  # the operands


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
    runs, ran = {}, {}
    for compile_loss in (True, False):
        torch.manual_seed(0)
        model, rec = ShiftLM(), OpRecorder()
        step = make_train_step(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            LOSSES[loss],
            dtype=dtype,
            compile_loss=compile_loss,
            compile_options={"inner": recording_backend(rec)},
        )
        ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
        losses = [step(ids, torch.roll(ids, -1, 1)).loss.item() for _ in range(3)]
        runs[compile_loss] = losses, [p.detach().clone() for p in model.parameters()]
        ran[compile_loss] = {op for op, _ in rec.calls}
        plan = step.backend.plan()
        assert not any(g.unknown_ops for g in plan.graphs), [g.unknown_ops for g in plan.graphs]
    # the loss's own ops executed inside the compiled graph, and only where it was compiled
    assert ran[True] > ran[False], ran[True] - ran[False]
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
    policy = ShiftLM()
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
        model, rec = ShiftLM(), OpRecorder()
        step = make_train_step(
            model, torch.optim.SGD(model.parameters(), lr=0.1), lm_loss, dtype="bf16",
            compile_options={"inner": recording_backend(rec)},
        )  # fmt: skip
        step(ids, ids)
    loss_ops = rec.dtypes_of(*LOSS_OPS)  # the last step's loss ran in its compiled graph, in FP32
    assert loss_ops and all(set(d) == {torch.float32} for d in loss_ops)
