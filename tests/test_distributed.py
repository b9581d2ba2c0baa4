"""All ranks run one precision plan: two gloo ranks on this machine."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from amp_compiler.upstream import torch_minor

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, port, scenario, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        import amp_compiler
        from amp_compiler import device
        from amp_compiler.distributed import PrecisionMismatchError

        # a mixed fleet: rank 0 has BF16; rank 1 has FP16 only, or (scenario "auto-fp32")
        # no fast 16 bit at all
        rank1 = frozenset() if scenario == "auto-fp32" else frozenset({"fp16"})
        device.native_dtypes = lambda d: (frozenset({"bf16", "fp16"}) if rank == 0 else rank1, f"fake rank {rank}")
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        dtype = {"auto": "auto", "auto-fp32": "auto", "explicit": ("bf16", "fp16")[rank]}.get(scenario, "bf16")
        options = {"inner": "eager"}
        if scenario == "pins" and rank == 1:
            options["fp32_modules"] = ["^0$"]  # this rank alone pins the first Linear
        if scenario == "plans" and rank == 1:
            # the same settings, another plan (as another build of the op tables would make)
            from amp_compiler.policy import Policy

            build = Policy.build.__func__
            Policy.build = classmethod(lambda cls, low, **kw: build(cls, low, **{**kw, "fp32_ops": ("linear",)}))
        try:
            step = amp_compiler.make_train_step(
                model, opt, torch.nn.functional.mse_loss, dtype=dtype, compile_options=options
            )
            step(torch.randn(8, 4), torch.randn(8, 1))
            results[rank] = ("ok", step.dtype, step.dtype_reason, step.plan_fingerprint)
        except PrecisionMismatchError as e:
            results[rank] = ("mismatch", str(e))
    finally:
        dist.destroy_process_group()


def run(scenario):
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(_free_port(), scenario, results), nprocs=2, join=True)
    return dict(results)


def test_auto_dtype_agrees_across_ranks_fp16_when_any_rank_lacks_bf16():
    r = run("auto")
    assert r[0][0] == r[1][0] == "ok"
    assert r[0][1] == r[1][1] == "fp16"
    assert "rank 1 has no BF16" in r[0][2]
    assert r[0][3] == r[1][3]  # same plan fingerprint


def test_auto_dtype_agrees_on_fp32_when_any_rank_has_no_fast_16_bit():
    r = run("auto-fp32")
    assert r[0][0] == r[1][0] == "ok"
    assert r[0][1] == r[1][1] == "fp32"
    assert "rank 1 has no fast 16-bit" in r[0][2]


def test_explicit_different_dtypes_across_ranks_is_an_error():
    r = run("explicit")
    assert r[0][0] == r[1][0] == "mismatch"
    assert "rank 0: bf16, rank 1: fp16" in r[0][1]


def test_a_pin_on_one_rank_only_stops_every_rank_before_any_compile():
    r = run("pins")
    assert r[0][0] == r[1][0] == "mismatch" and r[0][1] == r[1][1]
    assert "fp32_modules: rank 0: (), rank 1: ('^0$',)" in r[0][1]


def test_different_plans_across_ranks_are_caught_at_the_first_step():
    r = run("plans")
    assert r[0][0] == r[1][0] == "mismatch"
    assert "ranks compiled different precision plans" in r[0][1]


def _ddp_worker(rank, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP

        import amp_compiler

        sent = []  # what gloo was handed to all-reduce: the evidence, not amp's own count
        all_reduce = dist.all_reduce

        def recording_all_reduce(tensor, *args, **kwargs):
            sent.append((tensor.dtype, tensor.numel()))
            return all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = recording_all_reduce  # the comm hooks call torch.distributed.all_reduce
        out = {}
        for comm in ("fp32", "bf16"):
            torch.manual_seed(0)
            model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
            step = amp_compiler.make_train_step(
                model,
                torch.optim.AdamW(model.parameters(), lr=1e-2),
                torch.nn.functional.mse_loss,
                config={"bf16": {"enabled": True}, "gradient_clipping": 1.0},  # DeepSpeed-style
                ddp_comm_dtype=comm,
                compile_options={"inner": "eager"},
            )
            assert step.dtype == "bf16" and step.max_grad_norm == 1.0
            g = torch.Generator().manual_seed(rank)
            x, y = torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)
            sent.clear()
            losses = [step(x, y).loss.item() for _ in range(5)]
            low = [n for n in step.backend.plan().nodes if n.precision == "LOW"]
            numel = sum(p.numel() for p in model.parameters())
            buckets = [dtype for dtype, n in sent if n == numel]  # one bucket holds every gradient
            out[comm] = (
                losses,
                (step.comm.bytes, buckets, step.comm.sent_dtypes),
                [p.detach().clone() for p in model.parameters()],
                all(p.dtype == torch.float32 for p in model.parameters()) and bool(low),
            )
        results[rank] = out
    finally:
        dist.destroy_process_group()


def test_ddp_gradients_all_reduced_in_bf16_half_the_bytes_same_loss_curve():
    """2-rank DDP configured by a DeepSpeed-style dict: the plan is applied inside DDP (a
    compiled DDP would run the module as written), the BF16 all-reduce moves half the bytes."""
    results = mp.Manager().dict()
    mp.spawn(_ddp_worker, args=(_free_port(), results), nprocs=2, join=True)
    for rank in (0, 1):
        (l32, (b32, wire32, said32), _, fp32_master), (l16, (b16, wire16, said16), _, fp32_master16) = (
            results[rank]["fp32"],
            results[rank]["bf16"],
        )
        # the hook's count of the tensors it handed the all-reduce, and gloo's own record
        assert b16 * 2 == b32 > 0 and said32 == {torch.float32} and said16 == {torch.bfloat16}
        # what crossed: one gradient bucket per step, FP32 as asked, then BF16 as asked
        assert wire32 == [torch.float32] * 5 and wire16 == [torch.bfloat16] * 5, (wire32, wire16)
        assert all(abs(a - b) <= 0.01 * abs(a) for a, b in zip(l32, l16)), (l32, l16)
        assert l16[-1] < l16[0] and fp32_master and fp32_master16
    # ranks hold the same parameters after the BF16 all-reduce
    for p, q in zip(results[0]["bf16"][2], results[1]["bf16"][2]):
        assert torch.equal(p, q)


def _fsdp_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


def _fsdp_batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 16, generator=g), 3 * torch.randn(16, 1, generator=g)) for _ in range(5)]


def _fsdp_worker(rank, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from helpers import OpRecorder, recording_backend
        from torch.distributed.fsdp import fully_shard

        import amp_compiler

        model = _fsdp_model()
        fully_shard(model[0])  # model[2], the head, is the root unit's own layer
        fully_shard(model)
        rec = OpRecorder()
        step = amp_compiler.make_train_step(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            torch.nn.functional.mse_loss,
            dtype="bf16",
            max_grad_norm=1.0,
            compile_options={"inner": recording_backend(rec)},
        )
        losses, skipped = [], []
        for i, (x, y) in enumerate(_fsdp_batches()):
            x, y = x[rank * 8 : (rank + 1) * 8], y[rank * 8 : (rank + 1) * 8]
            if i == 3 and rank == 1:
                y = y * float("inf")  # one rank's gradients go non-finite
            r = step(x, y)
            losses.append(r.loss.item())
            skipped.append(r.skipped)
        matmuls = rec.dtypes_of(torch.ops.aten.mm, torch.ops.aten.addmm)
        low = [c for c in matmuls if c[:2] == [torch.bfloat16] * 2]
        assert len(low) == len(matmuls) and len(rec.dtypes_of(torch.ops.aten.addmm)) == 2 * 5  # both layers
        results[rank] = (
            losses,
            skipped,
            [p.full_tensor().detach() for p in model.parameters()],
            len(low),
            {type(p).__name__ for p in model.parameters()},
            all(p.dtype == torch.float32 for p in model.parameters()),
        )
    finally:
        dist.destroy_process_group()


def test_fsdp2_trains_in_bf16_like_fp32_and_skips_an_inf_on_every_rank():
    """2 gloo ranks, fully_shard on the first Linear and at the root (whose own layer, the last
    Linear, is compiled apart from the inner unit): every matmul ran in BF16, parameters
    stay FP32 DTensors, the same steps are skipped everywhere (an Inf on rank 1 at step 3),
    and the result is single-process FP32 training's within 1%."""
    results = mp.Manager().dict()
    mp.spawn(_fsdp_worker, args=(_free_port(), results), nprocs=2, join=True)
    ref = _fsdp_model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = []
    for i, (x, y) in enumerate(_fsdp_batches()):
        loss0 = torch.nn.functional.mse_loss(ref(x[:8]), y[:8])
        ref_losses.append(loss0.item())
        if i == 3:
            continue  # the step both ranks skip
        opt.zero_grad()
        loss = (loss0 + torch.nn.functional.mse_loss(ref(x[8:]), y[8:])) / 2
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
    (l0, s0, p0, low0, kinds, fp32), (_, s1, p1, _, _, _) = results[0], results[1]
    assert s0 == s1 == [False, False, False, True, False]
    assert low0 > 0 and kinds == {"DTensor"} and fp32
    for a, b in zip(p0, p1):
        assert torch.equal(a, b)
    assert all(abs(a - b) <= 0.01 * abs(b) for a, b in zip(l0, ref_losses)), (l0, ref_losses)
    for a, b in zip(p0, ref.parameters()):
        assert (a - b).norm() <= 0.01 * b.norm()


def _fsdp_mp_worker(rank, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from helpers import OpRecorder, recording_backend
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

        import amp_compiler

        gathered, reduced = [0], []  # what FSDP handed its collectives: bytes gathered, dtypes reduced
        original, reduce_scatter = collectives.DefaultAllGather.__call__, collectives.DefaultReduceScatter.__call__

        def counting(self, *args, **kwargs):
            sent = kwargs["input_tensor"] if "input_tensor" in kwargs else args[1]
            gathered[0] += sent.numel() * sent.element_size()
            return original(self, *args, **kwargs)

        def recording(self, *args, **kwargs):
            reduced.append((kwargs["input_tensor"] if "input_tensor" in kwargs else args[1]).dtype)
            return reduce_scatter(self, *args, **kwargs)

        collectives.DefaultAllGather.__call__ = counting
        collectives.DefaultReduceScatter.__call__ = recording
        out = {}
        for name, mp in (
            ("fp32", None),
            (
                "bf16",
                MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False),
            ),
            (  # reduce_dtype left out: what docs/training.md says each torch then does
                "bf16-default",
                MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False),
            ),
            (  # BF16 gradient communication, asked for (seed rule 5: where asked)
                "bf16-reduce",
                MixedPrecisionPolicy(
                    param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, cast_forward_inputs=False
                ),
            ),
        ):
            gathered[0] = 0
            reduced.clear()
            model = _fsdp_model()
            for module in (model[0], model[2], model):
                fully_shard(module, **({"mp_policy": mp} if mp else {}))
            step = amp_compiler.make_train_step(
                model,
                torch.optim.AdamW(model.parameters(), lr=1e-2),
                torch.nn.functional.mse_loss,
                dtype="bf16",
                compile_options={"inner": recording_backend(rec := OpRecorder())},
            )
            x, y = _fsdp_batches()[0]
            losses = [step(x[rank * 8 : (rank + 1) * 8], y[rank * 8 : (rank + 1) * 8]).loss.item() for _ in range(3)]
            # what ran: each step's casts down to BF16 and its GEMMs' operand dtypes
            casts = sum(to == torch.bfloat16 for _, to in rec.casts) // 3
            gemms = {tuple(d[-2:]) for d in rec.dtypes_of(torch.ops.aten.mm, torch.ops.aten.addmm)}
            out[name] = (gathered[0], losses, (casts, gemms), sorted(set(reduced), key=str))
        results[rank] = out
    finally:
        dist.destroy_process_group()


def test_fsdp2_mixed_precision_policy_owns_the_weight_cast_and_halves_the_all_gather():
    """MixedPrecisionPolicy(param_dtype=bf16, cast_forward_inputs=False): parameters arrive
    in BF16, the plan casts only the activations (no second weight cast) and still keeps its
    FP32 islands; the all-gathers move half the bytes; the losses match amp's own casts."""
    results = mp.Manager().dict()
    mp.spawn(_fsdp_mp_worker, args=(_free_port(), results), nprocs=2, join=True)
    (b32, l32, lin32, r32), (b16, l16, lin16, r16) = results[0]["fp32"], results[0]["bf16"]
    assert b16 * 2 == b32 > 0
    # gradients reduce-scattered in the dtype asked for, on every torch (2.15 changed the default)
    assert r32 == r16 == [torch.float32] and results[0]["bf16-reduce"][3] == [torch.bfloat16]
    assert results[1]["bf16-reduce"][3] == [torch.bfloat16] and results[1]["bf16"][3] == [torch.float32]
    default = torch.bfloat16 if torch_minor() < (2, 15) else torch.float32  # param_dtype, then the grads' own
    assert results[0]["bf16-default"][3] == results[1]["bf16-default"][3] == [default]
    # both run their GEMMs in BF16; amp casts activation, weight and bias of each of the two
    # Linears where parameters arrive FP32, the activations alone where FSDP gathered BF16
    (casts32, gemms32), (casts16, gemms16) = lin32, lin16
    assert gemms32 == gemms16 == {(torch.bfloat16, torch.bfloat16)}
    assert casts16 < casts32, (casts16, casts32)
    assert all(abs(a - b) <= 0.01 * abs(a) for a, b in zip(l32, l16)), (l32, l16)


def _head_worker(rank, port, wrap, results):
    """A decoder computing its own loss (as a Hugging Face model given labels does: under DDP
    and FSDP2 the training step compiles the forwards inside the wrapper, the loss outside),
    2 ranks: DDP, or FSDP2 with every weight, the head's too, sharded in one unit."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from helpers import OpRecorder, TinyDecoder, causal_batch, recording_backend

        import amp_compiler

        torch.manual_seed(0)
        model = TinyDecoder()
        if wrap == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            fully_shard(model)
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(model)
        rec = OpRecorder()
        # loss_head="auto" weighs the logits against the memory: rank 0's alone would fuse
        # them (1 MiB), rank 1's alone would not (1 TiB); the ranks agree on the smallest
        amp_compiler.distributed.memory_bytes = lambda device: 1 << (20 if rank == 0 else 40)
        step = amp_compiler.make_train_step(
            model,
            torch.optim.AdamW(model.parameters(), lr=3e-3),
            lambda loss: loss,
            dtype="bf16",
            compile_options={"inner": recording_backend(rec)},
        )
        ids, labels = causal_batch(seed=rank)
        losses = [step((ids, labels)).loss.item() for _ in range(4)]
        params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
        results[rank] = (
            losses,
            [d[:2] for d in rec.dtypes_of(torch.ops.amp.head_stats)],
            [p.detach().clone() for p in params],
            {type(p).__name__ for p in model.parameters()},
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_fused_loss_head_under_ddp_and_fsdp2(wrap):
    """Each rank runs the fused head on 16-bit inputs (FSDP2: the head's sharded weight
    gathered first), by one choice although their memory differs; the loss falls; ranks end
    with the same parameters."""
    results = mp.Manager().dict()
    mp.spawn(_head_worker, args=(_free_port(), wrap, results), nprocs=2, join=True)
    for rank in (0, 1):
        losses, heads, _, kinds = results[rank]
        assert heads and all(h == [torch.bfloat16, torch.float32] for h in heads)
        assert losses[-1] < losses[0]
        assert ("DTensor" in kinds) == (wrap == "fsdp2")
    for p, q in zip(results[0][2], results[1][2]):
        assert torch.equal(p, q)


def _inner_a(gm, example_inputs):
    return gm


def _inner_b(gm, example_inputs):
    return gm


def test_the_settings_ranks_compare_say_what_runs():
    """What every rank compares: the inner compiler by what it is (two functions differ; each
    rank's own recorder object of one class does not), pins, not where output goes."""
    from helpers import OpRecorder, recording_backend

    from amp_compiler.training_setup import TrainingSetup

    def settings(**options):
        setup = TrainingSetup("make_train_step", dtype="bf16", options=options)
        return setup.start(torch.nn.Linear(2, 2), "cpu").settings()

    assert settings(inner=_inner_a) != settings(inner=_inner_b)
    assert settings(inner=recording_backend(OpRecorder())) == settings(inner=recording_backend(OpRecorder()))
    assert settings(fp32_modules=["x"]) != settings() == settings(dump_dir="elsewhere")
