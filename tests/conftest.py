"""Shared test helpers: a recording inner backend and small models."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import amp_compiler.device

aten = torch.ops.aten
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
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield


@pytest.fixture
def gradient_flow_runs(monkeypatch):
    """The results of every gradient-flow run (the backend's check runs it on the graph as
    written and as rewritten), so a test can see the check ran rather than was skipped."""
    from amp_compiler.passes import faithful

    ran, real = [], faithful.gradient_flow
    monkeypatch.setattr(faithful, "gradient_flow", lambda *a: ran.append(real(*a)) or ran[-1])
    return ran


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


class OpRecorder(TorchDispatchMode):
    """Records (op packet, floating input dtypes) of every ATen op executed."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[object, list[torch.dtype]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.record(func.overloadpacket, args, kwargs)
        return func(*args, **kwargs)

    def record(self, op, args, kwargs) -> None:
        self.calls.append((op, [a.dtype for a in tree_leaves((args, kwargs))
                                if isinstance(a, torch.Tensor) and a.is_floating_point()]))

    def dtypes_of(self, *packets) -> list[list[torch.dtype]]:
        return [d for p, d in self.calls if p in packets]


def recording_backend(recorder: OpRecorder, graphs: list | None = None, partition_fn=None):
    """aot_eager, with forward and backward executed under ``recorder``.

    Also keeps the graphs the amp backend handed over in ``graphs``;
    ``partition_fn`` replaces AOTAutograd's default partitioner.
    """
    from torch._dynamo.backends.common import aot_autograd

    def run_recorded(gm, example_inputs):
        def run(args):
            with recorder:
                return gm(*args)

        run._boxed_call = True
        return run

    aot = aot_autograd(fw_compiler=run_recorded, bw_compiler=run_recorded,
                       **({"partition_fn": partition_fn} if partition_fn else {}))

    def inner(gm, example_inputs):
        if graphs is not None:
            graphs.append(gm)
        return aot(gm, example_inputs)

    return inner


class MLP(nn.Module):
    def __init__(self, d=16, hidden=32, out=4):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, out)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class NormHead(nn.Module):
    """Linear -> GELU -> LayerNorm -> Linear: torch.autocast sends the LayerNorm to FP32 too."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 10))

    def forward(self, x):
        return self.net(x)


class Attention(nn.Module):
    """Pre-LN transformer block; explicit softmax attention or SDPA."""

    def __init__(self, d=32, heads=4, sdpa=False):
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        if self.sdpa:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            s = (q @ k.transpose(-2, -1)) / (d // self.heads) ** 0.5
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            a = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1) @ v
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=64, d=32, layers=2, sdpa=False, tied=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Attention(d, sdpa=sdpa) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight

    def forward(self, ids, labels=None):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class ConvNet(nn.Module):
    def __init__(self, classes=4):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        return self.head(self.features(x))


def grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.double(), b.double(), dim=0).item()


def cli_here(capsys, *args) -> tuple[int, str, str]:
    """A CLI command in this process: (exit code, stdout, stderr). For a test's further
    commands once a subprocess has shown the entry point (start-up and imports are most of
    a small command's time)."""
    from amp_compiler.cli import main

    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as e:  # argparse: --help (0) and usage errors (2)
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err
