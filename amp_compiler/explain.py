"""``explain``: the precision plan of a model without running a code generator."""

from __future__ import annotations

from typing import Any

import torch

from .backend import AmpBackend
from .plan import PrecisionPlan


def _as_is(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
    return gm.forward


def trace(
    model: torch.nn.Module | Any,
    *args: Any,
    dtype: str = "bf16",
    options: dict | None = None,
    backend: Any = None,
    **kwargs: Any,
) -> Any:
    """Run ``model(*args, **kwargs)`` once through ``backend`` (default: an amp backend that
    executes the rewritten graphs as they are); return the backend, with its records.

    No gradients; buffers (BatchNorm running stats) are restored afterwards, so
    tracing changes nothing.
    """
    if backend is None:
        backend = AmpBackend(options, dtype=dtype, inner=_as_is)
    buffers = []
    if isinstance(model, torch.nn.Module):
        buffers = [(b, b.detach().clone()) for b in model.buffers()]
    compiled = torch.compile(model, backend=backend)
    try:
        with torch.no_grad():
            compiled(*args, **kwargs)
    finally:
        with torch.no_grad():
            for buf, saved in buffers:
                buf.copy_(saved)
    return backend


def explain(
    model: torch.nn.Module | Any, *args: Any, dtype: str = "bf16", options: dict | None = None, **kwargs: Any
) -> PrecisionPlan:
    """The precision plan of ``model(*args, **kwargs)``: ``trace`` it and merge the plans
    of every graph (graph breaks are followed). Changes nothing in the model."""
    return trace(model, *args, dtype=dtype, options=options, **kwargs).plan()
