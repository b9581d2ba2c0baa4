"""All ranks run one precision plan: two gloo ranks on this machine."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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
        device.native_dtypes = lambda d: (frozenset({"bf16", "fp16"}) if rank == 0 else rank1,
                                          f"fake rank {rank}")
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        dtype = {"auto": "auto", "auto-fp32": "auto", "pins": "bf16"}.get(
            scenario, "bf16" if rank == 0 else "fp16")
        options = {"inner": "eager"}
        if scenario == "pins" and rank == 1:
            options["fp32_modules"] = ["^0$"]  # this rank alone pins the first Linear
        try:
            step = amp_compiler.make_train_step(model, opt, torch.nn.functional.mse_loss,
                                                dtype=dtype, compile_options=options)
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


def test_different_plans_across_ranks_are_caught_at_the_first_step():
    r = run("pins")
    assert r[0][0] == r[1][0] == "mismatch"
    assert "ranks compiled different precision plans" in r[0][1]
