"""Every private torch name amp uses, and what for: the code reaches them through ``private``.

Torch renames and removes private names between releases without notice (2.14 dropped
``aten.cholesky``; 2.8 lacked ``CustomPartitionerFn``). Listing each here, resolved lazily,
keeps ``import amp_compiler`` independent of them, turns a missing one into an error that
names it and the feature that needs it, and gives tests/test_upstream.py one list to check
on every torch CI runs. A name used only where torch >= 2.X has it is marked optional, with
what amp does without it.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch

# path -> what amp uses it for
SURFACE: dict[str, str] = {
    # Dynamo
    "torch._dynamo.utils.counters": "graph breaks Dynamo counted: the coverage contract names them",
    "torch._dynamo.utils._disable_saved_tensors_hooks_during_tracing": (
        "tracing to ATen with saved-tensor hooks off, as AOTAutograd does (optional: without it the "
        "hooks stay on while amp traces)"
    ),
    "torch._dynamo.config": "raising the recompile limit and tracing side effects under checkpoint",
    "torch._dynamo.config.recompile_limit": "amp's compiles allow 64 recompiles of one code",
    "torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint": "checkpointed layers with Python state",
    "torch._dynamo.convert_frame.log": "the logger whose recompile-limit message amp rewords",
    "torch._dynamo.eval_frame.OptimizedModule": "telling a compiled module from a plain one (compile_loss)",
    "torch._dynamo.lookup_backend": "an inner backend given by name",
    "torch._guards.CompileContext": "telling compiled autograd's backward graph from a forward",
    "torch._guards.TracingContext": "the fake mode and parameters of the graph being compiled",
    "torch._guards.detect_fake_mode": "the fake mode of a graph's inputs",
    # fake tensors and tracing
    "torch._subclasses.fake_tensor.FakeTensor": "telling fake inputs from real ones",
    "torch._subclasses.fake_tensor.FakeTensorMode": "tracing a graph to ATen without running it",
    "torch._subclasses.fake_tensor.unset_fake_temporarily": "the loss head's block kernels compiled mid-trace",
    "torch._higher_order_ops.utils.reenter_make_fx": "tracing the bodies of checkpoint regions",
    "torch._ops.OpOverload": "a node's ATen target",
    "torch._ops.OpOverloadPacket": "the op tables' keys",
    "torch._ops.HigherOrderOperator": "checkpoint and other higher-order op nodes",
    "torch._C._DisableAutocast": "tracing an autocast region without autocast's own casts",
    "torch.utils._pytree": "flattening inputs and outputs",
    "torch.utils._python_dispatch.TorchDispatchMode": "the CLI's parameter-read tracer",
    "torch.utils._python_dispatch.is_in_torch_dispatch_mode": "block kernels run as written under a dispatch mode",
    # Inductor and the partitioner
    "torch._inductor.compile_fx.compile_fx": "handing the rewritten graph to Inductor",
    "torch._inductor.list_mode_options": "torch.compile's mode= for the inner Inductor",
    "torch._inductor.config": "Inductor's switches amp reads (its caches on or off)",
    "torch._inductor.config.joint_custom_pre_pass": "amp's joint-graph passes (saved copies, masks, head stats)",
    "torch._inductor.config.post_grad_custom_pre_pass": "folding a broadcast bmm into one mm",
    "torch._inductor.config.custom_partitioner_fn": "keeping the parameters' 16-bit copies saved",
    "torch._inductor.config.realize_reads_threshold": "one C++ kernel shared by every layer",
    "torch._inductor.config.fallback_random": "random ops as eager computes them",
    "torch._inductor.custom_graph_pass.CustomGraphPass": "amp's Inductor passes, with a cache key",
    "torch._inductor.custom_graph_pass.CustomPartitionerFn": "amp's partitioner, with a cache key",
    "torch._inductor.custom_graph_pass.get_hash_for_files": "the passes' cache keys",
    "torch._inductor.runtime.cache_dir_utils.cache_dir": "where a passed gradient-flow check and a plan are remembered",
    "torch.fx._graph_pickler.GraphPickler": "a planned graph stored with its node metadata (the plan cache)",
    "torch.fx._lazy_graph_module._use_lazy_graph_module": (
        "planned graphs whose code is written when read, not at every recompile (as Dynamo's)"
    ),
    "torch.fx._lazy_graph_module._LazyGraphModule": "a restored planned graph, lazy as a planned one is",
    "torch._inductor.config.force_disable_caches": "no remembered gradient-flow check where caches are off",
    "torch._functorch.config": "the activation memory budget of one compile",
    "torch._functorch.config.activation_memory_budget": "memory_budget=",
    "torch._functorch.partitioners.min_cut_rematerialization_partition": "the partition amp's partitioner wraps",
    "torch._functorch.partitioners._is_primal": "which graph inputs are parameters",
    # kernels of the training step
    "torch._foreach_norm": "the gradient norm of the fused update",
    "torch._foreach_add_": "the fused optimizers' step counts",
    "torch._foreach_sub_": "a skipped step does not count",
    "torch._fused_adam_": "fused Adam with the loss scale folded in",
    "torch._fused_adamw_": "fused AdamW with the loss scale folded in",
    "torch._fused_sgd_": "fused SGD with the loss scale folded in",
    "torch.utils._foreach_utils._get_fused_kernels_supported_devices": "where the fused optimizers run",
    "torch._amp_update_scale_": "the loss scaler's growth and backoff",
    # GradScaler, which the loss scaler extends (hysteresis, min/max scale, skipped steps)
    "torch.amp.grad_scaler.OptState": "marking an optimizer stepped by the fused update",
    "torch.amp.grad_scaler._refresh_per_optimizer_state": "clearing the per-optimizer state after an update",
    "torch.amp.GradScaler._maybe_opt_step": "overridden: counts skipped steps without a second sync",
    "torch.amp.GradScaler._check_scale_growth_tracker": "the scale and growth tracker of an update",
    "torch._amp_foreach_non_finite_check_and_unscale_": "unscaling gradients and finding Inf/NaN",
}


class UpstreamChanged(RuntimeError):
    """A private torch name amp needs is gone from the running torch."""


def private(path: str) -> Any:
    """The object at ``path`` (one of ``SURFACE``) in the running torch. Where it lives is found
    once; the object is read at each call, so a patch of it (a test's, another library's)
    applies. A config value is read off its config module
    (``private("torch._inductor.config").key``), as it changes; its own entry is there for
    the canary."""
    found, names = _located(path)
    for name in names:
        found = getattr(found, name)
    return found


@functools.cache
def _located(path: str) -> tuple[Any, tuple[str, ...]]:
    """(the longest importable module of ``path``, the attribute names below it)."""
    if path not in SURFACE:
        raise KeyError(f"{path} is not listed in amp_compiler.upstream.torch_private.SURFACE: add it, with what for")
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        found = module
        try:
            for name in parts[cut:]:
                found = getattr(found, name)
        except AttributeError:
            break
        return module, tuple(parts[cut:])
    from . import tested_range

    raise UpstreamChanged(
        f"torch {torch.__version__} has no {path}, which amp uses for {SURFACE[path]}. amp-compiler is tested "
        f"with torch {tested_range()}: install one of those, or report this with `amp-compiler env`'s output"
    )


def has(path: str) -> bool:
    """Whether the running torch defines ``path`` (for the names marked optional)."""
    try:
        private(path)
    except UpstreamChanged:
        return False
    return True


# GradScaler's instance state the loss scaler reads and writes (checked on an instance)
GRAD_SCALER_STATE = (
    "_enabled",
    "_scale",
    "_growth_tracker",
    "_per_optimizer_states",
    "_growth_factor",
    "_backoff_factor",
    "_growth_interval",
)

# the types of graph nodes' targets, in isinstance checks throughout
OpOverload = private("torch._ops.OpOverload")
OpOverloadPacket = private("torch._ops.OpOverloadPacket")
HigherOrderOperator = private("torch._ops.HigherOrderOperator")
pytree = private("torch.utils._pytree")
FakeTensor = private("torch._subclasses.fake_tensor.FakeTensor")
