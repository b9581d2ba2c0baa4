"""Precision configured once: a DeepSpeed-style dict or JSON file for every entry point."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import MLP, OpRecorder, recording_backend

from amp_compiler import AmpBackend, make_train_step
from amp_compiler.ds_config import AmpConfig, AmpConfigError

FP16 = {
    "fp16": {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 12,
        "loss_scale_window": 500,
        "hysteresis": 2,
        "min_loss_scale": 4,
    }
}
INNER = {"inner": "aot_eager"}


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def test_deepspeed_fp16_section_builds_the_scaler_it_describes():
    model = mlp()
    step = make_train_step(
        model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, config=FP16, compile_options=INNER
    )
    s = step.scaler
    assert step.dtype == "fp16" and s.is_enabled()
    assert (s.get_scale(), s.get_growth_interval(), s.hysteresis, s.min_scale) == (2.0**12, 500, 2, 4.0)
    assert step(torch.randn(4, 8), torch.randn(4, 1)).scale == 2.0**12


def test_static_loss_scale_stays_put_and_overflows_still_skip():
    model = mlp()
    cfg = {"fp16": {"enabled": True, "loss_scale": 128}}
    step = make_train_step(
        model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, config=cfg, compile_options=INNER
    )
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    assert step(x, y * float("inf")).skipped
    for _ in range(3):
        assert step(x, y).scale == 128.0
    assert step.scaler.get_scale() == 128.0


def test_json_file_feeds_backend_and_train_step_alike(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "bf16": {"enabled": True},
                "amp": {"fp32_modules": ["^0$"]},
                "gradient_clipping": 1.0,
                "gradient_accumulation_steps": 2,
                "train_batch_size": 32,
                "zero_optimization": {"stage": 0},
            }
        )
    )
    backend = AmpBackend(config=str(path), inner="eager")
    torch.compile(MLP(), backend=backend)(torch.randn(2, 16))
    assert backend.options.dtype == "bf16" and backend.options.fp32_modules == ("^0$",)
    model = mlp()
    step = make_train_step(
        model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, config=path, compile_options=INNER
    )
    assert (step.dtype, step.max_grad_norm, step.grad_accum) == ("bf16", 1.0, 2)
    assert step.backend.options.fp32_modules == ("^0$",)
    assert not step.scaler.is_enabled()


def test_config_plan_is_what_executes():
    """Through a config, the second Linear's matmul runs in BF16, the pinned first in FP32."""
    rec = OpRecorder()
    model = mlp()
    step = make_train_step(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        F.mse_loss,
        config={"bf16": {"enabled": True}, "amp": {"fp32_modules": ["^0$"]}},
        compile_options={"inner": recording_backend(rec)},
    )
    step(torch.randn(4, 8), torch.randn(4, 1))
    forward = [c for c in rec.dtypes_of(torch.ops.aten.addmm)]
    assert [torch.float32] * 3 in forward and [torch.bfloat16] * 3 in forward


def test_neither_enabled_means_fp32_and_no_section_means_auto():
    assert AmpConfig.load({"bf16": {"enabled": False}}).dtype == "fp32"
    assert AmpConfig.load({"amp": {"strict": True}}).dtype is None


@pytest.mark.parametrize(
    "config, match",
    [
        ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "enables both 'bf16' and 'fp16'"),
        ({"bf_16": {"enabled": True}}, r"unknown key\(s\) \['bf_16'\]"),
        ({"fp16": {"enabled": True, "loss_scale_windw": 10}}, r"'fp16' has unknown key\(s\) \['loss_scale_windw'\]"),
        ({"fp16": {"enabled": True, "hysteresis": 0}}, r"'fp16.hysteresis' = 0 is out of range"),
        ({"fp16": {"enabled": "yes"}}, "must be true or false"),
        ({"fp16": {"enabled": True, "initial_scale_power": 1.5}}, "wrong type"),
        ({"bf16": True}, "must be an object"),
        ({"amp": {"fp32_modules": ["("]}}, "config 'amp': fp32_modules pattern"),
        ({"amp": {"dtype": "bf16"}}, "takes no 'dtype'"),
        ({"gradient_clipping": -1}, "gradient_clipping"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
    ],
)
def test_bad_config_is_one_clear_error(config, match):
    with pytest.raises(AmpConfigError, match=match):
        AmpConfig.load(config)


def test_missing_or_malformed_file_is_one_clear_error(tmp_path):
    with pytest.raises(AmpConfigError, match="not found"):
        AmpConfig.load(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"bf16": {"enabled": true,}}')
    with pytest.raises(AmpConfigError, match="not valid JSON: .* line 1"):
        AmpConfig.load(bad)


def test_argument_and_config_must_agree():
    model = mlp()
    with pytest.raises(AmpConfigError, match="dtype='bf16' given, but the config says 'fp16'"):
        make_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, dtype="bf16", config=FP16)
    with pytest.raises(AmpConfigError, match="set it in one place"):
        AmpBackend(config=FP16, dtype="bf16")
