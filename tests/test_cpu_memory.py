"""Reusing freed CPU memory: the allocator really stops mapping afresh (a child process, by its
page faults), the user's own allocator settings stand, and the training step decides as
documented (a fake glibc records what it was asked)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
from helpers import FakeGlibc, tiny_gpt2

from amp_compiler import cpu_memory, make_train_step
from amp_compiler.cpu_memory import MemoryReuse, reuse_freed_memory, reuse_if_remapping

linux_glibc = pytest.mark.skipif(cpu_memory._libc()[0] is None, reason="needs glibc")

CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    from amp_compiler.cpu_memory import fresh_bytes, reuse_freed_memory
    if sys.argv[1] == "reuse":
        assert reuse_freed_memory().applied
    fresh = []
    for _ in range(10):
        before = fresh_bytes()
        x = torch.empty(256 * 2**20, dtype=torch.uint8)
        x.fill_(1)
        del x
        fresh.append((fresh_bytes() - before) >> 20)
    print(json.dumps(fresh))
    """
)


def _mapped_per_iteration(mode: str) -> list[int]:
    # its own process: the setting is process-wide and would stay with this test worker
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@linux_glibc
def test_freed_blocks_are_reused_instead_of_mapped_afresh(monkeypatch):
    for name in cpu_memory._USER_ENV + ("GLIBC_TUNABLES",):
        monkeypatch.delenv(name, raising=False)
    plain, reused = _mapped_per_iteration("plain"), _mapped_per_iteration("reuse")
    assert all(mib >= 200 for mib in plain), plain  # glibc maps every 256 MiB block afresh
    # a block or two more while the heap grows to fit the aligned request, then none
    assert all(mib < 16 for mib in reused[-5:]), reused


@pytest.fixture
def libc(monkeypatch):
    fake = FakeGlibc()
    monkeypatch.setattr(cpu_memory, "_libc", lambda: (fake, "glibc 2.x"))
    monkeypatch.setattr(cpu_memory, "_applied", None)
    for name in cpu_memory._USER_ENV + ("GLIBC_TUNABLES", "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    return fake


def test_applies_both_thresholds_once(libc):
    first = reuse_freed_memory()
    assert first.applied and "glibc 2.x" in first.reason
    assert libc.calls == [(-3, 2**31 - 1), (-1, 2**31 - 1)]
    assert reuse_freed_memory() is first and len(libc.calls) == 2


@pytest.mark.parametrize(
    "name, value, said",
    [
        ("MALLOC_MMAP_THRESHOLD_", "1048576", "MALLOC_MMAP_THRESHOLD_"),
        ("MALLOC_TRIM_THRESHOLD_", "0", "MALLOC_TRIM_THRESHOLD_"),
        ("GLIBC_TUNABLES", "glibc.malloc.arena_max=2", "GLIBC_TUNABLES"),
        ("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "jemalloc"),
    ],
)
def test_the_users_own_allocator_settings_stand(libc, monkeypatch, name, value, said):
    monkeypatch.setenv(name, value)
    result = reuse_freed_memory()
    assert not result.applied and said in result.reason
    assert libc.calls == []


def test_no_glibc_or_a_refusal_changes_nothing(libc, monkeypatch):
    libc.answer = 0
    refused = reuse_freed_memory()
    assert not refused.applied and "refused" in refused.reason
    assert cpu_memory._applied is None  # a later call may try again
    monkeypatch.setattr(cpu_memory, "_libc", lambda: (None, "the C library is not glibc"))
    assert reuse_freed_memory() == MemoryReuse(False, "the C library is not glibc")


def test_the_rule_needs_fresh_pages_and_room(libc, monkeypatch):
    small = reuse_if_remapping(cpu_memory.FRESH_PER_STEP - 1)
    assert not small.applied and "nothing to save" in small.reason and libc.calls == []
    monkeypatch.setattr(cpu_memory, "room_bytes", lambda: 2**30)
    monkeypatch.setattr(cpu_memory, "peak_rss_bytes", lambda: 2**31)
    tight = reuse_if_remapping(2**28)
    assert not tight.applied and "1024 MiB are free" in tight.reason and libc.calls == []
    monkeypatch.setattr(cpu_memory, "room_bytes", lambda: 2**32)
    done = reuse_if_remapping(2**28)
    assert done.applied and "256 MiB afresh" in done.reason and len(libc.calls) == 2


def _step(reuse=None, **kwargs):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    options = {"inner": "eager", "reuse_cpu_memory": reuse}
    return make_train_step(model, opt, lambda out, y: ((out - y) ** 2).mean(), compile_options=options, **kwargs)


def test_train_step_decides_on_the_call_after_the_first_update(libc, monkeypatch):
    monkeypatch.setattr(cpu_memory, "FRESH_PER_STEP", 0)  # any step qualifies
    monkeypatch.setattr(cpu_memory, "room_bytes", lambda: None)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    step = _step(grad_accum=2)
    # two calls to the first update (compiles, allocates the state); the third is measured
    for _ in range(3):
        step(x, y)
        assert step.memory_reuse is None and libc.calls == []
    step(x, y)  # decided as the next step begins
    assert step.memory_reuse.applied and len(libc.calls) == 2
    step(x, y)
    assert len(libc.calls) == 2


def test_train_step_true_applies_now_and_false_never(libc, monkeypatch):
    monkeypatch.setattr(cpu_memory, "FRESH_PER_STEP", 0)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    on = _step(True)
    assert on.memory_reuse.applied and len(libc.calls) == 2
    monkeypatch.setattr(cpu_memory, "_applied", None)
    libc.calls.clear()
    off = _step(False)
    for _ in range(3):
        off(x, y)
    assert off.memory_reuse == MemoryReuse(False, "reuse_cpu_memory=False") and libc.calls == []


def test_trainer_callback_decides_after_the_first_update(libc, monkeypatch, tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from amp_compiler.integrations.transformers import AmpCallback

    monkeypatch.setattr(cpu_memory, "FRESH_PER_STEP", 0)
    monkeypatch.setattr(cpu_memory, "room_bytes", lambda: None)
    model = tiny_gpt2(seed=0, vocab_size=64, n_positions=16, n_embd=16, n_layer=1)
    ids = torch.randint(0, 64, (8, 16))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=3,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    seen = []

    class Spy(transformers.TrainerCallback):  # what the callback had decided at each step's end
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(cb.memory_reuse)

    cb = AmpCallback("bf16", inner="eager")
    transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[cb, Spy()]).train()
    assert seen[:2] == [None, None] and seen[2].applied and len(libc.calls) == 2


def test_lightning_plugins_decide_after_the_first_update(libc, monkeypatch):
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.fabric import Fabric

    from amp_compiler.integrations.lightning import AmpFabricPrecision, AmpPrecision

    monkeypatch.setattr(cpu_memory, "FRESH_PER_STEP", 0)
    monkeypatch.setattr(cpu_memory, "room_bytes", lambda: None)

    class Regressor(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            return ((self.net(batch[0]) - batch[1]) ** 2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(16, 8), torch.randn(16, 1))
    plugin = AmpPrecision("bf16", inner="eager")
    pl.Trainer(
        max_steps=3, plugins=[plugin], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu",
    ).fit(Regressor(), torch.utils.data.DataLoader(data, batch_size=4))  # fmt: skip
    assert plugin.memory_reuse.applied and len(libc.calls) == 2  # the second step measured, decided at the third
    monkeypatch.setattr(cpu_memory, "_applied", None)
    libc.calls.clear()
    fabric_plugin = AmpFabricPrecision("bf16", inner="eager", reuse_cpu_memory=False)  # an option
    assert fabric_plugin.memory_reuse == MemoryReuse(False, "reuse_cpu_memory=False")
    fabric_plugin = AmpFabricPrecision("bf16", inner="eager")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[fabric_plugin])
    net = nn.Linear(8, 1)
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for i in range(3):
        fabric.backward(((model(data.tensors[0]) - data.tensors[1]) ** 2).mean())
        opt.step()
        opt.zero_grad()
        assert (fabric_plugin.memory_reuse is None) == (i < 2)
    assert fabric_plugin.memory_reuse.applied and len(libc.calls) == 2


def test_bare_backend_measures_its_first_training_graph(libc, monkeypatch):
    """torch.compile(backend="amp") owns no step: its first CPU training graph runs once a
    step; the stretch from its third call to its fourth is measured. An inference graph, and
    a backend a training loop owns, measure nothing."""
    from amp_compiler import AmpBackend

    monkeypatch.setattr(cpu_memory, "FRESH_PER_STEP", 0)
    monkeypatch.setattr(cpu_memory, "room_bytes", lambda: None)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    backend = AmpBackend(inner="eager")
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(4, 8)
    with torch.no_grad():
        for _ in range(5):
            compiled(x)
    assert backend.memory_reuse is None and libc.calls == []  # inference: not a step
    decided = []
    for _ in range(4):
        compiled(x).sum().backward()
        decided.append(backend.memory_reuse)
    assert decided[:3] == [None, None, None] and decided[3].applied and len(libc.calls) == 2
    owned = AmpBackend(inner="eager", owned=True)
    compiled = torch.compile(nn.Linear(8, 1), backend=owned)
    for _ in range(5):
        compiled(x).sum().backward()
    assert owned.memory_reuse is None


def test_option_is_checked_and_true_applies_at_the_first_compile(libc):
    from amp_compiler import AmpBackend, AmpOptionsError

    with pytest.raises(AmpOptionsError, match="reuse_cpu_memory must be True, False or None"):
        AmpBackend(reuse_cpu_memory="yes")
    backend = AmpBackend(inner="eager", reuse_cpu_memory=True)
    with torch.no_grad():
        torch.compile(nn.Linear(8, 1), backend=backend)(torch.randn(2, 8))
    assert backend.memory_reuse.applied and len(libc.calls) == 2
