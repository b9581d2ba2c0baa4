"""The ``amp`` torch.compile backend: capture, rewrite, hand over to a code generator."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from amp_compiler.passes import PIPELINE, PassContext, PassRecord, run_pipeline
from amp_compiler.passes.gradient_flow import check_gradient_flow

from . import plan_cache
from .autocast_region import autocast_around, autocast_region, warn_autocast_around
from .capture import to_aten
from .coverage import MAX_UNCOMPILED_SHARE, Coverage
from .cpu_memory import MemoryReuse, ReuseRule
from .device import device_of, resolve_dtype
from .hops import inline_outlined
from .inductor import inner_compiler
from .options import AmpOptions, AmpOptionsError
from .plan import GraphPlan, PrecisionPlan
from .policy import LOW_DTYPES, AmpPolicyError
from .policy_file import PolicyFileError, check_fingerprint, fingerprint
from .upstream import warn_outside_tested_range
from .upstream.torch_private import has, private

log = logging.getLogger("amp_compiler")


@dataclass
class CompileRecord:
    """What the backend did to one graph Dynamo handed it."""

    index: int
    dtype: str
    dtype_reason: str
    _graph: torch.fx.GraphModule | None  # ``graph``
    plan: GraphPlan
    passes: list[PassRecord] = field(default_factory=list)
    options: AmpOptions | None = None
    parameters: int = 0  # graph inputs that are trainable leaves: the model's parameters
    restored: bool = False  # the plan was read from amp's plan cache (an earlier process made it)
    _reread: Callable[[], torch.fx.GraphModule] | None = field(default=None, repr=False)

    @property
    def graph(self) -> torch.fx.GraphModule:
        """The graph given to the inner compiler (Dynamo's own under FP32); a restored plan's
        is read again from its cache entry when asked for."""
        if self._graph is None and self._reread is not None:
            self._graph = self._reread()
        return self._graph

    def let_go(self) -> None:
        """Once compiled, a graph that can be read again (a restored plan's) is dropped and its
        nodes' metadata (the plan's records, module and stack traces) cleared: AOTAutograd's compiled
        function keeps the module for its parameters, and the metadata's ~5,000 objects at 12
        layers lived on in every full collection of the heap, tipping one more into a restarted
        job's first step (3 against Inductor + autocast's 2). The code it runs needs none."""
        if self._reread is None or self._graph is None:
            return
        for module in self._graph.modules():
            if isinstance(module, torch.fx.GraphModule):
                for node in module.graph.nodes:
                    node.meta.clear()
        self._graph = None


class AmpBackend:
    """A configured ``amp`` backend; pass it as ``torch.compile(m, backend=AmpBackend(...))``.

    Keyword options are those of ``AmpOptions``. ``records`` holds one
    ``CompileRecord`` per graph compiled (several after graph breaks or
    recompiles), the newest ``max_records`` of them (each holds its graph);
    ``plan()`` merges their plans. ``decided`` and ``owned`` are for the training entry
    points (``training_setup``): the dtype they decided and why, and that they check the
    model's coverage themselves.
    """

    max_records = 1024

    def __init__(
        self,
        options: AmpOptions | dict | None = None,
        *,
        config=None,
        decided: tuple[str, str] | None = None,
        owned: bool = False,
        **kwargs: Any,
    ):
        if config is not None:  # a DeepSpeed-style dict or file: its dtype and "amp" section
            from .ds_config import AmpConfig, AmpConfigError

            if isinstance(options, AmpOptions):
                raise AmpOptionsError(
                    "config= goes with options given as a dict or keywords, "
                    "not an AmpOptions object (whose dtype would hide the config's)"
                )
            cfg = AmpConfig.load(config)
            if "dtype" in {**(options or {}), **kwargs} and cfg.dtype is not None:
                raise AmpConfigError(
                    f"dtype given both as an option and by {cfg.describe()} ({cfg.dtype}); set it in one place"
                )
            options = {**cfg.options, **({"dtype": cfg.dtype} if cfg.dtype else {}), **(options or {})}
        if isinstance(options, AmpOptions):
            self.options = options.replace(**kwargs) if kwargs else options
        else:
            self.options = AmpOptions.from_mapping(options, **kwargs)
        self.records: list[CompileRecord] = []
        self.compiled = 0  # graphs compiled so far, records dropped or not
        self.coverage = Coverage()  # which trainable parameters the graphs took
        # (dtype, why) as a training entry point decided it (agreed by all ranks): the plan
        # then states that reason, not "dtype=... requested"
        if decided is not None and decided[0] != self.options.dtype:
            raise AmpOptionsError(f"decided={decided!r} disagrees with dtype={self.options.dtype!r}")
        self.decided = decided
        self.pipeline = PIPELINE
        # an entry point that owns the step (make_train_step, AmpCallback, the Lightning
        # plugins) checks coverage itself; the bare backend warns once about graph breaks
        self.owned = owned
        self._breaks_warned = False
        self._reuse: ReuseRule | None = None  # reuse_cpu_memory, where no loop owns us
        warn_outside_tested_range()

    def __repr__(self) -> str:
        return f"AmpBackend(dtype={self.options.dtype!r}, graphs={len(self.records)})"

    def __call__(
        self,
        gm: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        options: dict | None = None,
        mode: str | None = None,
    ) -> Callable:
        opts = self.options.replace(**options) if options else self.options
        _watch_recompile_limit()
        record = self.rewrite(gm, example_inputs, opts)
        self._warn_breaks(record)
        budget = opts.memory_budget
        if budget is None and not record.plan.applied:
            # FP32: the program plain torch.compile runs, its partition included (recomputing
            # in FP32 cost lm-sdpa 3-6% of a step where 16 bit is emulated)
            budget = 1.0
        with plan_cache.collector_held(record.restored):
            compiled = inner_compiler(opts.inner, mode, budget)(record.graph, list(example_inputs))
            record.let_go()  # while the collector is held: the graph's cycles die young
        return self._watch_memory(compiled, example_inputs, opts)

    @property
    def memory_reuse(self) -> MemoryReuse | None:
        """Whether freed CPU memory is kept for reuse, and why (the ``reuse_cpu_memory``
        option), as the bare backend decided it; None before (or where a loop owns it)."""
        return None if self._reuse is None else self._reuse.decision

    def _watch_memory(self, compiled: Callable, example_inputs, opts: AmpOptions) -> Callable:
        """``reuse_cpu_memory`` for the bare backend: its first training graph on CPU runs once a
        step, so the stretch from its third call to its fourth is a step after the first
        update (the first two compile, and with accumulation the first update comes later).
        A training loop that owns the backend measures its own steps. True or False given at a
        later compile (the named backend is shared) replaces the rule: applied, or no longer
        measured."""
        if self.owned or _compiled_autograd_graph():
            return compiled
        if opts.reuse_cpu_memory is not None:
            self._reuse = ReuseRule(opts.reuse_cpu_memory, on_cpu=True)  # True applies it now
            return compiled
        training = torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs
        )
        if self._reuse is not None or not (training and device_of(example_inputs).type == "cpu"):
            return compiled
        self._reuse = rule = ReuseRule(None, on_cpu=True, at=2)

        def run(*args):
            if self._reuse is rule:
                rule.tick()
            return compiled(*args)

        if getattr(compiled, "_boxed_call", False):  # the calling convention travels with it
            run._boxed_call = True
        return run

    def rewrite(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], opts: AmpOptions | None = None
    ) -> CompileRecord:
        """Capture ``gm`` as ATen, run the pipeline, record it; returns the record, whose
        ``graph`` is the one to compile."""
        opts = opts or self.options
        if _compiled_autograd_graph():
            return self._record_backward(gm, example_inputs, opts)
        device = device_of(example_inputs)
        around = autocast_around(device)
        if around is None:
            return self._rewrite_as(gm, example_inputs, opts, device, None)
        # The user's torch.autocast around the call: Dynamo traced the model under it and baked
        # in what the model read then (T5 builds a bias as zeros of the query's dtype: BF16).
        # It becomes a region of the graph, which keeps autocast's casts, as one inside the
        # model would; amp adds its own. Its dtype is the one asked for where amp's is "auto".
        autocast_region(gm, device.type, LOW_DTYPES[around])
        with private("torch._C._DisableAutocast")():  # amp traces it as a region; its probe times FP32
            try:
                record = self._rewrite_as(gm, example_inputs, opts, device, around)
                warn_autocast_around(device, around, record.dtype)
                return record
            except (AmpOptionsError, AmpPolicyError, PolicyFileError):
                raise  # what the user configured (strict, a policy file) holds here too
            except Exception as e:  # noqa: BLE001 - autocast alone is what plain torch.compile runs
                why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
                log.warning(
                    "amp: a graph Dynamo traced under torch.autocast(%r, %s) could not be "
                    "planned (%s); it runs as autocast alone makes it. Drop the "
                    "torch.autocast context around the compiled model: amp needs none.",
                    device.type,
                    around,
                    why,
                )
                plan = GraphPlan(
                    self.compiled,
                    around,
                    f"torch.autocast({device.type}, {around}) around the call; amp's plan not applied ({why})",
                )
                plan.applied = False
                return self._record(gm, example_inputs, opts, gm, plan)

    def _rewrite_as(self, gm, example_inputs, opts, device, around) -> CompileRecord:
        if self.decided is not None and self.decided[0] == opts.dtype:
            dtype, reason = self.decided
        elif around is not None and opts.dtype == "auto":
            # the user's own torch.autocast chose a 16-bit dtype: that is the dtype asked for
            dtype, reason = resolve_dtype(around, device, loss_scaling=False)
            reason = f"torch.autocast({device.type}, {around}) around the call; {reason}"
        else:
            # the training step and the Trainer callback decide (and scale FP16's loss) themselves
            dtype, reason = resolve_dtype(opts.dtype, device, loss_scaling=False)
        # A user's saved-tensor hooks (activation offloading, e.g. save_on_cpu) wrap the
        # compiled call at run time; they must not see the fake tensors we trace with.
        with _saved_tensors_hooks_off():
            if dtype == "fp32":
                return self._record_unapplied(gm, example_inputs, opts, reason)
            return self._rewrite(gm, example_inputs, opts, dtype, reason, around)

    def _planned(self, gm, example_inputs, opts, low_dtype):
        """Dynamo's graph as ATen, through the pipeline: (graph, fake mode, fake inputs, passes)."""
        aten_gm, fake_mode, inputs = to_aten(gm, example_inputs)
        ctx = PassContext(policy=opts.policy(low_dtype), options=opts, fake_mode=fake_mode, graph_index=self.compiled)
        return aten_gm, fake_mode, inputs, run_pipeline(aten_gm, ctx, self.pipeline)

    def _rewrite(self, gm, example_inputs, opts, dtype, reason, around=None) -> CompileRecord:
        reason = _with_policy(reason, opts)
        digest = plan_cache.key(gm, example_inputs, opts, dtype, around)
        restored = plan_cache.load(digest, gm, self.compiled, reason) if digest else None
        if restored is not None:  # planned by an earlier process: the same graph, options, code
            restored.replay()
            if opts.policy_source is not None:
                check_fingerprint(opts.policy_source, fingerprint(restored.plan.nodes))
            record = self._record(gm, example_inputs, opts, restored.graph, restored.plan, restored.passes)
            record.restored, record._reread = True, restored.reread
            return record
        with plan_cache.logged_while_planning() as logged:
            aten_gm, fake_mode, inputs, passes = self._planned(gm, example_inputs, opts, LOW_DTYPES[dtype])
        aten_gm.recompile()
        plan = GraphPlan.from_graph(aten_gm, self.compiled, dtype, reason)
        if opts.policy_source is not None:
            check_fingerprint(opts.policy_source, fingerprint(plan.nodes))
        inline_outlined(aten_gm)
        check_gradient_flow(gm, aten_gm, inputs, fake_mode)
        if digest:
            plan_cache.store(digest, aten_gm, plan, passes, logged)  # in canonical order, as restored
        return self._record(gm, example_inputs, opts, aten_gm, plan, passes)

    def _record_unapplied(self, gm, example_inputs, opts, reason) -> CompileRecord:
        """FP32: Dynamo's graph goes on unchanged; the BF16 plan is recorded for inspection."""
        index = self.compiled
        try:
            aten_gm, _, _, passes = self._planned(gm, example_inputs, opts, torch.bfloat16)
            plan = GraphPlan.from_graph(aten_gm, index, "fp32", f"{reason}; plan shown is BF16's")
        except Exception as e:  # the plan is information only: never fail an FP32 run over it
            passes = []
            plan = GraphPlan(index, "fp32", f"{reason}; no BF16 plan ({type(e).__name__}: {e})")
        plan.applied = False
        return self._record(gm, example_inputs, opts, gm, plan, passes, reason=reason)

    def _record_backward(self, gm, example_inputs, opts) -> CompileRecord:
        """Compiled autograd's backward graph goes on as written: its dtypes are what the
        forward graphs' plans made them (a 16-bit matmul's gradient is 16 bit, an FP32
        island's is FP32); planning it again would put the islands' backward in 16 bit."""
        reason = "compiled autograd's backward graph: handed on as written, its dtypes follow the forward graphs' plans"
        if self.decided is not None and self.decided[0] == opts.dtype:
            dtype = self.decided[0]
        else:
            dtype = resolve_dtype(opts.dtype, device_of(example_inputs), loss_scaling=False)[0]
        plan = GraphPlan(self.compiled, dtype, reason)
        plan.applied = False
        return self._record(gm, example_inputs, opts, gm, plan)

    def _record(self, gm, example_inputs, opts, graph, plan: GraphPlan, passes=(), reason=None) -> CompileRecord:
        """Record Dynamo's ``gm`` compiled as ``graph`` under ``plan`` (the parameters it took
        counted once, here); ``reason``: the dtype's, where the plan states another."""
        parameters = self.coverage.took(gm, example_inputs)
        record = CompileRecord(
            self.compiled, plan.dtype, reason or plan.dtype_reason, graph, plan, list(passes), opts, parameters
        )
        self.compiled += 1
        self.records.append(record)
        del self.records[: -self.max_records]
        s = record.plan.summary()
        if not record.plan.applied:
            log.info("graph %d: handed on unchanged (%s)", record.index, record.dtype_reason)
            return record
        log.info(
            "graph %d: %d/%d ops in %s, %d in FP32, using %d casts (%s)",
            record.index,
            s["nodes"]["LOW"],
            sum(s["nodes"].values()),
            record.dtype,
            s["nodes"]["FP32"],
            s["casts"],
            record.dtype_reason,
        )
        return record

    def plan(self) -> PrecisionPlan:
        return PrecisionPlan([r.plan for r in self.records])

    def _warn_breaks(self, record: CompileRecord) -> None:
        """Once: Dynamo broke the graph, so code between graphs runs as written, in FP32."""
        if self.owned or self._breaks_warned or not record.plan.applied:
            return
        breaks = self.coverage.graph_breaks()
        if breaks:
            self._breaks_warned = True
            fix = ""
            if any(b.startswith("HOP:") and "side effect" in b for b in breaks):
                fix = (
                    " A checkpointed layer set Python state (transformers >= 5.25 does): call the "
                    "compiled model inside `with backend.tracing():` (for the named backend, "
                    "amp_compiler.amp.tracing()) to trace it."
                )
            log.warning(
                "amp: Dynamo broke the graph (%s); the code between graphs runs as written, in FP32, "
                "outside the plan. Check that the model's layers are in the plan (amp_compiler.amp.plan()); "
                "make_train_step, AmpCallback and AmpPrecision refuse a model with more than %.0f%% of its "
                "matmul weights outside it.%s",
                "; ".join(breaks[:3]) + (" ..." if len(breaks) > 3 else ""),
                100 * MAX_UNCOMPILED_SHARE,
                fix,
            )

    def tracing(self) -> contextlib.AbstractContextManager:
        """The Dynamo settings amp's own entry points trace under. A checkpointed block whose
        forward sets and resets Python state is a side effect Dynamo refuses inside
        ``torch.utils.checkpoint`` by default, and the whole block then runs as written, in
        FP32 (transformers >= 5.25 routes each attention's kernels through such a context
        variable, and TRL turns checkpointing on by default). A compiled backward recomputes
        the traced ops, not the Python around them, so the state is set once, as it is
        without checkpointing. transformers wraps every model class's layers in the same
        function, so a process training several model classes recompiles that one code once per
        class: past Dynamo's limit of 8 it would run them as written (refused by the coverage
        check); amp's compiles allow 64."""
        config = private("torch._dynamo.config")
        limit = max(config.recompile_limit, 64)
        return config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True, recompile_limit=limit)

    def compile(self, fn: Callable) -> Callable:
        """``torch.compile(fn, backend=self)``, called under ``tracing()``. Called from code
        Dynamo is already tracing (a compiled forward calling a compiled submodule), ``fn``
        is traced into the caller's graph."""
        compiled = torch.compile(fn, backend=self)

        @functools.wraps(fn)
        def run(*args, **kwargs):
            if torch.compiler.is_compiling():
                return fn(*args, **kwargs)
            with self.tracing():
                return compiled(*args, **kwargs)

        return run

    def reset(self) -> None:
        self.records.clear()
        self.compiled = 0
        self.coverage.reset()


def _with_policy(reason: str, opts: AmpOptions) -> str:
    if opts.policy_source is None:
        return reason
    won = f"; explicit {', '.join(opts.policy_overridden)} given beside it win" if opts.policy_overridden else ""
    return f"{reason}; policy file {opts.policy_file}{won}"


def _saved_tensors_hooks_off():
    """What AOTAutograd does while it traces (torch/_functorch/aot_autograd.py)."""
    path = "torch._dynamo.utils._disable_saved_tensors_hooks_during_tracing"
    return private(path)() if has(path) else contextlib.nullcontext()


def _compiled_autograd_graph() -> bool:
    """Whether Dynamo is compiling compiled autograd's backward graph, not a forward."""
    compile_id = private("torch._guards.CompileContext").current_compile_id()
    return getattr(compile_id, "compiled_autograd_id", None) is not None


class _RecompileLimitFilter(logging.Filter):
    """Dynamo's recompile-limit warning, said again in amp's terms: past the limit a function
    runs as written, which for a function amp compiled means FP32, outside the plan."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("torch._dynamo hit config.") and "recompile_limit" in message:
            lines = message.splitlines()
            function = next((x.split(":", 1)[1].strip() for x in lines if x.strip().startswith("function:")), "?")
            log.warning(
                "amp: Dynamo compiled %s as often as its recompile limit allows (%s) and now runs it as "
                "written: if amp compiled it, in FP32, outside the plan. Each new input shape (or dtype, "
                "or module instance of one class) is a recompile under dynamic=False: leave dynamic at "
                "its default, mark the varying sizes (torch._dynamo.mark_dynamic), or raise the limit "
                "(torch.compile(..., recompile_limit=64) on torch >= 2.13, or torch._dynamo.config.recompile_limit)",
                function,
                lines[0].split("(", 1)[-1].rstrip(")"),
            )
        return True


_RECOMPILE_FILTER = _RecompileLimitFilter()


def _watch_recompile_limit() -> None:
    logger = private("torch._dynamo.convert_frame.log")
    if _RECOMPILE_FILTER not in logger.filters:
        logger.addFilter(_RECOMPILE_FILTER)


# The instance ``torch.compile(m, backend="amp")`` resolves to through the
# ``torch_dynamo_backends`` entry point. It records every graph compiled by name.
amp = AmpBackend()
