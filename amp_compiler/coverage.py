"""Which of a model's parameters the compiled graphs took: a training step's guard against
training in FP32 in silence (no graph compiled, or code run eagerly after a graph break)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from .capture import tensor_attributes
from .upstream.torch_private import FakeTensor, private, pytree

log = logging.getLogger("amp_compiler")

# Share of a model's matmul/conv weight elements that may run outside every compiled graph
# (as written, in FP32) before an entry point that owns the step refuses to train it.
MAX_UNCOMPILED_SHARE = 0.05


class UncompiledModelError(RuntimeError):
    """Too much of the model would train as written, in FP32, outside amp's graphs."""


class Coverage:
    """Counts graphs and the trainable leaves each took, as the backend compiles them."""

    def __init__(self) -> None:
        self.graphs = 0  # graphs compiled so far
        self.with_parameters = 0  # of those, graphs that take trainable parameters
        self.parameter_ids: set[int] = set()  # id() of every trainable leaf a graph took
        self.mark()

    def mark(self) -> None:
        """Graph breaks Dynamo reports from now on are this model's (its counters are per process)."""
        self._breaks = _breaks()

    def graph_breaks(self) -> list[str]:
        """Dynamo's reasons for the graph breaks (and what it gave up tracing) since ``mark()``,
        one line each."""
        return list(dict.fromkeys(_one_line(reason) for reason in _breaks() - self._breaks))

    def took(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> int:
        """Count one graph; returns how many trainable leaves it takes."""
        leaves = _parameters(gm, example_inputs)
        self.parameter_ids.update(map(id, leaves))
        self.graphs += 1
        self.with_parameters += bool(leaves)
        return len(leaves)

    def model_not_compiled(self) -> str | None:
        """After a training step: why the model ran as written in FP32
        (no graph compiled, or none that takes trainable parameters), else None."""
        if self.graphs == 0:
            return (
                "amp: the first step compiled no graph, so the model ran as written in FP32 "
                "(Dynamo could not see inside it). Compile the modules it cannot see into "
                "yourself, or report the model; amp will not train it in FP32 in silence."
            )
        if self.with_parameters == 0:
            return (
                "amp: the first step compiled no graph that uses the model's parameters: only "
                "the loss was compiled and the model ran as written in FP32 (Dynamo gave up on "
                "its forward; TORCH_LOGS=graph_breaks shows where). Remove what breaks the "
                "graph, or report the model; amp will not train it in FP32 in silence."
            )
        return None

    def parameters_outside(self, model: torch.nn.Module, used: set[int] | None = None) -> list[str]:
        """Trainable parameters of ``model`` that no compiled graph took: the code using them
        ran as written, in FP32 (a graph break Dynamo could not resume from, such as one
        inside a loop, runs the whole frame eagerly). ``used``: ids of the parameters the
        step used (those with a gradient after backward); the others are left out, since a
        parameter the forward never touches is in no graph either."""
        return [
            name
            for name, p in model.named_parameters()
            if p.requires_grad and id(p) not in self.parameter_ids and (used is None or id(p) in used)
        ]

    def parameters_outside_warning(self, model: torch.nn.Module, used: set[int] | None = None) -> str | None:
        """After a training step: which trainable parameters ran outside every compiled graph,
        in words for a warning, or None (all were compiled, or nothing was: that case is
        ``model_not_compiled``'s)."""
        from torch.distributed.tensor import DTensor

        if self.with_parameters == 0 or any(isinstance(p, DTensor) for p in model.parameters()):
            return None  # FSDP2 hands the graphs unsharded copies, never the DTensors themselves
        outside = self.parameters_outside(model, used)
        if not outside:
            return None
        total = sum(p.requires_grad for p in model.parameters())
        shown = ", ".join(outside[:4]) + (", ..." if len(outside) > 4 else "")
        return (
            f"amp: {len(outside)} of {total} trainable parameters were taken by no compiled "
            f"graph ({shown}): the code that uses them ran as written, in FP32, after a graph "
            "break (one inside a loop, such as a data-dependent torch.where per expert, makes "
            "Dynamo run the whole function eagerly; so do modules it does not trace, such as "
            "nn.LSTM). Their gradients are right but get no 16-bit speed-up; "
            "TORCH_LOGS=graph_breaks shows where."
        )

    def warn_parameters_outside(self, model: torch.nn.Module) -> None:
        """After the first backward: log ``parameters_outside_warning`` for the parameters
        the step used (those with a gradient), if any ran outside every graph."""
        said = self.parameters_outside_warning(model, {id(p) for p in model.parameters() if p.grad is not None})
        if said:
            log.warning(said)

    def uncompiled_share(self, model: torch.nn.Module, used: set[int] | None = None) -> tuple[float, list[str]]:
        """(share of ``model``'s matmul/conv weight elements that the step used outside every
        compiled graph, the modules holding them). FSDP2's DTensors are never handed to a
        graph (it gathers copies), so a sharded model measures (0.0, [])."""
        from torch.distributed.tensor import DTensor

        weights = matmul_weights(model)
        if any(isinstance(p, DTensor) for _, p in weights):
            return 0.0, []
        total = sum(p.numel() for _, p in weights)
        outside = [
            (name, p) for name, p in weights if id(p) not in self.parameter_ids and (used is None or id(p) in used)
        ]
        if not total or not outside:
            return 0.0, []
        modules = list(dict.fromkeys(name.rpartition(".")[0] or name for name, _ in outside))
        return sum(p.numel() for _, p in outside) / total, modules

    def enforce(self, model: torch.nn.Module, owner: str, max_share: float, dtype: str) -> None:
        """Before the first update: refuse (``UncompiledModelError``) a model of which more than
        ``max_share`` of the matmul/conv weight elements ran outside every compiled graph, or
        (``max_share`` < 1) none of which was compiled; below that, warn about what ran outside.
        Where ``dtype`` is FP32 (chosen or asked for) nothing is refused: the whole run is FP32."""
        if dtype == "fp32":
            max_share = 1.0
        used = {id(p) for p in model.parameters() if p.grad is not None} or None
        share, modules = self.uncompiled_share(model, used)
        why = self.model_not_compiled()
        refuse = share > max_share or (why is not None and max_share < 1.0)
        if refuse:  # the step's gradients go too: the model is as it was before the step
            for p in model.parameters():
                p.grad = None
        if why is not None and share <= max_share < 1.0:
            raise UncompiledModelError(f"{owner}: {why}{self._breaks_said()}")
        if share > max_share:
            shown = ", ".join(modules[:6]) + (f", ... ({len(modules)} modules)" if len(modules) > 6 else "")
            raise UncompiledModelError(
                f"{owner}: {share:.1%} of the model's matmul/conv weight elements ran outside amp's "
                f"compiled graphs, as written, in FP32 (limit {max_share:.0%}): {shown}.{self._breaks_said()} "
                "Nothing was updated. Fix: remove what breaks the graph (TORCH_LOGS=graph_breaks shows "
                "where), or compile those modules yourself; to train them in FP32 knowingly, raise "
                f"max_uncompiled_share (now {max_share})."
            )
        self.warn_parameters_outside(model)

    def _breaks_said(self) -> str:
        breaks = self.graph_breaks()
        if not breaks:
            return ""
        return " Dynamo's graph breaks: " + "; ".join(breaks[:5]) + (" ..." if len(breaks) > 5 else "") + "."

    def reset(self) -> None:
        self.graphs = self.with_parameters = 0
        self.parameter_ids.clear()
        self.mark()


def parameters_read(model, margs, mkwargs) -> set[int] | None:
    """ids of the parameters one eager forward reads (a parameter it never reads is in no
    graph either, and is no sign of code run outside them); None when that cannot be told
    (not a module, or its eager forward fails): then nothing is said."""
    TorchDispatchMode = private("torch.utils._python_dispatch.TorchDispatchMode")

    if not isinstance(model, torch.nn.Module):
        return None
    params, seen = {id(p) for p in model.parameters()}, set()

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.update(id(a) for a in pytree.tree_leaves((args, kwargs)) if id(a) in params)
            return func(*args, **(kwargs or {}))

    try:
        with torch.no_grad(), Reads():
            model(*margs, **mkwargs)
    except Exception:  # the plan is already shown; this is only a warning
        return None
    return seen


def check_share(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(
            f"max_uncompiled_share must be a number in [0, 1] (0: refuse any matmul weight outside "
            f"amp's graphs; default {MAX_UNCOMPILED_SHARE}), got {value!r}"
        )
    return float(value)


def matmul_weights(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """Trainable weights of 2 or more dims that feed a matmul or convolution: all of them
    but tables only an embedding looks up (a tied LM head's table counts)."""
    lookups = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    owners: dict[int, list[torch.nn.Module]] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append(m)
    found = []
    for name, p in model.named_parameters():
        if p.requires_grad and p.dim() >= 2 and not all(isinstance(m, lookups) for m in owners.get(id(p), ())):
            found.append((name, p))
    return found


def _breaks() -> Counter:
    counters = private("torch._dynamo.utils.counters")
    return Counter(counters["graph_break"]) + Counter(counters["unimplemented"])


def _one_line(reason: str) -> str:
    """Dynamo's reason as its first line and its debug context."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    context = next((line for line in lines if line.startswith("Developer debug context:")), "")
    context = context.removeprefix("Developer debug context:").strip()
    return f"{lines[0] if lines else reason} ({context[:160]})" if context else (lines[0] if lines else reason)


def _parameters(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> list[torch.Tensor]:
    """Trainable leaves the graph takes: Dynamo lifts the parameters it uses to inputs, or
    (install_free_tensors) holds them on the graph. A graph of only a loss on an output
    computed eagerly has none."""
    inputs = list(example_inputs)
    for i, node in enumerate(gm.graph.find_nodes(op="placeholder")[: len(inputs)]):
        if isinstance(inputs[i], FakeTensor):
            # a piece of a graph DDP's optimizer split into buckets gets fake inputs; the
            # placeholder still holds the real tensor Dynamo lifted
            real = getattr(node.meta.get("grapharg"), "example", None)
            inputs[i] = real if isinstance(real, torch.Tensor) else inputs[i]
    held = tensor_attributes(gm).values()
    return [x for x in (*inputs, *held) if isinstance(x, torch.Tensor) and x.requires_grad and x.is_leaf]
