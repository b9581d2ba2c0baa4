"""Fixtures and pytest hooks; the helpers tests import live in ``helpers.py``."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import amp_compiler.device

_REAL_NATIVE = amp_compiler.device.native_dtypes  # before any test replaces it


def pytest_collection_modifyitems(config, items):
    """``slow`` tests run only when asked for (``-m slow``): the default suite stays quick."""
    if "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="compile-heavy: run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts): one worker per core, at most 4 (each holds its own
    torch, transformers and compile caches)."""
    return max(1, min(4, os.cpu_count() or 1))


def pytest_configure(config):
    """Under pytest-xdist (``-n N``) the workers share the cores: each takes its share of
    intra-op threads instead of all of them (oversubscribed OpenMP threads spin)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.fixture(autouse=True)
def _cpu_as_native_bf16(monkeypatch):
    """The suite tests the same program on either CPU kind: ``dtype="auto"`` (the default)
    resolves as on a CPU with native BF16, also where BF16 is emulated (the 16-bit path is
    then exercised, slower, instead of the FP32 one). Tests of the decision itself replace
    ``native_dtypes`` again; subprocesses see the real machine (``real_machine``)."""

    def native(device):
        found, about = _REAL_NATIVE(device)
        if device.type == "cpu" and "bf16" not in found:
            return found | {"bf16"}, f"CPU taken as native BF16 by the tests ({about})"
        return found, about

    monkeypatch.setattr(amp_compiler.device, "native_dtypes", native)


@pytest.fixture
def real_machine(monkeypatch):
    """The machine's own ``native_dtypes``, for a test that compares with a subprocess."""
    monkeypatch.setattr(amp_compiler.device, "native_dtypes", _REAL_NATIVE)


@pytest.fixture
def no_caches():
    """Inductor's FX and AOT caches off: a cached graph would skip amp's Inductor passes.
    (``config.patch``: monkeypatch's undo would delete the config entries.)"""
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield


@pytest.fixture
def gradient_flow_runs(monkeypatch):
    """The results of every gradient-flow run (the backend's check runs it on the graph as
    written and as rewritten), so a test can see the check ran rather than was skipped."""
    from amp_compiler.passes import gradient_flow as faithful

    ran, real = [], faithful.gradient_flow
    monkeypatch.setattr(faithful, "gradient_flow", lambda *a: ran.append(real(*a)) or ran[-1])
    with torch._inductor.config.patch(force_disable_caches=True):  # no check remembered from a run before
        yield ran


@pytest.fixture(autouse=True)
def _no_plan_cache(monkeypatch):
    """Plans are not remembered from test to test: several tests patch amp's tables or passes
    in process, which a cache keyed by amp's source files cannot see (test_plan_cache.py
    turns it on)."""
    monkeypatch.setenv("AMP_COMPILER_PLAN_CACHE", "0")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _one_time_warnings_afresh():
    """What amp warns once a process is warned afresh in each test: a test asserting a warning
    must not depend on whether an earlier test in its worker already drew it."""
    from amp_compiler import device, policy_file
    from amp_compiler.loss_head import ops

    device._warned.clear()
    policy_file._warned.clear()
    ops._warn_recomputed.cache_clear()


@pytest.fixture(autouse=True)
def _fresh_accelerate():
    """Accelerate keeps one process-wide state that refuses another mixed precision once set
    (a Trainer sets it): each test starts without it, whatever ran before in its worker."""
    yield
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture
def inductor_recorded(monkeypatch):
    """Ops executed by every graph the amp backend hands to its default inner compiler:
    Inductor stands aside for a recording aot_eager, so a test sees what ran, op by op."""
    from helpers import OpRecorder, recording_backend

    import amp_compiler.backend

    rec, real = OpRecorder(), amp_compiler.backend.inner_compiler

    def inner(name, mode, budget):
        return recording_backend(rec) if name == "inductor" else real(name, mode, budget)

    monkeypatch.setattr(amp_compiler.backend, "inner_compiler", inner)
    return rec


@pytest.fixture
def amp_log():
    """What amp's own logger says at WARNING and above during the test: a handler the test
    owns, on ``amp_compiler``, so torch's and other libraries' warnings (which differ by
    release and by the tests that ran before in the worker) never count."""
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("amp_compiler")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(min(level or logging.WARNING, logging.WARNING))
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
