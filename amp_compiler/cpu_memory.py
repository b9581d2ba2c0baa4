"""Keep freed CPU memory for reuse, as PyTorch's CUDA caching allocator keeps GPU memory.

PyTorch's CPU tensors come from malloc. glibc serves every block above 32 MiB with a
fresh ``mmap`` and unmaps it on free, so each training step of a model with large
activations faults in and zeroes every page of them again: a 50k-vocabulary decoder
(2 x 1024 tokens, 2-core AVX512-BF16 CPU) spends 20-30% of its step there when it returns
its logits, ~9% when it does not. ``reuse_freed_memory`` raises glibc's mmap and trim
thresholds (``mallopt``) so freed blocks stay in the process and are reused: no faults.

The price is memory: the process keeps its peak, and the heap can fragment beyond it
(that decoder's peak RSS 1213 -> 1606 MiB when it returns its logits; unchanged when it
does not). The training loops (``make_train_step``, ``AmpCallback``, the Lightning plugins)
and the bare backend apply it where a step maps fresh memory and the machine has room
(the ``reuse_cpu_memory`` option, ``ReuseRule``). A user's own tuning (glibc's ``MALLOC_*`` variables or tunables, a
preloaded jemalloc/tcmalloc/mimalloc) is left alone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from dataclasses import dataclass

from .device import cgroup_limit

try:
    import resource
except ImportError:  # not Unix
    resource = None

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_INT_MAX = 2**31 - 1  # mallopt takes an int; glibc accepts this for both thresholds
_USER_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_TOP_PAD_")
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


@dataclass(frozen=True)
class MemoryReuse:
    applied: bool  # freed blocks now stay in the process (this call or an earlier one)
    reason: str


_applied: MemoryReuse | None = None


def _libc():
    """glibc's ``mallopt``, or None with why not."""
    if not sys.platform.startswith("linux"):
        return None, f"not Linux ({sys.platform}): the system allocator is left as it is"
    try:
        libc = ctypes.CDLL(None)
        version = libc.gnu_get_libc_version
        version.restype = ctypes.c_char_p
        return libc, f"glibc {version().decode()}"
    except (OSError, AttributeError):
        return None, "the C library is not glibc: its allocator is left as it is"


def _user_tuned() -> str | None:
    """Why the user's own allocator settings stand, or None."""
    if set_ := [k for k in _USER_ENV if k in os.environ]:
        return f"{', '.join(set_)} set: the user's glibc malloc settings stand"
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets glibc.malloc: the user's settings stand"
    preload = os.environ.get("LD_PRELOAD", "")
    if other := next((a for a in _OTHER_ALLOCATORS if a in preload), None):
        return f"{other} is preloaded (LD_PRELOAD): it manages the memory, not glibc"
    return None


def reuse_freed_memory() -> MemoryReuse:
    """Have glibc keep freed CPU memory for reuse instead of unmapping it (see the module
    docstring for what it saves and costs). Process-wide and for the process's life;
    idempotent. Returns whether it applies, and why not where it does not."""
    global _applied
    if _applied is not None:
        return _applied
    if why := _user_tuned():
        return MemoryReuse(False, why)
    libc, which = _libc()
    if libc is None:
        return MemoryReuse(False, which)
    ok = libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(_INT_MAX)) == 1
    ok = ok and libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(_INT_MAX)) == 1
    if not ok:
        return MemoryReuse(False, f"{which} refused the thresholds (mallopt returned 0)")
    _applied = MemoryReuse(True, f"{which}: mmap and trim thresholds raised to 2 GiB")
    log.info("amp: freed CPU memory is kept for reuse (%s)", _applied.reason)
    return _applied


def applied() -> MemoryReuse | None:
    """What ``reuse_freed_memory`` applied in this process, None while nothing has."""
    return _applied


# A step that maps this much afresh has blocks glibc unmaps and maps again every step
FRESH_PER_STEP = 64 * 2**20


def reuse_if_remapping(mapped: int) -> MemoryReuse:
    """``reuse_cpu_memory``'s default: reuse freed memory where a step (after the first update)
    mapped ``mapped`` bytes afresh, at least ``FRESH_PER_STEP``, and the machine
    has room for the process to double its peak (fragmentation grew it by a third here)."""
    mib = mapped / 2**20
    if mapped < FRESH_PER_STEP:
        return MemoryReuse(False, f"a step maps {mib:.0f} MiB afresh (under {FRESH_PER_STEP >> 20}): nothing to save")
    room, peak = room_bytes(), peak_rss_bytes()
    if room is not None and peak is not None and room < peak:
        return MemoryReuse(
            False,
            f"a step maps {mib:.0f} MiB afresh, but {room >> 20} MiB are free for a process whose "
            f"peak is {peak >> 20} MiB: glibc's default kept (reuse_cpu_memory=True applies it)",
        )
    done = reuse_freed_memory()
    if done.applied:
        log.info("amp: a training step mapped %.0f MiB of fresh CPU memory; freed memory is now reused", mib)
        return MemoryReuse(True, f"a step mapped {mib:.0f} MiB afresh; {done.reason}")
    return done


class ReuseRule:
    """``reuse_cpu_memory`` where a step can be seen (make_train_step, AmpCallback, the Lightning
    plugins, the bare backend's first training graph): None measures one step and decides by
    ``reuse_if_remapping``, True applies now, False never. ``tick()`` at the same point of
    every step; the stretch from tick ``at`` (the step after the first update: the first
    compiles and allocates the optimizer's state) to the next is the step measured.
    ``decision`` says what was decided, None before."""

    def __init__(self, asked: bool | None, on_cpu: bool, at: int = 1):
        self.decision: MemoryReuse | None = None
        if asked:
            self.decision = reuse_freed_memory()
        elif asked is False:
            self.decision = MemoryReuse(False, "reuse_cpu_memory=False")
        self._watch = asked is None and on_cpu and resource is not None
        self._at, self._ticks, self._fresh = at, 0, None

    def tick(self) -> None:
        if not self._watch or self.decision is not None:
            return
        if self._fresh is not None:
            self.decision = reuse_if_remapping(fresh_bytes() - self._fresh)
        elif self._ticks == self._at:
            self._fresh = fresh_bytes()
        self._ticks += 1


def fresh_bytes() -> int | None:
    """Bytes this process has faulted in so far (minor page faults x page size); what a
    stretch of code mapped afresh is the difference of two readings. None where unknown."""
    if resource is None:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int | None:
    """This process's peak resident memory (Linux reports KiB)."""
    return None if resource is None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def room_bytes() -> int | None:
    """Memory the process could still take: the kernel's ``MemAvailable``, or what is left
    under the container's limit (cgroup v2) where that is less. None where neither is known."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except OSError:
        pass
    limit = cgroup_limit()
    try:
        with open("/sys/fs/cgroup/memory.current") as f:
            used = f.read().strip()
        if limit is not None and used.isdigit():
            found.append(limit - int(used))
    except OSError:
        pass
    return min(found) if found else None
