"""Post-grad pass (CPU, 16 bit): a matmul of a batch with one shared weight runs as one mm.

``linear`` on a 3-D input whose leading dimensions cannot be flattened by a view (e.g.
``nn.MultiheadAttention``'s input projection on a transposed ``(seq, batch, d)`` tensor)
decomposes to ``bmm(x, expand(w))``, the weight broadcast with batch stride 0. oneDNN's
16-bit bmm copies the broadcast weight once per batch entry first: for the 512-wide
encoder in ``tools/bench.py`` (128 x 512 x 1536) that was 22 ms of copy and 27 ms of bmm
per layer, against 4 ms for the same FLOPs as one mm. The rewrite copies the activation
into a contiguous ``(batch * m, k)`` matrix instead (what eager ``matmul`` does) and runs
``mm``; the result is the same matmul, a view of it.
"""

from __future__ import annotations

import torch

from amp_compiler.passes.graph_util import LOW_FLOATS, tensor_val

aten = torch.ops.aten


def _shared_weight(node) -> torch.fx.Node | None:
    """``w`` when ``node`` is ``expand(w, [b, k, n])`` of a 2-D ``w``."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is aten.expand.default):
        return None
    w = node.args[0]
    wv, ev = tensor_val(w), tensor_val(node)
    if wv is None or ev is None or wv.dim() != 2 or ev.dim() != 3:
        return None
    return w if ev.stride(0) == 0 else None


def _call(graph, target, args, kwargs=None):
    node = graph.call_function(target, args, kwargs or {})
    vals = [(tensor_val(a) if isinstance(a, torch.fx.Node) else a) for a in args]
    fake = next(v for v in vals if isinstance(v, torch.Tensor)).fake_mode
    with fake:
        node.meta["val"] = target(*vals, **(kwargs or {}))
    return node


def fold_broadcast_bmm(graph: torch.fx.Graph) -> int:
    """Rewrite ``bmm(x, expand(w))`` on CPU in 16 bit into ``view(mm(flat(x), w))``."""
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.bmm.default:
            continue
        x, wide = node.args
        w, out, xv = _shared_weight(wide), tensor_val(node), tensor_val(x)
        if w is None or out is None or xv is None or out.device.type != "cpu" or out.dtype not in LOW_FLOATS:
            continue
        b, m, k = xv.shape
        with graph.inserting_before(node):
            flat = _call(graph, aten.clone.default, (x,), {"memory_format": torch.contiguous_format})
            flat = _call(graph, aten.view.default, (flat, [b * m, k]))
            mm = _call(graph, aten.mm.default, (flat, w))
            new = _call(graph, aten.view.default, (mm, list(out.shape)))
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        done += 1
    if done:
        graph.eliminate_dead_code()
    return done
