"""A restarted job's first training step: amp against Inductor + autocast, cold and warm caches.

    python tools/restart_bench.py                         # hf-gpt2, 4 layers, d=512
    python tools/restart_bench.py --layers 12 --d 768 --json bench/restart.json

Each variant runs in fresh processes over one empty cache directory of its own
(TORCHINDUCTOR_CACHE_DIR): the first run fills it (cold), the next ones are restarts (warm,
``--warm-runs`` of them, the variants interleaved; medians reported).
A child process times its first step from the ``torch.compile`` (or ``make_train_step``)
call on (Dynamo, amp's planning, AOTAutograd, Inductor and the step itself) and, for amp,
the part spent planning (``AmpBackend.rewrite``). Run nothing else that uses torch
meanwhile: these are wall-clock seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

VARIANTS = ("autocast-inductor", "amp", "amp-step")


def child(args) -> dict:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import torch
    from benchkit.variants import make_variant
    from benchkit.workloads import build

    import amp_compiler

    torch.set_num_threads(args.threads)
    heads = max(args.d // 64, 1)
    size = dict(d=args.d, layers=args.layers, heads=heads, batch=args.batch, seq=args.seq, vocab=args.vocab)
    model, x, y, loss_fn, _ = build(args.workload, size, "cpu")
    planning, plans = [0.0], {"planned": 0, "restored": 0}
    rewrite = amp_compiler.AmpBackend.rewrite

    def timed(self, *a, **k):
        t0 = time.perf_counter()
        try:
            record = rewrite(self, *a, **k)
        finally:
            planning[0] += time.perf_counter() - t0
        plans["restored" if record.restored else "planned"] += 1  # from amp's plan cache or afresh
        return record

    amp_compiler.AmpBackend.rewrite = timed
    collecting = {"since": 0.0, "s": [0.0, 0.0, 0.0], "n": [0, 0, 0], "full": []}

    def on_gc(phase, info):  # the collector's pauses, by generation: a full one scans the heap
        if phase == "start":
            collecting["since"] = time.perf_counter()
        else:
            collecting["s"][info["generation"]] += time.perf_counter() - collecting["since"]
            collecting["n"][info["generation"]] += 1
            if info["generation"] == 2:  # where a full one struck: the innermost frame of torch or amp
                collecting["full"].append(_innermost_frame())

    gc.callbacks.append(on_gc)
    # from torch.compile (or make_train_step) on: what each pays to set up counts (Inductor's
    # own torch.compile imports its compiler there; amp's backend at its first compile)
    t0 = time.perf_counter()
    variant = make_variant(args.child, model, loss_fn, "bf16", "cpu")
    variant.step(x, y)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    variant.step(x, y)
    second = time.perf_counter() - t0
    from torch._dynamo.utils import counters  # a measuring tool: torch's own cache counters

    caches = {k: dict(counters[k]) for k in ("aot_autograd", "inductor") if counters[k]}
    caches = {k: {n: c for n, c in v.items() if "cache" in n or "bypass" in n} for k, v in caches.items()}
    return {
        "first_step_s": first,
        "planning_s": planning[0],
        "plans": plans,
        "second_step_s": second,
        "caches": caches,
        "gc_s": collecting["s"],
        "gc_collections": collecting["n"],
        "full_collections_in": collecting["full"],
        "objects": len(gc.get_objects()),
        "torch": torch.__version__,
    }


def _innermost_frame() -> str:
    ours = [f for f in traceback.extract_stack()[:-2] if "torch" in f.filename or "amp_compiler" in f.filename]
    return f"{ours[-1].filename.rsplit('site-packages/', 1)[-1]}:{ours[-1].name}" if ours else "-"


def replanned(rows: dict) -> str | None:
    """A restart that planned again measured no restart of amp's: the warning to print beside
    the figures, or None."""
    afresh = sum(w["plans"]["planned"] for r in rows.values() for w in r["warm_runs"])
    if not afresh:
        return None
    off = os.environ.get("AMP_COMPILER_PLAN_CACHE") == "0"
    why = "AMP_COMPILER_PLAN_CACHE=0 turns amp's plan cache off" if off else "amp's plan cache missed"
    return f"warning: restarts planned {afresh} graph(s) afresh ({why})"


def run(variant: str, cache: str, args) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    cmd = [sys.executable, __file__, "--child", variant] + [
        f"--{k}={getattr(args, k)}" for k in ("workload", "d", "layers", "batch", "seq", "vocab", "threads")
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise SystemExit(f"{variant} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--workload", default="hf-gpt2")
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--warm-runs", type=int, default=3, help="restarts per variant (the median is reported)")
    p.add_argument("--json", metavar="FILE", help="write the figures here as well")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    variants = args.variants.split(",")
    with contextlib.ExitStack() as stack:
        caches = {v: stack.enter_context(tempfile.TemporaryDirectory()) for v in variants}
        rows = {v: {"cold": run(v, caches[v], args), "warm_runs": []} for v in variants}
        for _ in range(args.warm_runs):  # interleaved, so a noisy minute hits every variant
            for v in variants:
                rows[v]["warm_runs"].append(run(v, caches[v], args))
    for r in rows.values():
        r["warm"] = {k: statistics.median(w[k] for w in r["warm_runs"]) for k in ("first_step_s", "planning_s")}
    base = rows.get("autocast-inductor")
    print(f"{'variant':<20} {'cold s':>8} {'warm s':>8} {'warm planning s':>16} {'warm vs autocast':>17}")
    for name, r in rows.items():
        ratio = r["warm"]["first_step_s"] / base["warm"]["first_step_s"] if base else float("nan")
        print(
            f"{name:<20} {r['cold']['first_step_s']:8.2f} {r['warm']['first_step_s']:8.2f} "
            f"{r['warm']['planning_s']:16.2f} {ratio:16.2f}x"
        )
    print(f"warm: medians of {args.warm_runs} restarts each, variants interleaved")
    if warning := replanned(rows):
        print(warning)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
