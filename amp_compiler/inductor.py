"""The inner compiler: Inductor configured for amp's graphs, or any backend by name.

With Inductor amp adds its joint-graph and post-grad passes (``amp_compiler.passes.inductor``),
its partitioner under the default memory budget, and a lower realize threshold; none of
them changes a value.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from amp_compiler.passes.graph_util import draws_random

from .device import device_of
from .upstream.torch_private import private

log = logging.getLogger("amp_compiler")


def memory_budget_for(gm: torch.fx.GraphModule, asked: float | None) -> float:
    """The partitioner's activation memory budget for ``gm``: ``asked``, else 0.8 (recompute
    cheap ops instead of saving them); always 1.0 for a graph that draws random numbers.
    Below 1.0 the partitioner may recompute dropout in backward, which then draws a new
    mask (ATen's random kernels on CPU): a silently wrong gradient (tested)."""
    if not any(draws_random(n) for n in gm.graph.nodes):
        return 0.8 if asked is None else asked
    if asked is not None and asked < 1.0:
        log.warning(
            "memory_budget=%s not applied to a graph with random ops (dropout): "
            "recomputing them in backward would draw new masks; using 1.0",
            asked,
        )
    return 1.0


def atens_random(example_inputs) -> bool:
    """Whether dropout in this graph runs ATen's random kernels (Inductor's ``fallback_random``):
    on CPU, for a graph that backward will differentiate. There the mask is stored for backward
    anyway and ATen draws it faster (2 cores, AVX512-BF16: hf-gpt2 step 0.88x autocast with
    ATen's, 0.93x with Inductor's; encoder-dropout 0.78x vs 0.87x), and compiled dropout draws
    eager's masks from the same seed. Under ``no_grad`` Inductor's random fuses into the
    kernel that consumes it, no mask written: hf-gpt2 in train mode 0.99x autocast, 1.12x with
    ATen's. CUDA keeps Triton's random."""
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    cpu = device_of(example_inputs).type == "cpu"
    return cpu and torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# Inductor stores a value used more than once when it reads more buffers than this (its own: 4)
REALIZE_READS = 2


def inner_compiler(inner: str | Callable, mode: str | None, memory_budget: float | None) -> Callable:
    if callable(inner):
        return inner
    if inner == "inductor":
        compile_fx = private("torch._inductor.compile_fx.compile_fx")
        from amp_compiler.passes.inductor.infra import InductorPass, InductorPasses

        patches = {}
        if mode and mode != "default":
            patches = dict(private("torch._inductor.list_mode_options")(mode))
        # backward reads the 16-bit copies of FP32 islands that are saved anyway, and
        # recomputes comparison masks instead of saving bool tensors (slow C++ code)
        patches["joint_custom_pre_pass"] = InductorPasses(
            InductorPass("amp_compiler.passes.inductor.saved_copies", "reuse_saved_copies"),
            InductorPass("amp_compiler.passes.inductor.recompute_masks", "recompute_masks"),
            # the loss head's ops run once, in forward, under any memory budget
            InductorPass("amp_compiler.passes.inductor.keep_head_stats", "keep_head_stats"),
        )
        if memory_budget is None:
            # the default budget recomputes activations, not the parameters' 16-bit copies
            from amp_compiler.passes.inductor.weight_copies import WeightCopiesSaved

            patches["custom_partitioner_fn"] = WeightCopiesSaved()
        # a batch times one shared weight as one mm, not a bmm over a broadcast copy
        patches["post_grad_custom_pre_pass"] = InductorPass(
            "amp_compiler.passes.inductor.fold_broadcast_bmm", "fold_broadcast_bmm"
        )
        # Under the memory budget the residual stream is recomputed from its 16-bit terms, not
        # saved; with Inductor's threshold (4 reads) each layer then inlines a different number
        # of terms into its LayerNorm, one distinct C++ kernel per layer. Storing a reused value
        # that reads more than 2 buffers makes the layers' kernels identical: compiled once (the
        # first call ~17% shorter on a 4-layer LM, 33 kernels -> 24), step time unchanged.
        patches["realize_reads_threshold"] = REALIZE_READS

        def compile_(gm, ex):
            # the partition into forward and backward happens inside this call
            budget = memory_budget_for(gm, memory_budget)
            random = {"fallback_random": True} if atens_random(ex) else {}
            with private("torch._functorch.config").patch(activation_memory_budget=budget):
                return compile_fx(gm, ex, config_patches={**patches, **random})

        return compile_
    return private("torch._dynamo.lookup_backend")(inner)
