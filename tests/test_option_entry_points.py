"""Every option takes effect through every entry point, seen in what executed or in the plan.

A row per ``AmpOptions`` field (plus a policy file): the options it is given with, and what
must be true of the run (ops recorded by a ``TorchDispatchMode``, the output, files written,
the partitioner's budget), which must be false of the same run without it. A new option
without a row fails ``test_every_option_has_a_row``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from fixtures.probe import Probe
from helpers import FakeGlibc, OpRecorder, cli_here, recording_backend

from amp_compiler import AmpBackend, AmpOptions, cpu_memory, make_train_step

aten = torch.ops.aten
SDPA_CPU = aten._scaled_dot_product_flash_attention_for_cpu


@dataclass
class Run:
    """What one compiled forward (and, in a training step, backward) did."""

    rec: OpRecorder
    out: torch.Tensor | None = None
    plan: dict | None = None  # the plan's JSON, from the CLI
    budgets: list = field(default_factory=list)  # activation memory budgets Inductor was given
    error: Exception | None = None
    extra: dict = field(default_factory=dict)

    def ran(self, op, dtype) -> bool:
        return any(d and d[0] == dtype for d in self.rec.dtypes_of(op))

    def ran_head(self) -> bool:
        return bool(self.rec.dtypes_of(torch.ops.amp.head_stats))

    def linears(self) -> list[torch.dtype]:
        """Forward addmm input dtypes, in order: body, then correction."""
        return [d[0] for d in self.rec.dtypes_of(aten.addmm)][:2]

    def module_precision(self, module: str) -> str:
        return next(
            n["precision"] for n in self.plan["nodes"] if n["module"] == module and n["op"].startswith("aten.linear")
        )


def _policy_file(tmp_path) -> str:
    path = tmp_path / "amp-policy.json"
    path.write_text(
        json.dumps(
            {
                "format": "amp-policy",
                "version": 1,
                "dtype": "bf16",
                "pins": [{"option": "fp32_modules", "pattern": "^correction$", "reason": "cancellation (measured)"}],
            }
        )
    )
    return str(path)


def _fake_glibc(state) -> bool:
    fake = FakeGlibc()
    state["mallopt"] = fake.calls
    cpu_memory._libc, cpu_memory._applied = (lambda: (fake, "glibc (recorded)")), None
    return True


@pytest.fixture(autouse=True)
def _glibc_restored():
    libc, applied = cpu_memory._libc, cpu_memory._applied
    yield
    cpu_memory._libc, cpu_memory._applied = libc, applied


def _second_inner(state):
    rec = OpRecorder()
    state["second"] = rec
    return recording_backend(rec)


@dataclass
class Row:
    value: Callable  # (tmp_path, state) -> the option's value
    holds: Callable  # Run -> bool: true with the option, false without it
    context: dict = field(default_factory=dict)  # given with and without the option
    cli: str | None = None  # the CLI flag that mirrors it (checked on the plan)
    step: dict = field(default_factory=dict)  # make_train_step arguments it needs


ROWS = {
    "dtype": Row(lambda t, s: "fp16", lambda r: torch.float16 in r.linears(), cli="--dtype fp16"),
    "inner": Row(lambda t, s: _second_inner(s), lambda r: "second" in r.extra and bool(r.extra["second"].calls)),
    "low_ops": Row(lambda t, s: ["aten.exp"], lambda r: r.ran(aten.exp, torch.bfloat16)),
    "fp32_ops": Row(lambda t, s: ["aten.linear"], lambda r: r.linears() == [torch.float32] * 2),
    "promote_ops": Row(lambda t, s: ["aten.exp"], lambda r: r.ran(aten.exp, torch.bfloat16)),
    "passthrough_ops": Row(lambda t, s: ["aten.exp"], lambda r: r.ran(aten.exp, torch.bfloat16)),
    "remove_ops": Row(lambda t, s: ["aten.linear"], lambda r: r.linears() == [torch.float32] * 2),
    "fp32_modules": Row(
        lambda t, s: ["^correction$"],
        lambda r: r.linears() == [torch.bfloat16, torch.float32],
        cli="--fp32-module ^correction$",
    ),
    "strict": Row(
        lambda t, s: True,
        lambda r: r.error is not None and "unknown" in str(r.error),
        context={"remove_ops": ["aten.exp"]},
    ),
    # a training step compiling the loss returns the loss, FP32 whatever the option says
    "low_precision_outputs": Row(
        lambda t, s: True, lambda r: r.out.dtype == torch.bfloat16, step={"compile_loss": False}
    ),
    # 0.5 among the budgets: the loss head's own block kernels compile under the default
    "memory_budget": Row(lambda t, s: 0.5, lambda r: 0.5 in r.budgets, context={"inner": "inductor"}),
    "attention": Row(lambda t, s: "fused", lambda r: r.ran(SDPA_CPU, torch.bfloat16)),
    # "fused": the head op executes; the default ("auto") leaves this small head as written
    "loss_head": Row(lambda t, s: "fused", lambda r: r.ran_head() and not r.ran(aten._log_softmax, torch.float32)),
    # the automatic choice weighs the logits against this memory: 1 MiB makes them large
    "memory_bytes": Row(lambda t, s: 1 << 20, lambda r: r.ran_head()),
    # True: glibc is asked to keep freed memory at the first compile (or when the step is built)
    "reuse_cpu_memory": Row(lambda t, s: _fake_glibc(s), lambda r: len(r.extra.get("mallopt", ())) == 2),
    "dump_dir": Row(lambda t, s: str(t / "dump"), lambda r: any(r.extra["tmp"].glob("dump/**/*"))),
    "policy_file": Row(
        lambda t, s: _policy_file(t),
        lambda r: r.linears() == [torch.bfloat16, torch.float32],
        cli="--policy-file {policy_file}",
    ),
}


def test_every_option_has_a_row():
    """An option nobody checks through the entry points is one that may silently do nothing."""
    assert set(ROWS) == set(AmpOptions.names())


# -- the entry points: each takes the options as its users give them, runs one step


def _via_torch_compile(opts, dtype):
    return lambda m: torch.compile(m, backend="amp", options={**opts, **dtype})


def _via_backend(opts, dtype):
    return lambda m: torch.compile(m, backend=AmpBackend(**opts, **dtype))


def _via_config(opts, dtype):
    sections = {"fp16": {"enabled": True}} if dtype.get("dtype") == "fp16" else {}
    return lambda m: torch.compile(m, backend=AmpBackend(config={**sections, "amp": opts}))


def _via_callback(opts, dtype):
    pytest.importorskip("transformers")
    from amp_compiler.integrations.transformers import AmpCallback

    def build(m):
        AmpCallback(dtype.get("dtype"), **opts).on_train_begin(None, None, None, model=m)
        return m

    return build


def _step(opts, dtype, *, config: bool, **step_kwargs):
    outputs = []

    def loss_fn(out):
        outputs.append(out)  # the output as the model returns it
        return out.float().square().mean()

    def run(m, x):
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        if config:
            sections = {"fp16": {"enabled": True}} if dtype.get("dtype") == "fp16" else {}
            step = make_train_step(m, opt, loss_fn, config={**sections, "amp": opts}, **step_kwargs)
        else:
            step = make_train_step(m, opt, loss_fn, **dtype, compile_options=opts, **step_kwargs)
        step(x)
        return outputs[-1]

    return run


ENTRY_POINTS = {
    "torch.compile(options=)": _via_torch_compile,
    "AmpBackend()": _via_backend,
    "AmpBackend(config=)": _via_config,
    "AmpCallback()": _via_callback,
    "make_train_step(compile_options=)": lambda o, d, **kw: _step(o, d, config=False, **kw),
    "make_train_step(config=)": lambda o, d, **kw: _step(o, d, config=True, **kw),
}
STEPS = {"make_train_step(compile_options=)", "make_train_step(config=)"}


@pytest.fixture
def inductor_budgets(monkeypatch):
    """Stands in for Inductor: records the partitioner budget it would partition under and
    runs the graph as it is (the budget is what ``memory_budget`` changes)."""
    import torch._inductor.compile_fx as cfx

    seen = []

    def compile_fx(gm, example_inputs, config_patches=None, **kwargs):
        seen.append(torch._functorch.config.activation_memory_budget)
        return gm

    monkeypatch.setattr(cfx, "compile_fx", compile_fx)
    return seen


def _run(entry: str, name: str, tmp_path, budgets, *, given: bool) -> Run:
    """One step through ``entry`` with the row's context, and the option itself if ``given``."""
    row, state, rec = ROWS[name], {}, OpRecorder()
    tmp_path.mkdir(parents=True, exist_ok=True)
    opts = {"inner": recording_backend(rec), **row.context}
    if given:
        opts[name] = row.value(tmp_path, state)
    dtype = {"dtype": opts.pop("dtype")} if "dtype" in opts else {}
    run = Run(rec, budgets=budgets, extra={**state, "tmp": tmp_path})
    torch._dynamo.reset()
    budgets.clear()
    model, x = Probe(), torch.randn(4, 16)
    try:
        if entry in STEPS:
            run.out = ENTRY_POINTS[entry](opts, dtype, **row.step)(model, x)
        else:
            run.out = ENTRY_POINTS[entry](opts, dtype)(model)(x)
    except Exception as e:  # noqa: BLE001 - the strict row expects one
        if name != "strict" or not given:
            raise
        run.error = e
    return run


_PLAIN: dict[str, Run] = {}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("name", list(ROWS))
def test_option_takes_effect_through_entry_point(entry, name, tmp_path, inductor_budgets):
    """The option changes what ran; the same run without it does not show the change."""
    with_it = _run(entry, name, tmp_path / "with", inductor_budgets, given=True)
    assert ROWS[name].holds(with_it), f"{name} given through {entry} changed nothing that ran"
    if ROWS[name].context:
        without = _run(entry, name, tmp_path / "without", inductor_budgets, given=False)
    else:  # the plain run is the same for every row without context: once per entry point
        if entry not in _PLAIN:
            _PLAIN[entry] = _run(entry, "dump_dir", tmp_path / "without", [], given=False)
        without = _PLAIN[entry]
    assert not ROWS[name].holds(without), f"the check for {name} holds without it: it cannot fail"


@pytest.mark.parametrize("name", [n for n, r in ROWS.items() if r.cli])
def test_cli_flag_takes_effect(name, tmp_path, capsys):
    """The CLI flags that mirror an option change the plan ``inspect`` prints."""
    flag = ROWS[name].cli.format(policy_file=_policy_file(tmp_path)).split()
    target = str(Path(__file__).parent / "fixtures" / "probe.py") + ":probe"
    code, out, err = cli_here(capsys, "inspect", target, "--format", "json", *flag)
    assert code == 0, err
    with_it = Run(OpRecorder(), plan=json.loads(out))
    code, out, err = cli_here(capsys, "inspect", target, "--format", "json")
    without = Run(OpRecorder(), plan=json.loads(out))
    if name == "dtype":
        assert with_it.plan["graphs"][0]["dtype"] == "fp16" != without.plan["graphs"][0]["dtype"]
    else:
        assert with_it.module_precision("correction") == "FP32"
        assert without.module_precision("correction") == "LOW"


def test_replace_lets_a_policy_file_fill_only_what_was_not_given(tmp_path):
    """``replace`` (how torch.compile's options meet a backend's) carries only the options
    set explicitly: a policy file fills the rest, and an explicit default still wins."""
    path = _policy_file(tmp_path)
    assert AmpOptions.from_mapping({"inner": "eager"}).replace(policy_file=path).fp32_modules == ("^correction$",)
    explicit = AmpOptions.from_mapping({"fp32_modules": []}).replace(policy_file=path)
    assert explicit.fp32_modules == () and explicit.policy_overridden == ("fp32_modules",)
    kept = AmpOptions.from_mapping(policy_file=path).replace(strict=True)
    assert kept.fp32_modules == ("^correction$",) and kept.strict
    assert AmpOptions.from_mapping(policy_file=path).replace(policy_file=None).fp32_modules == ()
