"""Faithful: the rewritten graph differentiates exactly as the program did.

Rule: run the graph as Dynamo gave it and the rewritten graph on the same fake
inputs, with autograd on, and ask autograd which inputs receive a gradient.
The two sets must be equal, and so must ``requires_grad`` of every output. A
precision rewrite changes numbers only; a parameter that loses its gradient
(a custom Function traced as forward-only, a grad-mode region moved) is a
different program and raises, naming the input.

This is not a pass over one graph: it compares two, so the backend calls it
after the pipeline.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import pathlib
from collections.abc import Sequence

import torch

from amp_compiler.capture import held_tensors, lift_attributes
from amp_compiler.passes.verify import AmpVerifyError
from amp_compiler.upstream.torch_private import private, pytree

log = logging.getLogger(__name__)


def gradient_flow(
    gm: torch.fx.GraphModule, inputs: Sequence[object], fake_mode: object
) -> tuple[frozenset[int], tuple[bool, ...]]:
    """(indices of inputs that receive a gradient, requires_grad of each tensor output).

    Runs with guards suppressed: which inputs get a gradient does not depend on sizes, and
    torch < 2.13 guarded a dynamic size it read while running a composite op (matmul) here,
    which made every new sequence length recompile."""
    shape_env = getattr(fake_mode, "shape_env", None)
    quiet = shape_env.suppress_guards() if shape_env is not None else contextlib.nullcontext()
    with fake_mode, torch.enable_grad(), quiet:
        leaves, args = {}, []
        for i, x in enumerate(inputs):
            if isinstance(x, torch.Tensor):
                leaf = x.detach().clone().requires_grad_(x.requires_grad)
                # a Python float Dynamo made a graph input under dynamic shapes: its .item()
                # answers the input's symbol, which the clone would otherwise lose
                memo = getattr(x, "item_memo", None)
                if x.requires_grad:
                    leaves[i] = leaf
                    leaf = leaf.clone()  # not a leaf, so in-place writes stay legal
                if memo is not None:
                    leaf.item_memo = memo
                args.append(leaf)
            else:
                args.append(x)
        outs = [o for o in pytree.tree_leaves(torch.fx.Interpreter(gm).run(*args)) if isinstance(o, torch.Tensor)]
        differentiable = [o for o in outs if o.requires_grad]
        got = frozenset()
        if differentiable and leaves:
            grads = torch.autograd.grad(
                differentiable, list(leaves.values()), [torch.ones_like(o) for o in differentiable], allow_unused=True
            )
            got = frozenset(i for i, g in zip(leaves, grads) if g is not None)
    return got, tuple(o.requires_grad for o in outs)


def check_gradient_flow(
    original: torch.fx.GraphModule, rewritten: torch.fx.GraphModule, inputs: Sequence[object], fake_mode: object
) -> None:
    """Raise AmpVerifyError when ``rewritten`` differentiates differently from ``original``."""
    if not torch.is_grad_enabled():
        return
    held = held_tensors(original, rewritten)
    names = [n.name for n in rewritten.graph.nodes if n.op == "placeholder"] + list(held)
    if held:  # parameters held on the graph (install_free_tensors) are its leaves as well
        original, rewritten = lift_attributes(original, held), lift_attributes(rewritten, held)
        inputs = [*inputs, *(fake_mode.from_tensor(t, static_shapes=True) for t in held.values())]
    if not any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs):
        return
    verified = _verified_marker(original, rewritten, inputs)
    if verified is not None and verified.exists():
        return  # this pair of programs, on inputs like these, was checked by an earlier process
    try:
        before = gradient_flow(original, inputs, fake_mode)
        after = gradient_flow(rewritten, inputs, fake_mode)
    except Exception as e:
        # A graph that cannot run eagerly on fakes outside a compiler leaves
        # nothing to compare: say so rather than refuse the program.
        log.warning(
            "gradient-flow check skipped: a graph did not run on fake inputs (%s: %s)",
            type(e).__name__,
            str(e).splitlines()[0] if str(e) else "",
        )
        return
    for i in sorted(before[0] ^ after[0]):
        had = "receives" if i in before[0] else "receives no"
        now = "none" if i in before[0] else "one"
        raise AmpVerifyError(
            f"node '{names[i]}' (graph input {i}) {had} gradient in the program as written but "
            f"{now} after the amp rewrite: the rewrite changed what is differentiated "
            "(please report this; pin the region with fp32_modules meanwhile)"
        )
    if before[1] != after[1]:
        outs = [j for j, (a, b) in enumerate(zip(before[1], after[1])) if a != b]
        raise AmpVerifyError(
            f"graph output(s) {outs} changed requires_grad in the amp rewrite "
            f"(as written {before[1]}, after {after[1]})"
        )
    if verified is not None:
        with contextlib.suppress(OSError):  # a read-only cache only costs the check next time
            verified.parent.mkdir(parents=True, exist_ok=True)
            verified.touch()


def _verified_marker(original: torch.fx.GraphModule, rewritten: torch.fx.GraphModule, inputs) -> pathlib.Path | None:
    """Where a passed check of this pair is remembered, beside Inductor's own caches (a job that
    restarts with a warm cache skips the check: ~1 s of a GPT-2-style decoder's first step). The
    key is what decides gradient flow: both programs' code and each input's sizes, dtype and
    requires_grad (and torch's release). None where Inductor's caches are off (``force_disable_caches``)."""
    if private("torch._inductor.config").force_disable_caches:
        return None
    digest = hashlib.sha256(torch.__version__.encode())  # one cache dir may serve several torch releases
    for gm in (original, rewritten):
        digest.update(gm.code.encode())
    for x in inputs:
        about = (tuple(map(str, x.shape)), x.dtype, x.requires_grad) if isinstance(x, torch.Tensor) else type(x)
        digest.update(repr(about).encode())
    root = pathlib.Path(private("torch._inductor.runtime.cache_dir_utils.cache_dir")())
    return root / "amp" / "gradient_flow" / digest.hexdigest()
