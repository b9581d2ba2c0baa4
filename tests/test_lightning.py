"""Lightning: ``AmpPrecision`` as a Trainer precision plugin compiles the module's forward and
its children with the amp backend (steps that call submodules run planned), scales FP16 with
amp's LossScaler; refusals are in test_coverage_contract.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pl = pytest.importorskip("lightning.pytorch")

from helpers import OpRecorder, recording_backend, two_ranks  # noqa: E402

from amp_compiler.integrations.lightning import AmpFabricPrecision, AmpPrecision  # noqa: E402

aten = torch.ops.aten


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
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


class LitAutoEncoder(pl.LightningModule):
    """Lightning's front-page module: no forward of its own, the steps call the submodules."""

    def __init__(self, manual: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(8 * 8, 64), nn.ReLU(), nn.Linear(64, 3))
        self.decoder = nn.Sequential(nn.Linear(3, 64), nn.ReLU(), nn.Linear(64, 8 * 8))
        self.automatic_optimization = not manual
        self.val_losses = []

    def _loss(self, batch):
        x = batch[0].view(batch[0].size(0), -1)
        z = self.encoder(x)
        x_hat = self.decoder(z)
        return F.mse_loss(x_hat, x)

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()

    def validation_step(self, batch, batch_idx):
        self.val_losses.append(self._loss(batch).item())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def images():
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.rand(32, 1, 8, 8, generator=g), torch.zeros(32))
    return torch.utils.data.DataLoader(ds, batch_size=8)


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual-optimization"])
def test_lightning_module_whose_steps_call_submodules_runs_the_plan(manual):
    """The canonical LitAutoEncoder (training_step and validation_step call self.encoder and
    self.decoder, never self(...)): every linear of both, in training and validation, ran
    BF16, the whole model's weights inside the graphs (a 0% limit holds), parameters moved."""
    rec = OpRecorder()
    plugin = AmpPrecision("bf16", inner=recording_backend(rec), max_uncompiled_share=0.0)
    model = LitAutoEncoder(manual)
    before = [p.detach().clone() for p in model.parameters()]
    tr = trainer(plugin, steps=3, limit_val_batches=2, val_check_interval=3)
    tr.fit(model, images(), images())
    matmuls = rec.dtypes_of(aten.mm, aten.addmm)
    assert matmuls and all(d[0] == torch.bfloat16 for d in matmuls)
    # 4 linears a forward: 3 training steps (forward + 2 backward mm each) and validation forwards
    assert len(rec.dtypes_of(aten.addmm)) >= 4 * (3 + 2)
    assert model.val_losses
    assert not any(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert all(p.dtype == torch.float32 for p in model.parameters())


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


def test_fabric_loop_that_calls_submodules_runs_the_plan():
    """A Fabric loop calling model.encoder / model.decoder, not model(...): planned, BF16."""
    from lightning.fabric import Fabric

    from amp_compiler.integrations.lightning import AmpFabricPrecision

    rec = OpRecorder()
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[AmpFabricPrecision("bf16", inner=recording_backend(rec),
                                                                              max_uncompiled_share=0.0)])  # fmt: skip
    net = LitAutoEncoder()
    model, opt = fabric.setup(net, torch.optim.Adam(net.parameters(), lr=1e-3))
    x = next(iter(images()))[0].view(8, -1)
    for _ in range(3):
        opt.zero_grad()
        loss = F.mse_loss(model.decoder(model.encoder(x)), x)
        fabric.backward(loss)
        opt.step()
    matmuls = rec.dtypes_of(aten.mm, aten.addmm)
    assert len(rec.dtypes_of(aten.addmm)) >= 4 * 3 and all(d[0] == torch.bfloat16 for d in matmuls)


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


def _lightning_ranks(rank):
    """Lightning's DDP strategy and Fabric in processes torchrun launched, each rank with its own
    plugin: (what fit or setup raised, whether a parameter moved), per case; and the control's
    parameters after 3 steps with one dtype everywhere."""
    from lightning.fabric import Fabric

    from amp_compiler import PrecisionMismatchError

    def ddp(plugin):
        return trainer(plugin, steps=3, strategy="ddp", devices=2)

    out = {}
    for case, build in {
        "trainer, dtype": lambda: AmpPrecision(("bf16", "fp16")[rank], inner="aot_eager"),
        "trainer, pin": lambda: AmpPrecision("bf16", inner="aot_eager", fp32_modules=["net.3"] if rank else []),
        "fabric, dtype": lambda: AmpFabricPrecision(("bf16", "fp16")[rank], inner="aot_eager"),
    }.items():
        torch.manual_seed(0)
        model = Classifier()
        before = [p.detach().clone() for p in model.parameters()]
        try:
            if case.startswith("fabric"):
                fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[build()])
                fabric.launch()
                fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
            else:
                ddp(build()).fit(model, loader())
            error = None
        except PrecisionMismatchError as e:
            error = str(e)
        out[case] = (error, any(not torch.equal(a, p) for a, p in zip(before, model.parameters())))
    torch.manual_seed(0)
    model = Classifier()
    ddp(AmpPrecision("bf16", inner="aot_eager")).fit(model, loader())
    out["control"] = [p.detach().clone() for p in model.parameters()]
    return out


def test_lightning_and_fabric_ranks_set_up_differently_stop_before_any_update():
    """DDP strategy and Fabric, two ranks launched as torchrun launches them: a dtype or a pin
    that differs stops every rank at setup with one message naming it, nothing updated; the
    control (one dtype) trains to identical parameters on both ranks."""
    ranks = two_ranks(_lightning_ranks)
    named = {
        "trainer, dtype": "rank 0: bf16, rank 1: fp16",
        "trainer, pin": "fp32_modules: rank 0: (), rank 1: ('net.3',)",
        "fabric, dtype": "rank 0: bf16, rank 1: fp16",
    }
    for case, name in named.items():
        (error0, moved0), (error1, moved1) = ranks[0][case], ranks[1][case]
        assert error0 == error1 and name in error0, case
        assert not moved0 and not moved1, case
    control0, control1 = ranks[0]["control"], ranks[1]["control"]
    torch.manual_seed(0)
    assert all(not torch.equal(a, b) for a, b in zip(control0, Classifier().parameters()))  # it trained
    for a, b in zip(control0, control1):
        assert torch.equal(a, b)
