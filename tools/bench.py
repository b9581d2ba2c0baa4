"""Side-by-side benchmark: FP32, torch.autocast and amp, one process, interleaved repetitions.

    python tools/bench.py                                  # CPU: every workload, a table
    python tools/bench.py --json bench.json --plot bench.png
    python tools/bench.py --table bench.json               # the README table from a JSON
    python tools/bench.py --device cuda --size gpt2-small  # adds TFLOP/s and MFU

Variants (each from the same initial weights, AdamW):
  fp32-eager, fp32-inductor, autocast-eager, autocast-inductor (GradScaler under FP16),
  amp (torch.compile(backend=AmpBackend)), amp-step (make_train_step: fused update); when
  named: amp-fused-attention (amp with every SDPA fused), amp-step-lowmem/-unfused/-fused/-exact.
  --reuse-memory keeps freed CPU memory for every variant (process-wide; amp's own choice off).
Workloads: lm-explicit (decoder, matmul-softmax-matmul attention), lm-sdpa (decoder,
scaled_dot_product_attention), encoder (nn.TransformerEncoder), encoder-dropout (the same
at PyTorch's default dropout 0.1), cnn (conv + BatchNorm). Model code nobody here wrote,
lm-head-32k and lm-head-128k (a 2-layer d=256 decoder over a real vocabulary, 4 x 512 tokens,
the loss as Hugging Face writes it: where the loss head dominates memory; variants
fp32-eager, autocast-inductor and make_train_step with the loss head unfused, fused and
exact; not in the default list). Model code nobody here wrote,
Hugging Face transformers built from configs of the same size (optional, not in the
default list): hf-gpt2, hf-llama, hf-bert (GPT-2 and BERT at their default dropout 0.1),
and decoders with other attention and MLP layouts, dropout off: hf-qwen2 (grouped KV
heads, biased QKV), hf-neox (parallel residual, rotary on a quarter of each head), hf-opt
(learned positions, ReLU), hf-gemma (one KV head, GeGLU), hf-phi (partial rotary, parallel
block).
Metrics: median training-step and inference time over interleaved repetitions, first-call
time (compile included, caches off, each variant into an empty kernel cache, after every
variant has run once on a tiny model: no one-time process cost lands on one), activation
bytes saved for backward (parameters excluded; 16-bit weight copies count), peak memory
of a training step above what was held before it (CUDA: the allocator's peak; CPU: the
profiler's allocation events summed in time order), achieved matmul TFLOP/s of a step and
its fraction of the 16-bit GEMM peak measured on this machine at the start of the run
(the roofline column; workloads whose FLOPs are counted), floating casts in the training
graphs Inductor compiled (forward + backward), the
kernels Inductor generated for the first call (what it compiles, the same on every machine),
on CPU where one step's time goes by kind of op (profiler self time: GEMM, attention,
Inductor-generated kernels, optimizer, casts/copies, other; kinds under 3% left out),
loss and gradient error vs FP32 eager.

These machines are shared and noisy: compare the ratios of one run, never absolute times
across runs. Do not run beside another torch process.

This file is the command line; the work is in ``tools/benchkit/`` by job: ``workloads``
(models, inputs, losses), ``variants`` (each way a model is trained and run),
``measure`` (time, memory, roofline, breakdown, one workload's run), ``report`` (table, plot).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

import torch
from benchkit.measure import (  # noqa: F401 - bench.X for scripts and tests
    BREAKDOWN_KINDS,
    BREAKDOWN_SHORT,
    PEAK_TFLOPS,
    _emulated,
    breakdown_kind,
    errors_vs_fp32,
    first_step,
    format_breakdown,
    gemm_flops_by_dtype,
    gemm_peak_tflops,
    machine,
    reuse_memory,
    roofline,
    run_workload,
    saved_activation_bytes,
    saved_bytes,
    step_breakdown,
    step_peak_bytes,
    timed,
    warm_up,
)
from benchkit.report import (  # noqa: F401 - bench.X for scripts and tests
    COLUMNS,
    baseline,
    markdown,
    paired_ratio,
    plot,
    rows,
)
from benchkit.variants import (  # noqa: F401 - bench.X for scripts and tests
    EXTRA_VARIANTS,
    HEAD_VARIANTS,
    LOSS_HEAD,
    LOW_VARIANTS,
    LOWMEM_BUDGET,
    VARIANTS,
    CastCounter,
    Variant,
    make_variant,
)
from benchkit.workloads import (  # noqa: F401 - bench.X for scripts and tests
    CNN,
    HEAD_SIZE,
    HEAD_WORKLOADS,
    HF_WORKLOADS,
    LM,
    SIZES,
    WORKLOADS,
    Block,
    Encoder,
    build,
    cls_loss,
    hf_loss,
    hf_model,
    lm_loss,
)

from amp_compiler.atomic import write_text
from amp_compiler.device import resolve_dtype


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--size", choices=list(SIZES), default=None, help="LM dimensions (default: cpu on CPU, gpt2-small on CUDA)"
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "bf16", "fp16", "fp32"],
        default="auto",
        help="fp32: what auto runs where 16 bit is emulated (amp on its FP32 path)",
    )
    p.add_argument(
        "--workloads",
        default=None,
        help=f"comma-separated, from {','.join(WORKLOADS)} (default: all), {','.join(HEAD_WORKLOADS)} "
        f"(the loss head) and {','.join(HF_WORKLOADS)} (transformers)",
    )
    p.add_argument("--batch", type=int, help="batch size instead of the size's (loss-head workloads: 4)")
    p.add_argument("--seq", type=int, help="sequence length instead of the size's (loss-head workloads: 512)")
    p.add_argument(
        "--variants",
        default=None,
        help=f"comma-separated subset of {','.join(VARIANTS)} (default: all), "
        f"and {','.join(EXTRA_VARIANTS)} (only when named)",
    )
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions (median)")
    p.add_argument("--steps", type=int, default=3, help="training steps per repetition")
    p.add_argument("--json", help="write every measurement to this file")
    p.add_argument("--plot", help="write a PNG of step-time ratios (matplotlib)")
    p.add_argument("--table", metavar="JSON", help="print the markdown table of a saved run and exit")
    p.add_argument(
        "--reuse-memory",
        action="store_true",
        help="keep freed CPU memory for reuse in every variant (amp_compiler.reuse_freed_memory)",
    )
    a = p.parse_args(argv)
    if a.table:
        with open(a.table) as f:
            print(markdown(json.load(f)))
        return 0
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    size = SIZES[a.size or ("gpt2-small" if a.device == "cuda" else "cpu")]
    workloads = (
        a.workloads.split(",")
        if a.workloads
        else (["lm-sdpa", "lm-explicit"] if a.device == "cuda" else list(WORKLOADS))
    )
    heads = [w for w in workloads if w in HEAD_WORKLOADS]
    if heads and len(heads) != len(workloads):
        p.error("run the loss-head workloads on their own (their model size is their own)")
    if heads:
        size = {**HEAD_SIZE, "vocab": 0} if a.size is None else size
    size = {**size, **({"batch": a.batch} if a.batch else {}), **({"seq": a.seq} if a.seq else {})}
    variants = a.variants.split(",") if a.variants else list(HEAD_VARIANTS if heads else VARIANTS)
    all_workloads = set(WORKLOADS + HF_WORKLOADS) | set(HEAD_WORKLOADS)
    for bad in set(workloads) - all_workloads | set(variants) - set(VARIANTS + EXTRA_VARIANTS):
        p.error(f"unknown workload or variant {bad!r}")
    dtype, reason = resolve_dtype(a.dtype, torch.device(a.device))
    if dtype == "fp32":
        variants = [v for v in variants if v not in LOW_VARIANTS]
        why = "asked for" if a.dtype == "fp32" else "16 bit is emulated here; pass --dtype bf16 to time it anyway"
        print(f"{reason}: autocast variants left out ({why})", flush=True)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    reuse_memory(a.reuse_memory)
    results = {"machine": machine(a.device, dtype, reason), "workloads": {}}
    peak = {d: gemm_peak_tflops(a.device, d) for d in {dtype, "fp32"}}
    results["machine"]["gemm_peak_tflops"] = peak
    log("GEMM peak measured here (TFLOP/s): " + ", ".join(f"{d} {t:.3g}" for d, t in peak.items()))
    # an emulated dtype's GEMM rate is no ceiling (other shapes emulate faster): no roofline for it
    peak = {d: t for d, t in peak.items() if not _emulated(a.device, d)}
    # A fresh kernel cache for the run (each variant's first call gets its own inside it):
    # compiled C++/Triton kernels of an earlier run would hide the first-call cost (the FX
    # and AOT caches are switched off per variant as well).
    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    run_cache = tempfile.mkdtemp(prefix="amp-bench-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = run_cache
    try:
        if size != SIZES["tiny"] and not heads:  # a tiny run is a smoke test: it would warm up on itself
            log("warming up (one-time costs of the process)")
            warm_up(workloads[0], dtype, a.device, variants)
        for w in workloads:
            results["workloads"][w] = run_workload(w, size, dtype, a.device, a.reps, a.steps, variants, log, peak)
            if a.json:  # a long run keeps what it has measured so far
                write_text(a.json, json.dumps(results, indent=1))
    finally:
        if saved is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved
        shutil.rmtree(run_cache, ignore_errors=True)  # loaded kernels stay mapped; the files go
    print(markdown(results))
    if a.plot:
        plot(results, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
