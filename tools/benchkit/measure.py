"""Measurements: time, memory, roofline, where the time goes, one workload's run."""

from __future__ import annotations

import contextlib
import copy
import datetime
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._inductor import metrics as inductor_metrics

from amp_compiler import loss_head
from amp_compiler.cpu_memory import applied as cpu_memory_applied
from amp_compiler.cpu_memory import reuse_freed_memory
from amp_compiler.device import native_dtypes

from .variants import LOSS_HEAD, CastCounter, Variant, make_variant
from .workloads import HEAD_WORKLOADS, SIZES, build

# dense BF16/FP16 tensor-core peak, TFLOP/s, by device name fragment
PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10G": 125.0,
    "V100": 125.0,
    "T4": 65.0,
}


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def saved_bytes(run, params, then=lambda result: result) -> int:
    """Bytes of the tensors autograd saves for backward while ``run()`` executes (storages
    of ``params`` excluded; 16-bit copies of them count); then ``then(result).backward()``."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = run()
    then(result).backward()
    return sum(seen.values())


# Where a step's time goes, by kind of op (profiler self time). On CPU Inductor's generated
# kernels run inside the compiled graph's call, so that call's self time is theirs.
BREAKDOWN_KINDS = (
    ("gemm", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn::", "aten::linear")),
    ("attention", ("flash_attention", "scaled_dot_product", "efficient_attention")),
    ("generated", ("compiledfxgraph", "cpp_fused", "triton_")),
    ("optimizer", ("fused_adam", "_foreach", "adam")),
    ("casts", ("aten::copy_", "aten::_to_copy", "aten::clone")),
)
BREAKDOWN_SHORT = {"gemm": "GEMM", "attention": "attn", "generated": "gen", "optimizer": "opt", "casts": "cast"}


def breakdown_kind(name: str) -> str:
    n = name.lower().replace(" ", "")
    return next((kind for kind, keys in BREAKDOWN_KINDS if any(k in n for k in keys)), "other")


def step_breakdown(v: Variant, x, y, device: str) -> dict[str, float] | None:
    """Shares of one training step's op self time by kind (GEMM, attention, generated kernels,
    optimizer, casts/copies, other). CPU only: on CUDA the work is the GPU's, not these
    events' CPU time."""
    if device != "cpu":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        v.step(x, y)
    totals: dict[str, float] = {}
    for e in prof.key_averages():
        kind = breakdown_kind(e.key)
        totals[kind] = totals.get(kind, 0.0) + e.self_cpu_time_total
    whole = sum(totals.values()) or 1.0
    return {k: t / whole for k, t in sorted(totals.items(), key=lambda kv: -kv[1])}


def format_breakdown(parts: dict[str, float] | None) -> str:
    """The kinds above 3% of the step, largest first: ``GEMM 53 gen 34 opt 7``."""
    if not parts:
        return "-"
    return " ".join(f"{BREAKDOWN_SHORT.get(k, k)} {f:.0%}".replace("%", "") for k, f in parts.items() if f >= 0.03)


def step_peak_bytes(v: Variant, x, y, device: str) -> int:
    """Peak memory of one training step above what was allocated before it. CUDA: the
    caching allocator's peak. CPU: the profiler's allocation events (``profile_memory``;
    Inductor's kernels allocate through the same allocator), summed in time order."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        v.step(x, y)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        v.step(x, y)
    allocations, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:  # every allocation and free (negative size) the CPU allocator reported
        e = todo.pop()
        todo.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            allocations.append((e.start_time_ns, e.extra_fields.alloc_size))
    now = peak = 0
    for _, size in sorted(allocations):
        now += size
        peak = max(peak, now)
    return peak


def gemm_peak_tflops(device: str, dtype: str) -> float:
    """The best GEMM rate of this machine in ``dtype`` (TFLOP/s), the roofline's ceiling:
    square GEMMs of a few sizes, best of three each."""
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
    best = 0.0
    for n in (256, 512) if _emulated(device, dtype) else (1024, 2048, 4096):
        a, b = (torch.randn(n, n, device=device).to(dt) for _ in range(2))
        a @ b
        for _ in range(3):
            best = max(best, 2 * n**3 / timed(lambda a=a, b=b: a @ b, device) / 1e12)
    return best


def _emulated(device: str, dtype: str) -> bool:
    return device == "cpu" and dtype != "fp32" and dtype not in native_dtypes(torch.device("cpu"))[0]


def saved_activation_bytes(v: Variant, x, y) -> int:
    """Bytes saved for backward by one forward and loss of a variant, computed as its step does."""
    n = saved_bytes(lambda: v.loss(x, y), v.model.parameters())
    v.model.zero_grad(set_to_none=True)
    return n


def first_step(v: Variant, x, y) -> None:
    v.first["loss"] = v.step(x, y, v.first).item()


def errors_vs_fp32(base, x, y, loss_fn, variants) -> None:
    """Loss and gradient error of each variant's first step vs FP32 eager's, same weights
    (not with dropout: each run draws its own masks)."""
    if any(isinstance(m, nn.Dropout) and m.p > 0 for m in base.modules()):
        return
    ref = copy.deepcopy(base)
    ref_loss = loss_fn(ref(x), y)
    ref_loss.backward()
    ref_g = torch.cat([p.grad.flatten().double() for p in ref.parameters()])
    for v in variants:
        grab = v.first
        r = v.result
        r["loss_rel_err"] = abs(grab["loss"] - ref_loss.item()) / abs(ref_loss.item())
        if "grads" not in grab:  # a training step without the fused update exposes none
            continue
        g = torch.cat([t.flatten().double() for t in grab["grads"]])
        r["grad_rel_err"] = ((g - ref_g).norm() / ref_g.norm()).item()
        r["grad_cos"] = F.cosine_similarity(g, ref_g, dim=0).item()


def warm_up(workload, dtype, device, variants) -> None:
    """One step of each compiled variant on the tiny size of ``workload``, into a kernel cache
    nobody reads again. What a process pays once (imports, the compiler's workers, headers,
    the first use of a code path) then lands on no measured first call; otherwise it falls
    on whichever compiled variant comes first (fp32-inductor: 36 s against 23 s for
    autocast-inductor on the same LM). Once per run, before the first workload."""
    base, x, y, loss_fn, _ = build(workload, SIZES["tiny"], device)
    base.to(device)
    for name in variants:
        torch._dynamo.reset()
        v = make_variant(name, base, loss_fn, dtype, device)
        if v.compiled:
            with torch._inductor.utils.fresh_cache(dir=os.environ.get("TORCHINDUCTOR_CACHE_DIR"), delete=False):
                v.step(x, y)


def gemm_flops_by_dtype(
    name: str, workload: str, size: dict, flops: float, dtype: str, exact: str = "fp32"
) -> dict[str, float]:
    """A step's GEMM FLOPs by the dtype they run in: FP32 variants all FP32; the exact loss
    head's projection (6 x tokens x d x vocabulary, forward and backward) FP32 beside a
    16-bit body, or three times those FLOPs in BF16 where its products are split
    (``exact``: ``loss_head.exact_products``); every other variant all in ``dtype``."""
    if name.startswith("fp32"):
        return {"fp32": flops}
    if LOSS_HEAD.get(name) == "exact" and workload.startswith("lm"):
        v = HEAD_WORKLOADS.get(workload, size["vocab"])
        head = 6 * size["batch"] * size["seq"] * size["d"] * v
        parts = {dtype: flops - head}
        low, head_flops = ("bf16", 3 * head) if exact in ("split", "split-onednn") else ("fp32", head)
        parts[low] = parts.get(low, 0) + head_flops
        return parts
    return {dtype: flops}


def roofline(name, workload, size, flops, step_ms, dtype, peak_tflops, exact: str = "fp32") -> float | None:
    """The step's ideal time (each dtype's GEMM FLOPs at that dtype's measured peak) over its
    measured time: a fraction of what the GEMMs alone would allow, never above 1 by
    dividing FP32 work by a 16-bit peak."""
    parts = gemm_flops_by_dtype(name, workload, size, flops, dtype, exact)
    if any(not peak_tflops.get(d) for d in parts):
        return None
    ideal_s = sum(f / (peak_tflops[d] * 1e12) for d, f in parts.items())
    return ideal_s / (step_ms / 1e3)


def run_workload(workload, size, dtype, device, reps, steps, variants, log, peak_tflops=None) -> dict:
    base, x, y, loss_fn, flops = build(workload, size, device)
    base.to(device)
    vs, counter = [], CastCounter()
    for name in variants:
        torch._dynamo.reset()
        v = make_variant(name, base, loss_fn, dtype, device)
        counter.current = v
        with counter.installed():
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            # each variant compiles into an empty kernel cache, in memory and on disk: kernels
            # an earlier variant compiled must not make a later one's first call look cheap
            with torch._inductor.utils.fresh_cache(dir=os.environ.get("TORCHINDUCTOR_CACHE_DIR"), delete=False):
                kernels = inductor_metrics.generated_kernel_count
                v.result["first_call_s"] = timed(lambda v=v: first_step(v, x, y), device)
                # what the first call compiles (C++/Triton kernels Inductor generated): on few
                # cores the compiler's time, and unlike seconds the same on every machine
                v.result["kernels"] = inductor_metrics.generated_kernel_count - kernels if v.compiled else None
            v.step(x, y)
            v.result["peak_bytes"] = step_peak_bytes(v, x, y, device)
            v.result["saved_bytes"] = saved_activation_bytes(v, x, y)
            v.result["breakdown"] = step_breakdown(v, x, y, device)
            counter.current = None  # casts are counted in the training graphs only
            with torch.no_grad():
                v.forward(x), v.forward(x)  # compile the inference graph, warm up
        vs.append(v)
        log(f"  {workload}: {name} ready (first call {v.result['first_call_s']:.1f} s)")
    # torch._dynamo.reset() above dropped the earlier variants' compiled frames: recompile
    # them (from the caches) before anything is timed
    for v in vs:
        v.step(x, y)
        with torch.no_grad():
            v.forward(x)
    samples = {v.name: [] for v in vs}
    infer = {v.name: [] for v in vs}
    for _ in range(reps):  # interleaved: every variant once per repetition
        for v in vs:
            samples[v.name].append(timed(lambda v=v: [v.step(x, y) for _ in range(steps)], device) / steps)
        for v in vs:
            with torch.no_grad():
                infer[v.name].append(timed(lambda v=v: v.forward(x), device))
    for v in vs:
        r = v.result
        r["step_ms"] = statistics.median(samples[v.name]) * 1e3
        r["step_ms_samples"] = [s * 1e3 for s in samples[v.name]]
        r["infer_ms"] = statistics.median(infer[v.name]) * 1e3
        r["casts"] = v.casts if v.compiled else None
        if v.backend is not None:
            s = v.backend.plan().summary()
            r["plan"] = {"nodes": s["nodes"], "casts": s["casts"], "cast_bytes": s["cast_bytes"]}
        if flops:
            r["tflops"] = flops / (r["step_ms"] / 1e3) / 1e12
            exact = loss_head.exact_products(torch.device(device), size["d"], measure=False)
            r["roofline"] = roofline(v.name, workload, size, flops, r["step_ms"], dtype, peak_tflops or {}, exact)
        if flops and device == "cuda":
            peak = next((p for k, p in PEAK_TFLOPS.items() if k in torch.cuda.get_device_name()), None)
            r["mfu"] = r["tflops"] / peak if peak else None
    errors_vs_fp32(base, x, y, loss_fn, vs)
    ref = {v.name: v.result["step_ms"] for v in vs}
    for v in vs:
        if "fp32-eager" in ref:
            v.result["vs_fp32_eager"] = ref["fp32-eager"] / v.result["step_ms"]
        if "autocast-inductor" in ref:
            v.result["vs_autocast_inductor"] = v.result["step_ms"] / ref["autocast-inductor"]
        if "fp32-inductor" in ref:
            v.result["vs_fp32_inductor"] = v.result["step_ms"] / ref["fp32-inductor"]
    return {"size": size, "flops_per_step": flops, "variants": {v.name: v.result for v in vs}}


def reuse_memory(asked: bool) -> None:
    """``--reuse-memory``: keep freed CPU memory for every variant of the run. The setting is
    process-wide, so a run compares its variants under one allocator setting: amp's variants
    get ``reuse_cpu_memory=False`` (``variants.SAME_ALLOCATOR``) and leave it to this."""
    if asked:
        done = reuse_freed_memory()
        if not done.applied:
            raise SystemExit(f"--reuse-memory: not applied: {done.reason}")


def _allocator() -> str:
    done = cpu_memory_applied()
    return f"freed memory reused ({done.reason})" if done else "the C library's default"


def machine(device: str, dtype: str, reason: str) -> dict:
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    info = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu,
        "threads": torch.get_num_threads(),
        "cpu_kind": native_dtypes(torch.device("cpu"))[1],
        "device": device,
        "dtype": dtype,
        "dtype_reason": reason,
        "command": " ".join(["python"] + sys.argv),
        "cpu_memory": _allocator(),
        "exact_products": loss_head.exact_products(torch.device(device), measure=False),
        "bf16_products": loss_head.takes_bf16_products(torch.device(device)),
        # per head width the exact head ran at: one block's GEMM split and FP32, in ms
        "split_timings": {str(w): list(ms) for w, ms in loss_head.split_timings().items()},
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info
