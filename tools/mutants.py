"""Break each promise the README makes, one at a time, and see whether the tests notice.

    python tools/mutants.py                 # every mutant, each against the tests named for it
    python tools/mutants.py --list          # the mutants and the promise each breaks
    python tools/mutants.py --only comm-fp32,no-skip --full   # the README's whole test command

A mutant is a small edit of the product's code that breaks one promise (a matmul left in
FP32, a step not skipped on Inf, ranks set up differently let through, gradients
all-reduced in FP32 though BF16 was asked...). Each is applied to the working tree, the
tests run, and the file put back as it was (also on Ctrl-C); the tree must be clean. A
mutant the tests pass is a survivor: a promise no test holds. Exit status: the number of
survivors. On 2 cores the default run takes about 15 minutes; ``--full`` runs the README's
``python -m pytest -q`` per mutant instead of the named tests (each ~10 minutes).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    promise: str
    path: str
    find: str  # replaced by ``replace``, then each of ``more``' (find, replace) pairs
    replace: str
    tests: tuple[str, ...]
    more: tuple[tuple[str, str], ...] = ()

    def edits(self) -> tuple[tuple[str, str], ...]:
        return ((self.find, self.replace), *self.more)


MUTANTS = (
    Mutant(
        "mm-fp32",
        "matmuls run in 16 bit",
        "amp_compiler/policy.py",
        "    {\n        aten.mm,\n        aten.bmm,\n",
        "    {\n        aten.bmm,\n",
        ("tests/test_policy.py", "tests/test_backend.py", "tests/test_hf_models.py"),
    ),
    Mutant(
        "softmax-low",
        "softmax runs in FP32",
        "amp_compiler/policy.py",
        "        aten.softmax,\n        aten.log_softmax,\n        aten._softmax,\n",
        "        aten.log_softmax,\n",
        ("tests/test_policy.py", "tests/test_backend.py", "tests/test_hf_models.py", "tests/test_properties.py"),
        more=(
            ("    {\n        aten.mm,\n", "    {\n        aten.softmax,\n        aten._softmax,\n        aten.mm,\n"),
        ),  # noqa: E501
    ),
    Mutant(
        "norm-low",
        "norms run in FP32",
        "amp_compiler/policy.py",
        "        aten.layer_norm,\n        aten.native_layer_norm,\n",
        "",
        ("tests/test_policy.py", "tests/test_backend.py", "tests/test_hf_models.py"),
        more=(
            (
                "    {\n        aten.mm,\n",
                "    {\n        aten.layer_norm,\n        aten.native_layer_norm,\n        aten.mm,\n",
            ),
        ),  # noqa: E501
    ),
    Mutant(
        "casts-unfolded",
        "the fewest casts",
        "passes/__init__.py",
        "insert_casts, fold_casts, fuse_loss_head",
        "insert_casts, fuse_loss_head",
        ("tests/test_passes.py", "tests/test_backend.py"),
    ),
    Mutant(
        "masters-unchecked",
        "FP32 master weights",
        "amp_compiler/training_setup.py",
        "    if low:\n        names = [n for n, p in model.named_parameters() if p.dtype in low][:3]",
        "    if False:\n        names = [n for n, p in model.named_parameters() if p.dtype in low][:3]",
        ("tests/test_training.py", "tests/test_integrations.py", "tests/test_lightning.py"),
    ),
    Mutant(
        "no-skip",
        "a step with Inf/NaN gradients is skipped",
        "amp_compiler/train.py",
        "skipped, scale, scale_after = bool(found.item()), 1.0, None",
        "skipped, scale, scale_after = False, 1.0, None",
        ("tests/test_training.py", "tests/test_loss_scaler.py"),
    ),
    Mutant(
        "monitor-deaf",
        "the Inf/NaN monitor alerts above 0.1%",
        "amp_compiler/monitor.py",
        "        if ratio <= self.threshold:",
        "        if ratio <= 10 * self.threshold:",
        ("tests/test_monitor.py", "tests/test_training.py"),
    ),
    Mutant(
        "scale-never-grows",
        "FP16's loss scale grows after growth_interval clean steps (hysteresis too)",
        "amp_compiler/scaler.py",
        "self._growth_factor, self._backoff_factor, self._growth_interval",
        "1.0, self._backoff_factor, self._growth_interval",
        ("tests/test_loss_scaler.py",),
    ),
    Mutant(
        "auto-bf16-anyway",
        "without BF16, FP16 with loss scaling by itself",
        "amp_compiler/device.py",
        '    elif "fp16" in native and loss_scaling:\n        choice, reason = "fp16",',
        '    elif "fp16" in native and loss_scaling:\n        choice, reason = "bf16",',
        ("tests/test_dtype_choice.py", "tests/test_training.py"),
    ),
    Mutant(
        "dtypes-disagree",
        "ranks given different dtypes stop, naming them",
        "amp_compiler/distributed.py",
        "        if len({c for c, _, _ in choices}) > 1:",
        "        if False:",
        ("tests/test_distributed.py", "tests/test_integrations.py", "tests/test_lightning.py"),
        # the settings' check names a dtype too: off as well (the plans' check still stops them)
        more=(("    differ = [n for n in names if len({s.get(n) for s in every}) > 1]", "    differ = []"),),
    ),
    Mutant(
        "settings-disagree",
        "ranks set up differently stop, naming the setting",
        "amp_compiler/training_setup.py",
        "        check_same_settings(self.settings(), self.entry)\n",
        "",
        ("tests/test_distributed.py", "tests/test_integrations.py", "tests/test_lightning.py"),
    ),
    Mutant(
        "plans-disagree",
        "ranks that compiled different plans stop before the first update",
        "amp_compiler/distributed.py",
        "    if len({p for p, _, _ in prints}) > 1:",
        "    if False:",
        ("tests/test_distributed.py",),
    ),
    Mutant(
        "comm-fp32",
        "gradients all-reduced in BF16 where asked",
        "amp_compiler/distributed.py",
        "stats, wire = CommStats(dtype), COMM_DTYPES[dtype]",
        "stats, wire = CommStats(dtype), torch.float32",
        ("tests/test_distributed.py",),
    ),
    Mutant(
        "coverage-lenient",
        "a model mostly outside the compiled graphs is refused",
        "amp_compiler/coverage.py",
        "        refuse = share > max_share or (why is not None and max_share < 1.0)",
        "        refuse = False",
        ("tests/test_coverage_contract.py", "tests/test_training.py"),
    ),
    Mutant(
        "fp32-fed-low",
        "softmax, norms and losses run in FP32 (the plan says so and the casts do it)",
        "passes/insert_casts.py",
        "or want not in AMP_FLOATS or have == want:",
        "or want not in AMP_FLOATS or have == want or want == torch.float32:",
        ("tests/test_backend.py", "tests/test_faithful.py"),
    ),
    Mutant(
        "outputs-low",
        "outputs keep the FP32 model's dtype",
        "passes/insert_casts.py",
        "            if not ctx.options.low_precision_outputs:\n",
        "            if False:\n",
        ("tests/test_passes.py", "tests/test_backend.py"),
    ),
    Mutant(
        "fill-not-refitted",
        "a mask fill of FP32's extreme stays finite in 16 bit",
        "passes/insert_casts.py",
        "            set_arg(node, slot, value)\n            refills += 1\n",
        "            refills += 1\n",
        ("tests/test_faithful.py",),
    ),
    Mutant(
        "autocast-off-ignored",
        "a torch.autocast(enabled=False) region runs in FP32",
        "passes/tag.py",
        "        if any(self.autocast_off):",
        "        if False:",
        ("tests/test_backend.py", "tests/test_autocast_around.py"),
    ),
    Mutant(
        "scale-no-backoff",
        "FP16's loss scale halves on an overflow",
        "amp_compiler/scaler.py",
        "self._growth_factor, self._backoff_factor, self._growth_interval",
        "self._growth_factor, 1.0, self._growth_interval",
        ("tests/test_loss_scaler.py", "tests/test_training.py"),
    ),
    Mutant(
        "generation-unchecked",
        "an exported decoder whose tokens leave PyTorch's FP32 tokens is not written",
        "amp_compiler/onnx_export/generation.py",
        'if dtype == "fp32" and report.generation["tokens_differing"]:',
        "if False:",
        ("tests/test_generation_export.py",),
    ),
    Mutant(
        "beam-idx-ignored",
        "beam_idx reorders the cache a stateful OpenVINO decoder holds",
        "amp_compiler/onnx_export/openvino.py",
        "            reader.replace_source_output(reordered.output(0))\n",
        "            pass\n",
        ("tests/test_generation_export.py",),
    ),
    Mutant(
        "served-unpinned",
        "a BF16 decoder served under OpenVINO's BF16 hint keeps the plan's FP32 nodes in f32",
        "amp_compiler/onnx_export/openvino.py",
        '        if (layer.get("name"), layer.get("type")) in keep:',
        "        if False:",
        ("tests/test_generation_export.py",),
    ),
    Mutant(
        "served-logits-rounded",
        "the served decoder's logits are the FP32 sums of its BF16 head GEMM",
        "amp_compiler/onnx_export/openvino.py",
        "    widened = _logits_from_wide_matmul(model)\n",
        "    widened = set()\n",
        ("tests/test_generation_export.py",),
    ),
    Mutant(
        "export-fp32-weights",
        "the ONNX export stores 16-bit weights",
        "amp_compiler/onnx_export/program.py",
        "    _store_low_weights(ep, LOW_DTYPES[dtype], fake_mode)\n",
        "",
        ("tests/test_onnx_export.py",),
    ),
)


def run(mutant: Mutant, full: bool, timeout: int) -> tuple[bool, float, str]:
    """(caught, seconds, the tail of pytest's output) with ``mutant`` applied."""
    path = ROOT / mutant.path
    original = mutated = path.read_text()
    for find, replace in mutant.edits():
        if mutated.count(find) != 1:
            raise SystemExit(f"{mutant.name}: {find!r} is not in {mutant.path} exactly once: update the mutant")
        mutated = mutated.replace(find, replace)
    tests = [] if full else list(mutant.tests)
    start = time.perf_counter()
    try:
        path.write_text(mutated)
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    finally:
        path.write_text(original)
    said = [ln for ln in (out.stdout + out.stderr).splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    return out.returncode != 0, time.perf_counter() - start, said[-1].strip("= ") if said else "no summary"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--only", help="comma-separated mutant names")
    p.add_argument("--full", action="store_true", help="run the README's whole test command per mutant")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per mutant's test run")
    args = p.parse_args(argv)
    chosen = MUTANTS
    if args.only:
        names = set(args.only.split(","))
        if unknown := names - {m.name for m in MUTANTS}:
            raise SystemExit(f"--only: unknown {sorted(unknown)}; see --list")
        chosen = tuple(m for m in MUTANTS if m.name in names)
    if args.list:
        for m in chosen:
            print(f"{m.name:20} {m.promise}  ({m.path}; {' '.join(m.tests)})")
        return 0
    dirty = subprocess.run(["git", "status", "--porcelain", "--", *{m.path for m in chosen}], cwd=ROOT,
                           capture_output=True, text=True).stdout  # fmt: skip
    if dirty.strip():
        raise SystemExit(f"uncommitted changes in the files to mutate; commit or stash them first:\n{dirty}")
    survivors = []
    for m in chosen:
        caught, seconds, tail = run(m, args.full, args.timeout)
        print(f"{'caught  ' if caught else 'SURVIVED'} {m.name:20} {seconds:6.0f} s  {m.promise}  [{tail}]", flush=True)
        if not caught:
            survivors.append(m.name)
    print(
        f"{len(chosen) - len(survivors)} of {len(chosen)} caught"
        + (f"; survived: {', '.join(survivors)}" if survivors else "")
    )
    return len(survivors)


if __name__ == "__main__":
    sys.exit(main())
