"""The partitioner under the default budget: a parameter's 16-bit copy is saved for
backward, not recast there.

A parameter is alive across the step anyway, so to the partitioner saving it is free
(``treat_parameters_as_free_to_save``) and under a memory budget below 1 it recomputes
the parameter's 16-bit copy in backward from it. That trades 2 bytes per parameter,
whatever the batch, for a second pass over every weight (read 4 bytes, write 2) in
each backward: on a 4-layer LM at 8x128 tokens, 26 MiB of saved bytes against ~7 ms
of a ~350 ms step on a 2-core CPU. Speed first: those casts are marked
``MUST_SAVE`` (a partitioner of its own: only the partitioner is told which inputs
are parameters). An explicit ``memory_budget`` leaves the choice to the partitioner.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy

from amp_compiler.passes import graph_util
from amp_compiler.passes.graph_util import JOINT_CAST, JOINT_VIEWS, LOW_FLOATS, closure, tangent_dependent
from amp_compiler.upstream.torch_private import private


def keep_weight_copies(graph: torch.fx.Graph, static: list[torch.fx.Node]) -> int:
    """Mark the forward's 16-bit casts of ``static`` inputs (through views) MUST_SAVE;
    returns how many."""
    bwd = tangent_dependent(graph)
    casts = {
        u
        for primal in static
        for v in closure(primal, JOINT_VIEWS)
        for u in v.users
        if u.target is JOINT_CAST and u.args[1] in LOW_FLOATS and u not in bwd
    }
    for cast in casts:
        cast.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    return len(casts)


class WeightCopiesSaved(private("torch._inductor.custom_graph_pass.CustomPartitionerFn")):
    """Inductor's partitioner (the min cut) after ``keep_weight_copies``: only the
    partitioner is told which inputs are parameters."""

    def __call__(self, gm, joint_inputs, **kwargs):
        is_primal = private("torch._functorch.partitioners._is_primal")
        partition = private("torch._functorch.partitioners.min_cut_rematerialization_partition")
        static = kwargs.get("static_lifetime_input_indices") or []
        primals = [n for n in gm.graph.nodes if is_primal(n)]
        keep_weight_copies(gm.graph, [primals[i] for i in static if i < len(primals)])
        return partition(gm, joint_inputs, **kwargs)

    def uuid(self):
        return private("torch._inductor.custom_graph_pass.get_hash_for_files")((__file__, graph_util.__file__))
