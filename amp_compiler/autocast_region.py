"""A user's ``torch.autocast`` around the compiled call, made a region of the graph.

Dynamo traced the model under it and baked in what the model read then, so amp keeps it as
a region spanning the graph (as a ``torch.autocast`` inside the model) and adds its plan.
"""

from __future__ import annotations

import logging

import torch

from .meta import dtype_name
from .policy import LOW_DTYPES

log = logging.getLogger("amp_compiler")


def autocast_around(device: torch.device) -> str | None:
    """ "bf16"/"fp16" when the compiled call runs under the user's torch.autocast for ``device``."""
    try:
        if not torch.is_autocast_enabled(device.type):
            return None
        low = torch.get_autocast_dtype(device.type)
    except RuntimeError:  # a device type autocast does not know
        return None
    name = dtype_name(low)
    return name if name in LOW_DTYPES else None


def autocast_region(gm: torch.fx.GraphModule, device_type: str, low: torch.dtype) -> None:
    """Make the user's torch.autocast around the call a region spanning ``gm``."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    anchor = placeholders[-1] if placeholders else None
    with graph.inserting_after(anchor) if anchor else graph.inserting_before(None):
        enter = graph.call_function(torch.amp.autocast_mode._enter_autocast, (device_type, low, True, None))
    with graph.inserting_before(graph.output_node()):
        graph.call_function(torch.amp.autocast_mode._exit_autocast, (enter,))
    gm.recompile()


_warned_autocast: set[tuple[str, str]] = set()


def warn_autocast_around(device: torch.device, around: str, dtype: str) -> None:
    if (device.type, around) in _warned_autocast:
        return
    _warned_autocast.add((device.type, around))
    log.warning(
        "amp: the compiled model is called under torch.autocast(%r, %s): its casts stay "
        "in the compiled graphs (Dynamo traced the model under it) and amp's plan (%s) "
        "adds its own, as for a torch.autocast inside the model. Drop the torch.autocast "
        "context: amp needs none.",
        device.type,
        around,
        dtype,
    )
