"""Calibrated precision: measured pins, the policy file, and the CLI that writes it."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from helpers import MLP, OpRecorder, cli_here, recording_backend

from amp_compiler import AmpBackend, AmpOptionsError, calibrate


class Diff(nn.Module):
    """a(x) - b(x) with b a hair away from a: the difference is all cancellation, so
    16-bit matmuls lose it while FP32 keeps it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        with torch.no_grad():
            self.b.weight.copy_(self.a.weight + 1e-3 * torch.randn(16, 16))
            self.b.bias.copy_(self.a.bias)

    def forward(self, x):
        return self.a(x) - self.b(x)


class Cancelling(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.diff, self.out = nn.Linear(8, 16), Diff(), nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.diff(torch.tanh(self.inp(x))) * 100)


def batches(n=2, shape=(8, 8)):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


def test_model_within_budget_gets_no_pins():
    torch.manual_seed(0)
    cal = calibrate(MLP(), batches(2, (4, 16)), budget=5e-2)
    assert cal.pins == [] and cal.within_budget and cal.error_after == cal.error_before
    assert "no pins needed" in cal.summary() and cal.fp32_flops_share == 0.0


def test_cancellation_gets_its_module_pinned_and_nothing_else():
    cal = calibrate(Cancelling(), batches(), budget=1e-2)
    assert cal.error_before > 1e-2 and cal.within_budget and cal.error_after <= 1e-2
    assert [p.pattern for p in cal.pins] == [r"^diff$"]  # the module and what it holds
    assert all(p.option == "fp32_modules" and p.error_after < p.error_before for p in cal.pins)
    assert 0 < cal.fp32_flops_share < 1
    # the options apply the pins: the model now meets the budget through torch.compile
    model = Cancelling()
    x = batches(1)[0]
    out = torch.compile(model, backend=AmpBackend(cal.options, inner="eager"))(x)
    assert ((out - model(x)).norm() / model(x).norm()).item() <= 1e-2


def test_fp16_overflow_is_pinned():
    class Big(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(8, 8), nn.Linear(8, 1)
            with torch.no_grad():
                self.up.weight.fill_(3e4)

        def forward(self, x):
            return self.down(self.up(x) / 1e4)

    cal = calibrate(Big(), batches(1, (4, 8)).__iter__(), dtype="fp16", budget=5e-2)
    assert cal.within_budget and any("up" in p.pattern for p in cal.pins)


def test_policy_file_round_trip_reasons_and_explicit_options_win(tmp_path, caplog):
    cal = calibrate(Cancelling(), batches(), budget=1e-2)
    path = tmp_path / "amp-policy.json"
    cal.save(str(path))
    data = json.loads(path.read_text())
    assert data["format"] == "amp-policy" and data["version"] == 1 and data["dtype"] == "bf16"
    assert data["torch"] == torch.__version__ and data["fingerprints"] and len(data["pins"]) == 1
    assert not list(tmp_path.glob(".*tmp*"))  # atomic write left nothing behind

    backend = AmpBackend(policy_file=str(path), inner="eager")
    torch.compile(Cancelling(), backend=backend)(batches(1)[0])
    pinned = [n for n in backend.plan().nodes if n.module == "diff.a" and n.op.startswith("aten.linear")]
    assert pinned and pinned[0].precision == "FP32"
    assert "policy file amp-policy.json" in pinned[0].reason and "measured output error" in pinned[0].reason

    torch._dynamo.reset()  # what executes: the pinned module's matmuls in FP32, the rest in BF16
    rec = OpRecorder()
    torch.compile(Cancelling(), backend=AmpBackend(policy_file=str(path), inner=recording_backend(rec)))(batches(1)[0])
    ran = rec.dtypes_of(torch.ops.aten.addmm)
    assert ran.count([torch.float32] * 3) == 2 and ran.count([torch.bfloat16] * 3) == 2

    torch._dynamo.reset()
    backend = AmpBackend(policy_file=str(path), fp32_modules=[r"^out$"], inner="eager")
    torch.compile(Cancelling(), backend=backend)(batches(1)[0])
    assert "explicit fp32_modules given beside it win" in backend.records[0].dtype_reason
    assert {n.module for n in backend.plan().nodes if n.precision == "FP32" and n.op.startswith("aten.linear")} == {
        "out"
    }

    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="amp_compiler"):
        for _ in range(2):
            torch._dynamo.reset()
            torch.compile(MLP(), backend=AmpBackend(policy_file=str(path), inner="eager"))(torch.randn(2, 16))
    warned = [r for r in caplog.records if "calibrated on another graph" in r.getMessage()]
    assert len(warned) == 1


@pytest.mark.parametrize(
    "content, match",
    [
        ("{not json", "not valid JSON"),
        ('{"format": "amp-policy", "version": 9}', "format version 9"),
        ('{"format": "something"}', "not an amp policy file"),
        (
            '{"format": "amp-policy", "version": 1, "pins": [{"option": "fp32_modules", "pattern": "("}]}',
            "not a valid regex",
        ),
        (
            '{"format": "amp-policy", "version": 1, "pins": [{"option": "fp32_nodes", "pattern": "x"}]}',
            'needs "option"',
        ),
    ],
)
def test_bad_policy_file_is_a_one_line_error(tmp_path, content, match):
    path = tmp_path / "p.json"
    path.write_text(content)
    with pytest.raises(AmpOptionsError, match=match) as e:
        AmpBackend(policy_file=str(path))
    assert "\n" not in str(e.value)
    with pytest.raises(AmpOptionsError, match="not found"):
        AmpBackend(policy_file=str(tmp_path / "missing.json"))


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "amp_compiler", *args], capture_output=True, text=True, timeout=600)


def test_cli_calibrate_writes_the_policy_and_inspect_reads_it(tmp_path, capsys):
    fixture = str(tmp_path / "cancel.py")
    with open(fixture, "w") as f:
        here = str(__file__.rsplit("/", 1)[0])
        f.write(
            f"import sys\nsys.path.insert(0, {here!r})\nfrom test_calibrate import Cancelling, batches\n"
            "import torch\n\ndef make():\n    return Cancelling(), (torch.randn(8, 8),)\n"
        )
    out = tmp_path / "amp-policy.json"
    r = run_cli("calibrate", f"{fixture}:make", "-o", str(out), "--batches", "2")
    assert r.returncode == 0, r.stderr
    assert "diff" in r.stdout and "error before" in r.stdout
    assert json.loads(out.read_text())["pins"]
    code, stdout, err = cli_here(capsys, "inspect", f"{fixture}:make", "--policy-file", str(out), "--format", "json")
    assert code == 0, err
    reasons = [n["reason"] for n in json.loads(stdout)["nodes"] if n["module"] == "diff.a"]
    assert any("policy file" in x for x in reasons)
    code, _, err = cli_here(capsys, "calibrate", f"{fixture}:make", "-o", str(tmp_path / "no" / "p.json"))
    assert code == 2 and err.count("\n") == 1, err
    code, _, err = cli_here(capsys, "inspect", f"{fixture}:make", "--policy-file", str(tmp_path / "missing.json"))
    assert code == 2 and "not found" in err
