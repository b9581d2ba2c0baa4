"""Lightning: ``AmpPrecision`` as a Trainer precision plugin compiles the module's forward with
the amp backend, scales FP16 with amp's LossScaler, and refuses what would train in silence."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pl = pytest.importorskip("lightning.pytorch")

from helpers import OpRecorder, recording_backend  # noqa: E402

from amp_compiler.integrations.lightning import AmpPrecision  # noqa: E402

aten = torch.ops.aten


class Classifier(pl.LightningModule):
    def __init__(self, call_self: bool = True):
        super().__init__()
        self.call_self = call_self
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x) if self.call_self else self.net(x)
        return F.cross_entropy(logits, y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def loader():
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=16)


def trainer(plugin, steps=4, **kw):
    return pl.Trainer(
        max_steps=steps, plugins=[plugin], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", **kw,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_lightning_trainer_runs_the_plan(dtype):
    """Matmuls in the 16-bit dtype, LayerNorm FP32, parameters FP32, no autocast around the call;
    FP16 gets amp's LossScaler."""
    rec = OpRecorder()
    plugin = AmpPrecision(dtype, inner=recording_backend(rec))
    model = Classifier()
    autocast = []
    model.register_forward_pre_hook(lambda m, a: autocast.append(torch.is_autocast_enabled("cpu")))
    trainer(plugin, steps=8).fit(model, loader())
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    matmuls = rec.dtypes_of(aten.mm, aten.addmm)
    assert matmuls and all(d[0] == low for d in matmuls)
    assert all(d[0] == torch.float32 for d in rec.dtypes_of(aten.native_layer_norm))
    assert autocast and not any(autocast)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert plugin.precision == {"bf16": "bf16-mixed", "fp16": "16-mixed"}[dtype]
    assert (plugin.scaler is not None) == (dtype == "fp16")
    if plugin.scaler is not None:
        state = plugin.state_dict()
        resumed = AmpPrecision("fp16")
        resumed.load_state_dict(state)
        assert resumed.scaler.get_scale() == plugin.scaler.get_scale()


def test_lightning_precision_flag_beside_the_plugin_is_refused():
    """precision="bf16-mixed" would be a second precision system: Lightning refuses both at once."""
    with pytest.raises(ValueError, match=r"Received both `precision=bf16-mixed` and `plugins=AmpPrecision"):
        pl.Trainer(precision="bf16-mixed", plugins=[AmpPrecision("bf16")], accelerator="cpu")


def test_lightning_step_that_bypasses_the_compiled_forward_is_refused_before_an_update():
    """A training_step that calls a submodule instead of self(...) runs nothing compiled: the
    first optimizer step raises, with every parameter as it was."""
    model = Classifier(call_self=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="AmpPrecision: .*self\\(\\.\\.\\.\\)"):
        trainer(AmpPrecision("bf16", inner="aot_eager")).fit(model, loader())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_fabric_runs_the_plan(dtype):
    """Fabric(plugins=[AmpFabricPrecision()]): setup compiles the forward, matmuls run 16 bit,
    inputs stay FP32 (no input conversion), FP16 backward is scaled by amp's LossScaler."""
    from lightning.fabric import Fabric

    from amp_compiler.integrations.lightning import AmpFabricPrecision

    rec = OpRecorder()
    plugin = AmpFabricPrecision(dtype, inner=recording_backend(rec))
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    x, y = torch.randn(16, 16), torch.randint(0, 4, (16,))
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        fabric.backward(loss)
        opt.step()
        losses.append(loss.item())
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    assert all(d[0] == low for d in rec.dtypes_of(aten.mm, aten.addmm)) and rec.dtypes_of(aten.addmm)
    assert losses[-1] < losses[0]
    assert all(p.dtype == torch.float32 for p in net.parameters())
    assert (plugin.scaler is not None) == (dtype == "fp16")


class RankReport(Classifier):
    """Each rank writes, at the end, the matmuls its compiled graphs executed, its plan and its
    parameters to ``out/rank<N>.pt`` (spawned ranks return nothing)."""

    def __init__(self, out: str):
        super().__init__()
        self.out = out

    def on_train_end(self):
        plugin = self.trainer.precision_plugin
        torch.save(
            {
                "matmuls": plugin.backend.options.inner.recorder.dtypes_of(aten.mm, aten.addmm),
                "low": plugin.plan().summary()["nodes"]["LOW"],
                "params": [p.detach().clone() for p in self.parameters()],
                "strategy": type(self.trainer.strategy).__name__,
            },
            f"{self.out}/rank{self.global_rank}.pt",
        )


def test_lightning_ddp_on_two_gloo_processes(tmp_path):
    """strategy="ddp_spawn" (DDP, 2 CPU processes, gloo) with AmpPrecision: every rank's
    compiled forward ran its matmuls in BF16, and the ranks end with the same parameters."""
    plugin = AmpPrecision("bf16", inner=recording_backend(OpRecorder()))  # each rank records into its copy
    trainer(plugin, steps=4, strategy="ddp_spawn", devices=2).fit(RankReport(str(tmp_path)), loader())
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for r in ranks:
        assert r["strategy"] == "DDPStrategy" and r["low"] > 0
        assert r["matmuls"] and all(d[0] == torch.bfloat16 for d in r["matmuls"])
    for p, q in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(p, q)
