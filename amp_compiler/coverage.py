"""Which of a model's parameters the compiled graphs took: a training step's guard against
training in FP32 in silence (no graph compiled, or code run eagerly after a graph break)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from .capture import tensor_attributes

log = logging.getLogger("amp_compiler")


class Coverage:
    """Counts graphs and the trainable leaves each took, as the backend compiles them."""

    def __init__(self) -> None:
        self.graphs = 0  # graphs compiled so far
        self.with_parameters = 0  # of those, graphs that take trainable parameters
        self.parameter_ids: set[int] = set()  # id() of every trainable leaf a graph took

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

    def reset(self) -> None:
        self.graphs = self.with_parameters = 0
        self.parameter_ids.clear()


def _parameters(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> list[torch.Tensor]:
    """Trainable leaves the graph takes: Dynamo lifts the parameters it uses to inputs, or
    (install_free_tensors) holds them on the graph. A graph of only a loss on an output
    computed eagerly has none."""
    held = tensor_attributes(gm).values()
    return [x for x in (*example_inputs, *held) if isinstance(x, torch.Tensor) and x.requires_grad and x.is_leaf]
