"""Which precision a device runs fast: the probe behind ``dtype="auto"``.

``auto`` picks BF16 where the device computes it natively (CUDA sm_80+, a CPU
whose oneDNN reports native BF16), FP16 with dynamic loss scaling where only
FP16 is native (CUDA sm_70/sm_75, a CPU with native FP16; the backend alone,
which cannot scale the loss, picks FP32 there), and otherwise FP32: a CPU
without native BF16 emulates it 37-92x slower than FP32 (a 512x512 matmul), so
mixed precision there would be correct and useless; that choice is said once per
process at WARNING level. An explicit "bf16"/"fp16"
on such a device still does what was asked, with one WARNING per process giving
the slowdown a tiny matmul measured.

Tests replace ``native_dtypes`` to play other devices.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import statistics
import time

import torch

from .upstream.torch_private import private

log = logging.getLogger("amp_compiler")

_warned: set[tuple[str, str]] = set()


def native_dtypes(device: torch.device) -> tuple[frozenset[str], str]:
    """(16-bit dtypes ``device`` computes natively, a description of the device)."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return frozenset(), "CUDA is not available"
        major, minor = torch.cuda.get_device_capability(device)
        name = f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"
        if major >= 8:
            return frozenset({"bf16", "fp16"}), f"{name} has BF16 tensor cores"
        if major == 7:
            return frozenset({"fp16"}), f"{name} has FP16 tensor cores, no BF16 (needs sm_80+)"
        return frozenset(), f"{name} has no 16-bit tensor cores"
    if device.type == "cpu":
        return cpu_native(
            torch.ops.mkldnn._is_mkldnn_bf16_supported(), torch.ops.mkldnn._is_mkldnn_fp16_supported(), _cpu_flags()
        )
    if device.type == "mps":
        return frozenset({"bf16", "fp16"}), "Apple GPU"
    return frozenset(), f"no 16-bit capability probe for device type {device.type!r}"


def cpu_native(onednn_bf16: bool, onednn_fp16: bool, flags: dict | None) -> tuple[frozenset[str], str]:
    """``native_dtypes`` of a CPU from what oneDNN reports and the x86 instruction flags.

    On x86, oneDNN also reports BF16 for AVX-512 without BF16 instructions (Skylake and
    Cascade Lake Xeons), where it emulates BF16 arithmetic, slower than FP32 (oneDNN's and
    OpenVINO's notes): not native. ``flags`` is ``torch.cpu.get_capabilities()`` on x86,
    else None.
    """
    bf16 = onednn_bf16 and (flags is None or bool(flags.get("avx512_bf16") or flags.get("amx_bf16")))
    fp16 = onednn_fp16 and (flags is None or bool(flags.get("avx512_fp16") or flags.get("amx_fp16")))
    found = frozenset(d for d, ok in (("bf16", bf16), ("fp16", fp16)) if ok)
    if bf16:
        return found, "CPU with native BF16 (oneDNN)"
    if fp16:
        return found, "CPU with native FP16, no native BF16 (oneDNN)"
    if onednn_bf16:
        return found, ("CPU with AVX-512 but no BF16 instructions (oneDNN emulates BF16 there, slower than FP32)")
    return found, "CPU without native BF16 or FP16 (oneDNN emulates them)"


@functools.cache
def cpu_has_amx() -> bool:
    """Whether this CPU multiplies BF16 matrices in AMX tiles (6x its FP32 GEMM rate, against
    ~2.8x for AVX512-BF16 alone)."""
    flags = _cpu_flags()
    return bool(flags and flags.get("amx_bf16"))


def _cpu_flags() -> dict | None:
    get = getattr(torch.cpu, "get_capabilities", None)
    try:
        flags = get() if get is not None else None
    except Exception:  # a probe must never stop a compile
        return None
    if not flags or flags.get("architecture") not in ("x86_64", "x86", "i386", "i686"):
        return None
    return flags


def resolve_dtype(requested: str, device: torch.device, *, loss_scaling: bool = True) -> tuple[str, str]:
    """Turn "bf16" / "fp16" / "fp32" / "auto" into a concrete choice and its reason.

    ``loss_scaling``: whether the caller scales the loss (the training step does); without
    it ``auto`` never picks FP16, whose small gradients underflow to zero unscaled.
    """
    native, about = native_dtypes(device)
    if requested != "auto":
        if requested != "fp32" and requested not in native:
            _warn_emulated(requested, device, about)
            return requested, f"dtype={requested!r} requested ({about}: emulated, slower than FP32)"
        return requested, f"dtype={requested!r} requested"
    if "bf16" in native:
        choice, reason = "bf16", f"auto: {about}"
    elif "fp16" in native and loss_scaling:
        choice, reason = "fp16", f"auto: {about}; FP16 with dynamic loss scaling"
    elif "fp16" in native:
        choice, reason = (
            "fp32",
            (
                f"auto: {about}; FP32, since FP16 needs loss scaling, which the "
                "backend alone does not apply (make_train_step does; or pass "
                "dtype='fp16' and use torch.amp.GradScaler)"
            ),
        )
    else:
        choice, reason = (
            "fp32",
            (f"auto: {about}; FP32, since 16 bit would run slower (the plan is still recorded, not applied)"),
        )
    if choice == "fp32" and ("auto-fp32", reason) not in _warned:
        # amp chose to do nothing 16-bit: said once per process, where a user sees it
        _warned.add(("auto-fp32", reason))
        log.warning("amp: dtype='auto' runs FP32 on %s: %s. Pass dtype='bf16' to run the plan anyway.", device, reason)
    else:
        log.info("amp dtype on %s: %s (%s)", device, choice, reason)
    return choice, reason


def _warn_emulated(dtype: str, device: torch.device, about: str) -> None:
    key = (dtype, device.type)
    if key in _warned:
        return
    _warned.add(key)
    factor = slowdown(dtype, device)
    measured = f"a 256x256 matmul ran {factor:.0f}x slower than in FP32 here" if factor else "not measured"
    log.warning(
        "amp: dtype=%r on %s: %s runs emulated (%s). Running as asked; dtype='auto' would choose FP32 on this device.",
        dtype,
        device,
        dtype.upper(),
        measured,
    )


def slowdown(dtype: str, device: torch.device, n: int = 256, reps: int = 5) -> float | None:
    """Median time of an ``n``x``n`` matmul in ``dtype`` over FP32's, on ``device``."""
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    try:
        a = torch.randn(n, n, device=device)
        times = {}
        for dt in (torch.float32, low):
            x = a.to(dt)
            x @ x  # warm-up: kernel selection
            samples = []
            for _ in range(reps):
                _sync(device)
                t0 = time.perf_counter()
                x @ x
                _sync(device)
                samples.append(time.perf_counter() - t0)
            times[dt] = statistics.median(samples)
        return times[low] / max(times[torch.float32], 1e-9)
    except Exception:  # a probe must never stop a compile
        return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_of(example_inputs) -> torch.device:
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def module_device(module: torch.nn.Module) -> torch.device:
    """Where ``module`` runs: its first parameter's device, CPU without parameters."""
    return next((p.device for p in module.parameters()), torch.device("cpu"))


# the container's memory limit: cgroup v2, then v1
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def cgroup_limit() -> int | None:
    """The smallest memory limit a cgroup file states for this process, None where none does
    (no container, or "max")."""
    limits = []
    for path in CGROUP_LIMITS:
        try:
            with open(path) as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit():
            limits.append(int(limit))
    return min(limits) if limits else None


def memory_bytes(device: torch.device) -> int:
    """The memory a job on ``device`` can hold: a GPU's total memory; on CPU the machine's RAM,
    or the container's limit (cgroup) where that is smaller. Totals, not what is free now:
    the same figure at every compile and on every rank of a uniform job."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = cgroup_limit()
    return int(ram if limit is None else min(ram, limit))


# -- what a GEMM here writes, and in what it multiplies


def mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of 16-bit matrices, the FP32 accumulator written out unrounded."""
    return torch.mm(a, b, out_dtype=torch.float32)


_FP32_OUT_MM: dict[tuple[str, torch.dtype], bool] = {}


def gemm_writes_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a GEMM of ``dtype`` matrices on ``device`` writes its FP32 accumulator (``mm``
    with ``out_dtype``: CUDA; torch 2.13 has no CPU kernel for it). Probed once per device."""
    key = (str(device), dtype)
    if key not in _FP32_OUT_MM:
        ok = device.type != "cpu"
        if ok:
            try:
                one = torch.ones(1, 1, dtype=dtype, device=device)
                ok = mm_fp32_out(one, one).dtype == torch.float32
            except (RuntimeError, TypeError, NotImplementedError):
                ok = False
        _FP32_OUT_MM[key] = ok
    return _FP32_OUT_MM[key]


@contextlib.contextmanager
def bf16_products():
    """oneDNN runs the FP32 GEMMs inside with their products in BF16 (``fpmath_mode`` bf16),
    accumulating and writing FP32. The setting is process-wide: an FP32 GEMM another thread
    runs meanwhile takes it too."""
    matmul = torch.backends.mkldnn.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "bf16"
    try:
        yield
    finally:
        matmul.fp32_precision = before


_BF16_PRODUCTS: dict[str, bool] = {}


def bf16_products_native(device: torch.device) -> bool:
    """Whether ``bf16_products`` takes effect on this CPU: oneDNN implements it with AMX (on
    an AVX512-BF16 CPU without AMX it computes in FP32, as torch 2.13's build does here).
    Probed once: ``1 + 2^-10`` is no BF16, so a BF16 product of it gives 32, an FP32 one 32.03."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if "cpu" not in _BF16_PRODUCTS:
        ok = "bf16" in native_dtypes(device)[0]
        if ok:
            try:  # on real tensors, even where a compile's fake mode is active
                with private("torch._subclasses.fake_tensor.unset_fake_temporarily")(), bf16_products():
                    a = torch.full((32, 32), 1 + 2**-10)
                    ok = torch.mm(a, torch.ones(32, 32))[0, 0].item() == 32.0
            except (RuntimeError, AttributeError):
                ok = False
        _BF16_PRODUCTS["cpu"] = ok
    return _BF16_PRODUCTS["cpu"]
