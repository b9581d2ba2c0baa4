"""Joint-graph pass (CPU): comparison masks are recomputed in backward, not saved.

ReLU's backward is ``where(y <= 0, 0, grad)``; hardtanh's and leaky ReLU's are alike.
When the activation ``y`` is not saved anyway, the partitioner saves the comparison as
a bool tensor, and Inductor's C++ code writes and reads bool tensors about ten times
slower than the ops around them (2M elements, 2 cores: writing the mask 7.8 ms, the ReLU
itself 0.16 ms; the backward reading it 4.2 ms against 0.21 ms for ``threshold_backward``
on the activation). Marking the comparison MUST_RECOMPUTE makes the partitioner save
its floating-point input instead and backward recompute the mask in registers.

The values are bit-identical (the same comparison of the same tensor); the cost is the
input's bytes instead of one byte per element. Comparisons of random numbers (dropout's
mask) are left alone: recomputing them would need the random draw again. CUDA is left
alone too: Triton writes bool tensors at full speed, and there memory is the scarcer.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy

from amp_compiler.passes.graph_util import draws_random, tangent_dependent, tensor_val

aten = torch.ops.aten
_COMPARE = {aten.le, aten.lt, aten.ge, aten.gt, aten.eq, aten.ne}


def recompute_masks(graph: torch.fx.Graph) -> int:
    """Tag comparisons of forward values that backward reads as MUST_RECOMPUTE (the
    partitioner may place them in either half); returns how many."""
    bwd = tangent_dependent(graph)
    if not bwd:
        return 0
    done = 0
    for node in graph.nodes:
        if node in bwd or node.op != "call_function" or getattr(node.target, "overloadpacket", None) not in _COMPARE:
            continue
        out = tensor_val(node)
        if out is None or out.dtype != torch.bool or out.device.type != "cpu":
            continue
        inputs = [a for a in node.all_input_nodes if tensor_val(a) is not None]
        if not inputs or any(not tensor_val(a).is_floating_point() or draws_random(a) for a in inputs):
            continue
        if any(u in bwd for u in node.users):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            done += 1
    return done
