"""Planned graphs remembered across processes, beside Inductor's own caches.

A job that restarts (preemption, the next epoch's script, a second rank on one machine)
traces the same model again; Inductor's caches make its own work cache hits, and amp's
planning (capture to ATen, the passes: ~0.4 s of a 4-layer GPT-2-style decoder's warm
first step) would then be most of the difference to Inductor + autocast. A plan is a pure
function of what the key holds:

- Dynamo's graph (its code and its subgraphs') and each input's type, sizes, strides,
  dtype, device and ``requires_grad``;
- every option (the policy file's fingerprints included), the dtype and the autocast
  around the call, whether gradients are on;
- amp's own source (every file of ``amp_compiler`` and its passes), torch's release;
- what the passes ask the machine: its 16-bit capability, memory, the loss head's settings.

Cached only where the graph goes to Inductor by name (a callable inner compiler may read
the values a restored graph leaves out), holds no real tensors (an optimizer step's graph
holds the parameters it updates) and no ``dump_dir`` asks the passes to write their graphs.
The warnings the planning logged are replayed on a hit. ``AMP_COMPILER_PLAN_CACHE=0`` or
Inductor's ``force_disable_caches`` turns it off.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import logging
import os
import pathlib
import pickle
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import torch

from . import passes
from .atomic import write_bytes
from .capture import held_tensors, keep_dynamo_inputs
from .device import cpu_has_amx, device_of, memory_bytes, native_dtypes
from .loss_head import settings as head_settings
from .options import AmpOptions
from .plan import GraphPlan
from .upstream.torch_private import private

log = logging.getLogger("amp_compiler")

FORMAT = 3  # bumped when what is stored changes shape
ENV = "AMP_COMPILER_PLAN_CACHE"
# meta a restored graph leaves out: fake values (Inductor traces the graph again from its
# inputs; the plan's sizes were taken before storing)
_VALUE_KEYS = ("val", "tensor_meta", "example_value")


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0" and not private("torch._inductor.config").force_disable_caches


@functools.cache
def _source_digest() -> str:
    """amp's own code: a changed pass or table is a different plan."""
    files = sorted(
        str(p)
        for root in {pathlib.Path(__file__).parent, pathlib.Path(passes.__file__).parent}
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )
    return private("torch._inductor.custom_graph_pass.get_hash_for_files")(tuple(files)).hex()


def _machine(device: torch.device) -> tuple:
    """What the passes ask of the machine (the loss head's GEMM probes follow from these)."""
    about: tuple = (str(device), sorted(native_dtypes(device)[0]), memory_bytes(device))
    if device.type == "cpu":
        about += (torch.backends.cpu.get_cpu_capability(), cpu_has_amx())
    elif device.type == "cuda":
        about += (torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))
    return about


def _about_input(x: object) -> tuple:
    if isinstance(x, torch.Tensor):
        return (type(x).__name__, str(tuple(x.shape)), str(x.stride()), str(x.dtype), str(x.device), x.requires_grad)
    if isinstance(x, torch.SymInt | torch.SymFloat | torch.SymBool):
        return (type(x).__name__, str(x))
    return (type(x).__name__, repr(x) if isinstance(x, int | float | bool | str | type(None)) else "")


def key(
    gm: torch.fx.GraphModule, example_inputs: Sequence[object], opts: AmpOptions, dtype: str, around: object
) -> str | None:
    """The plan's key, or None where it is not cached (see the module's note)."""
    if not enabled() or opts.inner != "inductor" or opts.dump_dir is not None or held_tensors(gm):
        return None  # dump_dir: the passes write their graphs as they run
    options = [f"{name}={getattr(opts, name)!r}" for name in AmpOptions.names()]  # inner, the one callable, is a name
    if opts.policy_source is not None:
        options.append(repr(opts.policy_source.fingerprints))
    digest = hashlib.sha256()
    for part in (
        FORMAT,
        torch.__version__,
        _source_digest(),
        dtype,
        repr(around),
        torch.is_grad_enabled(),
        options,
        _machine(device_of(example_inputs)),
        repr(head_settings()),
        [_about_input(x) for x in example_inputs],
        # the graphs as listed, not as Python: Dynamo's module generates its code lazily, and
        # on a restore nothing else asks for it (5 ms of a 4-layer decoder's restart)
        [str(m.graph) for m in gm.modules() if isinstance(m, torch.fx.GraphModule)],
    ):
        digest.update(repr(part).encode())
        digest.update(b"\0")
    return digest.hexdigest()


def _path(digest: str) -> pathlib.Path:
    root = pathlib.Path(private("torch._inductor.runtime.cache_dir_utils.cache_dir")())
    return root / "amp" / "plans" / digest[:2] / digest


class Restored:
    """A plan read back: the planned graph, its plan, the passes' records; ``reread`` gives
    the graph again from the entry's bytes (for inspection, once the compiled one is let go)."""

    def __init__(self, graph, plan: GraphPlan, passes: list, logged: list, reread: Callable):
        self.graph, self.plan, self.passes, self.logged, self.reread = graph, plan, passes, logged, reread

    def replay(self) -> None:
        for level, message in self.logged:
            log.log(level, "%s", message)


def load(digest: str, gm: torch.fx.GraphModule, index: int, reason: str) -> Restored | None:
    """The plan stored under ``digest`` for Dynamo's ``gm``, as graph ``index`` with ``reason``;
    None where there is none or it cannot be read (then amp plans again)."""
    path = _path(digest)
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        with collector_held():
            fmt, graph_bytes, name, plan, passes, logged = pickle.loads(data)
            if fmt != FORMAT:
                return None
            graph = _read_graph(graph_bytes, name)
            keep_dynamo_inputs(gm, graph)  # this compile's input sources, as a fresh capture has them
    except Exception as e:  # noqa: BLE001 - a damaged entry costs a planning, never the run
        log.debug("amp: plan cache entry %s unreadable (%s: %s); planning again", path, type(e).__name__, e)
        return None
    plan = replace(
        plan,
        index=index,
        dtype_reason=reason,
        nodes=[replace(n, graph=index) for n in plan.nodes],
        casts=[replace(c, graph=index) for c in plan.casts],
    )
    return Restored(graph, plan, passes, logged, functools.partial(_read_graph, graph_bytes, name))


def _read_graph(graph_bytes: bytes, name: str) -> torch.fx.GraphModule:
    fake_mode = private("torch._subclasses.fake_tensor.FakeTensorMode")()
    return _as_planned(private("torch.fx._graph_pickler.GraphPickler").loads(graph_bytes, fake_mode), name)


@contextlib.contextmanager
def collector_held(hold: bool = True) -> Iterator[None]:
    """Python's cycle collector held off meanwhile (``hold``): while a restored plan is read
    and its graph loaded from Inductor's caches. What they make lives as long as the compiled
    graph; counted in passing it tipped one more full collection of a restarted job's heap
    (0.13 s of a 12-layer decoder's 5.4 s first step, where Inductor + autocast's took 5.1 s).
    Held, the collector counts it once, afterwards."""
    if not (hold and gc.isenabled()):  # a caller that turned it off keeps it off
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def store(digest: str, graph: torch.fx.GraphModule, plan: GraphPlan, passes: list, logged: list) -> None:
    """Remember a plan; one that cannot be pickled or written is left unremembered."""
    try:
        if hasattr(graph, "real_recompile"):  # a lazy module's code, up to date before it is stored
            graph.real_recompile()
        canonical(graph)
        with _values_set_aside(graph):
            graph_bytes = private("torch.fx._graph_pickler.GraphPickler").dumps(graph)
        data = pickle.dumps((FORMAT, graph_bytes, type(graph).__name__, plan, passes, logged))
        path = _path(digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes(str(path), data)
    except Exception as e:  # noqa: BLE001 - the cache only saves time
        log.debug("amp: plan not cached (%s: %s)", type(e).__name__, e)


def canonical(graph: torch.fx.GraphModule) -> None:
    """Its attributes in one order: AOTAutograd's cache key pickles the module's ``__dict__``,
    and a planned graph gains its attributes in another order than a restored one."""
    attributes = sorted(graph.__dict__.items())
    graph.__dict__.clear()
    graph.__dict__.update(attributes)


def _as_planned(graph: torch.fx.GraphModule, name: str) -> torch.fx.GraphModule:
    """The unpickled module as the planned one was: lazy (its code written when read, not at
    each recompile) and of its class name, both part of AOTAutograd's cache key. Its state,
    code included, carries over whole: a new module would write its code again."""
    lazy = private("torch.fx._lazy_graph_module._LazyGraphModule")
    restored = lazy.__new__(lazy)  # GraphModule.__new__ gives each module a class of its own
    restored.__dict__.update(graph.__dict__)
    restored._graph.owning_module = restored
    type(restored).__name__ = name
    return restored


@contextlib.contextmanager
def _values_set_aside(graph: torch.fx.GraphModule) -> Iterator[None]:
    kept = {}
    for m in graph.modules():
        if isinstance(m, torch.fx.GraphModule):
            for n in m.graph.nodes:
                kept[n] = {k: n.meta.pop(k) for k in _VALUE_KEYS if k in n.meta}
    try:
        yield
    finally:
        for n, values in kept.items():
            n.meta.update(values)


@contextlib.contextmanager
def logged_while_planning() -> Iterator[list]:
    """What amp's loggers say meanwhile (INFO and up), as (level, message), to replay on a hit."""
    said: list = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append((record.levelno, record.getMessage()))

    handler = Keep(logging.INFO)
    log.addHandler(handler)
    try:
        yield said
    finally:
        log.removeHandler(handler)
