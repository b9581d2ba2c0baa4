"""Coverage is a contract: an entry point that owns the step refuses, before any update, a model
too much of whose matmul weight would train outside amp's graphs (as written, in FP32); the
bare backend and ``dtype="auto"`` choosing FP32 say so at WARNING level."""

from __future__ import annotations

import copy
import logging
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import OpRecorder, recording_backend

import amp_compiler.device
from amp_compiler import AmpBackend, make_train_step
from amp_compiler.coverage import MAX_UNCOMPILED_SHARE, UncompiledModelError, matmul_weights

aten = torch.ops.aten


class Recurrent(nn.Module):
    """Dynamo does not trace an LSTM and gives up on the forward that calls it: all of it runs
    as written (the LSTM holds 97% of the matmul weight elements)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj, self.rnn, self.head = nn.Linear(16, 32), nn.LSTM(32, 64, batch_first=True), nn.Linear(64, 4)

    def forward(self, x):
        h, _ = self.rnn(self.proj(x))
        return self.head(h[:, -1])


class SmallOutside(nn.Module):
    """One small Linear (1.2% of the weight) behind a function Dynamo is told not to compile."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.side = nn.Linear(16, 256), nn.Linear(16, 4)
        self.out = nn.Linear(256, 4)

    def forward(self, x):
        return self.out(torch.relu(self.body(x))) + _eager(self.side, x)


@torch.compiler.disable
def _eager(layer, x):
    return layer(x)


def batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 5, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def _state(model):
    return copy.deepcopy(model.state_dict())


def _refused(said: str, owner: str) -> tuple[float, list[str]]:
    """The share and the modules a refusal names (how much of the LSTM Dynamo traces moves with
    the torch release; that the share is above the limit and the LSTM is named is the promise)."""
    found = re.search(
        rf"{owner}: ([0-9.]+)% of the model's matmul/conv weight elements ran outside "
        r".*?\(limit [0-9]+%\): (.*?)\.(?: |$)",
        said,
    )
    assert found, said
    return float(found.group(1)) / 100, found.group(2).split(", ")


def _unchanged(model, before) -> bool:
    return all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_matmul_weights_are_those_a_matmul_or_convolution_reads():
    """Linear, conv and LSTM weights count; an embedding table counts only when tied to a
    projection; biases, norms and frozen weights do not."""
    emb = nn.Embedding(10, 8)
    tied_head = nn.Linear(8, 10, bias=False)
    tied_head.weight = emb.weight
    frozen = nn.Linear(8, 8)
    frozen.requires_grad_(False)
    model = nn.ModuleDict(
        dict(
            emb=nn.Embedding(10, 8), lin=nn.Linear(8, 8), conv=nn.Conv2d(3, 4, 3), norm=nn.LayerNorm(8),
            rnn=nn.LSTM(8, 8), frozen=frozen,
        )
    )  # fmt: skip
    assert [n for n, _ in matmul_weights(model)] == [
        "lin.weight",
        "conv.weight",
        "rnn.weight_ih_l0",
        "rnn.weight_hh_l0",
    ]
    tied = nn.ModuleDict(dict(emb=emb, head=tied_head))
    assert [n for n, _ in matmul_weights(tied)] == ["emb.weight"]
    assert matmul_weights(nn.ModuleDict(dict(emb=nn.Embedding(10, 8)))) == []


def test_step_refuses_layers_dynamo_does_not_trace_before_any_update():
    """The share, the module and Dynamo's own reason are named; no parameter moved and the
    optimizer holds no state."""
    model = Recurrent()
    before = _state(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = make_train_step(model, opt, F.cross_entropy, dtype="bf16", compile_options={"inner": "aot_eager"})
    with pytest.raises(UncompiledModelError) as err:
        step(*batch())
    said = str(err.value)
    share, modules = _refused(said, "make_train_step")
    assert share > MAX_UNCOMPILED_SHARE and "rnn" in modules and "Dynamo's graph breaks:" in said
    assert "Nothing was updated" in said
    assert "max_uncompiled_share" in said
    assert _unchanged(model, before) and not opt.state
    assert all(p.grad is None for p in model.parameters())


def test_share_limit_is_an_option():
    """Raised to 1.0 the same model trains (its LSTM in FP32, said in a warning); 0 refuses
    even a 1.2% share that the default 5% lets through; a value out of range is an error."""
    model = Recurrent()
    step = make_train_step(
        model, torch.optim.SGD(model.parameters(), lr=1e-2), F.cross_entropy, dtype="bf16",
        compile_options={"inner": "aot_eager"}, max_uncompiled_share=1.0,
    )  # fmt: skip
    before = _state(model)
    assert not step(*batch()).skipped
    assert not _unchanged(model, before)

    x = torch.randn(8, 16)
    y = torch.randint(0, 4, (8,))
    for share, refused in ((0.05, False), (0.0, True)):
        model = SmallOutside()
        before = _state(model)
        step = make_train_step(
            model, torch.optim.SGD(model.parameters(), lr=1e-2), F.cross_entropy, dtype="bf16",
            compile_options={"inner": "aot_eager"}, max_uncompiled_share=share,
        )  # fmt: skip
        if refused:
            with pytest.raises(UncompiledModelError, match=r"1\.2% .* \(limit 0%\): side\."):
                step(x, y)
            assert _unchanged(model, before)
        else:
            step(x, y)
            assert not _unchanged(model, before)
    with pytest.raises(ValueError, match=r"max_uncompiled_share must be a number in \[0, 1\]"):
        make_train_step(model, torch.optim.SGD(model.parameters()), F.cross_entropy, max_uncompiled_share=5)


def test_a_fully_compiled_model_passes_a_zero_limit():
    """Negative control: every matmul weight inside the graphs, and all of them ran BF16."""
    rec = OpRecorder()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    step = make_train_step(
        model, torch.optim.SGD(model.parameters(), lr=1e-2), F.cross_entropy, dtype="bf16",
        compile_options={"inner": recording_backend(rec)}, max_uncompiled_share=0.0,
    )  # fmt: skip
    step(torch.randn(8, 16), torch.randint(0, 4, (8,)))
    matmuls = rec.dtypes_of(aten.mm, aten.addmm)
    assert matmuls and all(d[0] == torch.bfloat16 for d in matmuls)


def test_bare_backend_warns_once_with_dynamos_reason(caplog):
    """torch.compile(model, backend=...) owns no step: it warns, once, naming the break."""
    backend = AmpBackend(dtype="bf16", inner="aot_eager")
    compiled = torch.compile(SmallOutside(), backend=backend)
    with caplog.at_level(logging.WARNING, logger="amp_compiler"):
        for _ in range(2):
            compiled(torch.randn(8, 16))
    said = [r.getMessage() for r in caplog.records if "Dynamo broke the graph" in r.getMessage()]
    assert len(said) == 1 and "torch.compiler.disable()" in said[0] and len(backend.records) == 2


def test_auto_choosing_fp32_is_a_warning(amp_log, monkeypatch):
    """Where 16 bit is emulated, dtype="auto" runs FP32: one WARNING line with the reason."""
    monkeypatch.setattr(amp_compiler.device, "native_dtypes", lambda device: (frozenset(), "a CPU that emulates BF16"))
    monkeypatch.setattr(amp_compiler.device, "_warned", set())
    for _ in range(2):
        assert amp_compiler.device.resolve_dtype("auto", torch.device("cpu"))[0] == "fp32"
    said = [r.getMessage() for r in amp_log if r.levelno == logging.WARNING]
    assert len(said) == 1 and "dtype='auto' runs FP32" in said[0] and "a CPU that emulates BF16" in said[0]


# -- the integrations refuse the same model before any update


def test_trainer_callback_refuses_untraced_layers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from amp_compiler.integrations.transformers import AmpCallback

    class WithLoss(Recurrent):
        def forward(self, x, labels):
            return {"loss": F.cross_entropy(super().forward(x), labels)}

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            x, y = batch()
            return {"x": x[i], "labels": y[i]}

    model = WithLoss()
    before = _state(model)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, report_to=[], use_cpu=True,
        save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Data(), callbacks=[AmpCallback("bf16", inner="aot_eager")]
    )
    with pytest.raises(UncompiledModelError) as err:
        trainer.train()
    share, modules = _refused(str(err.value), "AmpCallback")
    assert share > MAX_UNCOMPILED_SHARE and "rnn" in modules
    assert _unchanged(model, before)


def test_lightning_plugins_refuse_untraced_layers():
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.fabric import Fabric

    from amp_compiler.integrations.lightning import AmpFabricPrecision, AmpPrecision

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Recurrent()

        def training_step(self, b, i):
            return F.cross_entropy(self.net(b[0]), b[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    module = Module()
    before = _state(module)
    trainer = pl.Trainer(
        max_steps=2, plugins=[AmpPrecision("bf16", inner="aot_eager")], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*batch()), batch_size=4)
    with pytest.raises(UncompiledModelError) as err:
        trainer.fit(module, loader)
    share, modules = _refused(str(err.value), "AmpPrecision")
    assert share > MAX_UNCOMPILED_SHARE and "net.rnn" in modules
    assert _unchanged(module, before)

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[AmpFabricPrecision("bf16", inner="aot_eager")])
    net = Recurrent()
    before = _state(net)
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=1e-2))
    fabric.backward(F.cross_entropy(model(batch()[0]), batch()[1]))
    with pytest.raises(UncompiledModelError) as err:
        opt.step()
    share, modules = _refused(str(err.value), "AmpFabricPrecision")
    assert share > MAX_UNCOMPILED_SHARE and "rnn" in modules
    assert _unchanged(net, before)


class _Routing:
    active, used = None, False


ROUTING = _Routing()  # module state, as kernels' routing context variable is


class Routed(nn.Module):
    """A checkpointed layer that sets and resets Python state in its forward, as transformers
    >= 5.25's attention does with its kernel-routing context variable."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pre, self.layer = nn.Linear(16, 16), nn.Linear(16, 16)

    def _body(self, x):
        before, ROUTING.active, ROUTING.used = ROUTING.active, "layer", True
        try:
            return torch.relu(self.layer(x))
        finally:
            ROUTING.active = before

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self._body, self.pre(x), use_reentrant=False)


def test_checkpointed_layer_with_python_state_is_traced_under_tracing(caplog):
    """The bare backend: Dynamo refuses the side effect and runs the layer as written; the
    warning says how to trace it, and under backend.tracing() the layer's weight is in a graph
    and its matmul ran BF16. make_train_step traces so by itself (a 0% limit holds)."""
    model, x = Routed(), torch.randn(4, 16)
    backend = AmpBackend(dtype="bf16", inner="aot_eager")
    with caplog.at_level(logging.WARNING, logger="amp_compiler"):
        torch.compile(model, backend=backend)(x)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "Dynamo broke the graph" in said and "side effect" in said and "backend.tracing()" in said
    assert id(model.layer.weight) not in backend.coverage.parameter_ids
    torch._dynamo.reset()
    rec = OpRecorder()
    backend = AmpBackend(dtype="bf16", inner=recording_backend(rec))
    with backend.tracing():
        torch.compile(model, backend=backend)(x)
    assert id(model.layer.weight) in backend.coverage.parameter_ids
    assert [d[0] for d in rec.dtypes_of(aten.addmm)] == [torch.bfloat16] * 2
    torch._dynamo.reset()
    step = make_train_step(
        model, torch.optim.SGD(model.parameters(), lr=1e-2), lambda out: out.square().mean(), dtype="bf16",
        compile_options={"inner": "aot_eager"}, max_uncompiled_share=0.0,
    )  # fmt: skip
    step(x)
    assert ROUTING.active is None
