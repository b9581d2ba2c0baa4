"""Fuse the loss head: vocabulary projection + cross-entropy / log-prob gather as one op.

Recognised, after casts are placed (so the projection's inputs are in the plan's dtype):

    linear(h, W[, b])  or  matmul(h, t(W))           the logits, [..., V]
      -> casts, contiguous, views and slices that keep the last dim, x or / a scalar, tanh
      -> cross_entropy_loss(., target)  (2-D, no class weights, hard targets)
       | nll_loss_nd(log_softmax(., -1), target)
       | gather(log_softmax(., -1), -1, index)        (per-token log-probs: DPO, KTO, RL)
       | amp::logits_stats(., target, ...)            (log-probs and entropy: TRL's head)

becomes ``amp::head_stats`` (``amp_compiler.loss_head``) on ``h`` with the same views
applied, and the loss rebuilt from its three per-token FP32 statistics with ordinary
ops (ignore_index, label smoothing, reduction); ``amp::logits_stats`` becomes
``amp::head_stats`` with the same outputs. Logits with another reader (a model output)
stay as written and the loss reads its statistics from them (``amp::logits_stats``, no
second projection). In a training graph whose loss is a mean or sum of the cross-entropies
the op computes its gradients in forward (``ahead``, BF16 or exact: see ``_Fusion._ahead``).
A head that does not match is left exactly as it was, with the reason on its loss node.
"""

from __future__ import annotations

import math
import operator

import torch

from amp_compiler.device import memory_bytes
from amp_compiler.loss_head import (
    NO_IGNORE,
    UNDECIDED,
    ahead_bytes,
    ahead_itemsize,
    ahead_shape,
    block_shape,
    exact_products,
    format_chain,
    parse_chain,
    settings,
)
from amp_compiler.meta import NodeInfo, dtype_name, info
from amp_compiler.policy import Precision

from .graph_util import needs_grad, refresh_vals
from .infra import PassContext, PassResult

aten = torch.ops.aten
CE = aten.cross_entropy_loss.default
NLL = {aten.nll_loss_nd.default, aten.nll_loss.default}
LOG_SOFTMAX = {aten.log_softmax.int, aten._log_softmax.default}
GATHER = aten.gather.default
STATS = torch.ops.amp.logits_stats.default
CASTS = {aten.to.dtype, aten._to_copy.default}
SAME = {aten.contiguous.default, aten.clone.default, aten.alias.default}
RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
ROW_OPS = RESHAPES | {aten.flatten.using_ints, aten.slice.Tensor, aten.select.int}
SCALES = {aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar}
TRANSPOSES = {aten.t.default, aten.transpose.int, aten.permute.default, aten.numpy_T.default}
# How the exact head projects, by ``loss_head.exact_products``
_EXACT_HOW = {
    "fp32": "FP32 projection (loss_head='exact')",
    "split": "projection to FP32's accuracy as split BF16 products, three BF16 GEMMs writing FP32 (loss_head='exact')",
    "split-onednn": (
        "projection to FP32's accuracy as split BF16 products, three FP32 GEMMs of BF16 halves whose products "
        "oneDNN runs in BF16 (loss_head='exact')"
    ),
    UNDECIDED: (
        "projection to FP32's accuracy: FP32 GEMMs, or split BF16 products that oneDNN runs in BF16 where one "
        "block of this width times faster split at the first step (loss_head='exact')"
    ),
}
# loss_head="auto" fuses where the unfused logits would take 1/AUTO_SHARE of the memory or more
AUTO_SHARE = 8


class _NotFused(Exception):
    pass


def fuse_loss_head(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Rewrite every fusable loss head; say on each unfused one why not."""
    mode = ctx.options.loss_head
    fused, unfused = [], []
    if mode == "off":
        return PassResult(False, {"fused": [], "unfused": [], "loss_head": "off"})
    for node in list(gm.graph.nodes):
        site = _site(node)
        if site is None:
            continue
        try:
            fused.append(_Fusion(gm, ctx, node, *site).run())
        except _NotFused as e:
            i = info(node)
            if i is not None:
                i.reason += f"; loss head not fused: {e}"
            unfused.append({"node": node.name, "why": str(e)})
    return PassResult(bool(fused), {"fused": fused, "unfused": unfused})


def _site(node: torch.fx.Node):
    """(kind, logits node, node whose uses the fused loss takes over) or None."""
    if node.op != "call_function":
        return None
    if node.target is CE:
        return "cross_entropy", node.args[0], node
    if node.target in NLL and _is_log_softmax(node.args[0]):
        return "nll_loss", node.args[0].args[0], node
    if node.target is GATHER and _is_log_softmax(node.args[0]):
        return "log_prob_gather", node.args[0].args[0], node
    if node.target is STATS:
        return "log_prob_stats", node.args[0], node
    return None


def _is_log_softmax(node: object) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in LOG_SOFTMAX


def _val(node: object):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _width(h: torch.fx.Node) -> int | None:
    """The head's width where the graph fixes it (a symbol under dynamic shapes: None)."""
    width = _val(h).shape[-1]
    return width if isinstance(width, int) else None


def _arg(node: torch.fx.Node, index: int, name: str, default):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _last(dim: int, ndim: int) -> bool:
    return dim % ndim == ndim - 1


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class _Fusion:
    def __init__(self, gm, ctx, node, kind, logits, consumer):
        self.gm, self.graph, self.ctx = gm, gm.graph, ctx
        self.node, self.kind, self.logits = node, kind, logits
        self.consumer = consumer  # the node replaced by the rebuilt loss
        self.created: list[torch.fx.Node] = []
        self.choice = ""  # loss_head="auto": why fused
        self.from_logits = False  # the statistics read from logits the graph keeps anyway
        self.ahead = ""  # the gradients' bytes where the head computes them in forward
        self.grads = ""  # which: "h", "w" or "hw" (its input's, its weight's and bias's)

    # -- recognise ---------------------------------------------------------------------
    def run(self) -> dict:
        self._check_loss()
        head, row_ops, chain, path = self._walk()
        h, w, b = self._operands(head)
        vocab, width = _val(w).shape
        if not isinstance(vocab, int) or not isinstance(width, int):
            raise _NotFused("the vocabulary or hidden size is dynamic")
        least = settings().min_vocab
        if vocab < least:
            raise _NotFused(f"vocabulary of {vocab} < {least}: its logits are small, fusing saves little")
        # the FP32 master weight (not its 16-bit copy): cast per call, its gradient kept FP32
        w, b = _source(w), _source(b)
        exact = self.ctx.options.loss_head == "exact" or _val(h).dtype == torch.float32
        ends = {self.consumer, self.node.args[0]}
        kept = [u.name for n in path for u in n.users if u not in path and u not in ends]
        # logits the graph keeps anyway (a model output): their statistics are read from them,
        # not from a second projection; only the FP32 log-probs are spared
        self.from_logits = bool(kept) and not exact
        if self.from_logits and self.kind == "log_prob_stats":
            raise _NotFused(f"its logits are read elsewhere too ({', '.join(kept)}): the statistics read them")
        low, tokens = _val(head).dtype, self._tokens()
        self.ahead = "" if self.from_logits else self._ahead(h, w, b, low, exact, tokens, vocab, width)
        if self.ctx.options.loss_head == "auto":
            self.choice = self._choose_kept(kept) if self.from_logits else self._choose(head, vocab)
        if exact:
            h = _source(h)
        return self._rewrite(head, h, w, b, row_ops, chain, path, exact, vocab, width, kept)

    def _choose_kept(self, kept: list[str]) -> str:
        """``loss_head="auto"`` where the logits are kept for another reader: read their
        statistics where that spares the FP32 log-probs, else keep the head as written."""
        if _recomputes_log_probs(self.ctx):
            raise _NotFused(
                f"auto: left as written: its logits are kept for {', '.join(kept)} anyway, and Inductor's "
                "partitioner keeps no FP32 log-probs beside them, so reading their statistics in amp's op "
                "would save no memory and was slower (1.07-1.2x the step of a 50k-vocabulary decoder on CPU); "
                "loss_head='fused' reads them there"
            )
        return "auto: statistics read from the logits the graph keeps anyway (no FP32 log-probs kept beside them)"

    def _choose(self, head: torch.fx.Node, vocab: int) -> str:
        """``loss_head="auto"``: fuse where the logits kept for backward would take a large share
        of the memory, else keep the faster head as written (raises _NotFused with the figures)."""
        tokens = self._tokens()
        if self.ahead and _val(head).device.type == "cpu":  # measured there only
            logits = _saved(tokens, vocab, _val(head).dtype, self.ctx)
            return (
                "auto: fused, in one pass: computing its gradients in forward costs about the time of the head "
                "as written (a step 0.97-1.02x on a 50k-vocabulary tied decoder, 1.04x on a 32k one with a "
                f"biased head, 2-core CPU) and keeps {self.ahead} of gradients for backward in place of {logits} "
                "of logits"
            )
        if tokens is None:
            return "auto: fused, the number of tokens is dynamic (the logits' size has no bound here)"
        kept = _saved_bytes(tokens, vocab, _val(head).dtype, self.ctx)
        memory = self.ctx.options.memory_bytes or memory_bytes(_val(head).device)
        if kept * AUTO_SHARE < memory:
            raise _NotFused(
                f"auto: left as written, faster: its logits kept for backward ({_size(kept)}) are under "
                f"1/{AUTO_SHARE} of the memory ({_size(memory)}); fusing recomputes the projection in "
                "backward (~1.1-1.3x the unfused head's step on CPU); loss_head='fused' fuses it"
            )
        return f"auto: fused, the logits as written would take at least 1/{AUTO_SHARE} of the memory ({_size(memory)})"

    def _tokens(self) -> int | None:
        """Rows of logits, None where symbolic (Size.numel() would specialise them)."""
        dims = _val(self.logits).shape[:-1]
        return math.prod(dims) if all(isinstance(s, int) for s in dims) else None

    def _check_loss(self) -> None:
        n = self.node
        if self.kind == "log_prob_gather":
            lsm = n.args[0]
            if len(lsm.users) != 1:
                raise _NotFused(f"the log-probs are read by {len(lsm.users)} ops, not one gather")
            if not _last(_arg(lsm, 1, "dim", -1), _val(lsm).dim()) or not _last(n.args[1], _val(lsm).dim()):
                raise _NotFused("log_softmax/gather not over the last (vocabulary) dim")
            if _val(n.args[2]).shape[-1] != 1 or _val(n.args[2]).dim() != _val(lsm).dim():
                raise _NotFused("the gather reads more than one entry per row")
            return
        src = n.args[0]
        if self.kind == "log_prob_stats":
            if _val(src).dim() != 2:
                raise _NotFused(f"logits of {_val(src).dim()} dims")
            return
        if self.kind == "nll_loss":
            if len(src.users) != 1:
                raise _NotFused("the log-probs are read by more than the loss")
            if not _last(_arg(src, 1, "dim", -1), _val(src).dim()):
                raise _NotFused("log_softmax not over the class dim")
        if _val(src).dim() != 2:
            raise _NotFused(f"logits of {_val(src).dim()} dims (the class dim is not last)")
        if _arg(n, 2, "weight", None) is not None:
            raise _NotFused("class weights")
        target = _val(n.args[1])
        if target is None or target.is_floating_point():
            raise _NotFused("soft (probability) targets")

    def _walk(self):
        """From the logits back to the projection: (head, row ops, scale chain, nodes passed)."""
        row_ops, chain, path = [], [], []
        node = self.logits
        while True:
            if not isinstance(node, torch.fx.Node) or node.op != "call_function":
                raise _NotFused("the logits are not computed in this graph")
            val = _val(node)
            if not isinstance(val, torch.Tensor) or val.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise _NotFused(f"'{node.name}' is not a floating tensor")
            path.append(node)
            t = node.target
            if t in (aten.linear.default, aten.matmul.default, aten.mm.default):
                return node, row_ops[::-1], chain[::-1], path
            src = node.args[0]
            if t in CASTS:
                if node.kwargs.get("device") is not None or node.kwargs.get("layout") is not None:
                    raise _NotFused(f"'{node.name}' moves the logits")
            elif t in SAME:
                pass
            elif t in ROW_OPS:
                self._row_op(node)
                row_ops.append(node)
            elif t in SCALES:
                scalar = _number(node.args[1])
                if scalar is None and t in (aten.mul.Tensor, aten.mul.Scalar):
                    scalar, src = _number(node.args[0]), node.args[1]
                if scalar is None or scalar == 0:
                    raise _NotFused(f"'{node.name}' scales the logits by a tensor")
                chain.append(("m", 1.0 / scalar if t in (aten.div.Tensor, aten.div.Scalar) else scalar))
            elif t is aten.tanh.default:
                chain.append(("t", 0.0))
            else:
                raise _NotFused(f"the logits pass through {t} ('{node.name}')")
            node = src

    def _row_op(self, node: torch.fx.Node) -> None:
        before, after = _val(node.args[0]), _val(node)
        if before.dim() == 0 or after.dim() == 0 or before.shape[-1] != after.shape[-1]:
            raise _NotFused(f"'{node.name}' reshapes the vocabulary dim")
        t = node.target
        if t in (aten.slice.Tensor, aten.select.int):
            dim = _arg(node, 1, "dim", 0)
            if _last(dim, before.dim()):
                raise _NotFused(f"'{node.name}' slices the vocabulary")
        elif t is aten.flatten.using_ints:
            end = _arg(node, 2, "end_dim", -1)
            if _last(end, before.dim()):
                raise _NotFused(f"'{node.name}' flattens the vocabulary dim")

    def _operands(self, head: torch.fx.Node):
        if head.target is aten.linear.default:
            h, w = head.args[0], head.args[1]
            b = _arg(head, 2, "bias", None)
        else:
            h, wt = head.args
            wt = _source(wt)  # `h @ emb.weight.t()`: the plan's cast can sit after the transpose
            if not (isinstance(wt, torch.fx.Node) and wt.target in TRANSPOSES and _val(wt).dim() == 2):
                raise _NotFused(f"'{head.name}' multiplies by a matrix that is not a transposed weight")
            if wt.target is aten.permute.default and list(wt.args[1]) not in ([1, 0], [-1, -2]):
                raise _NotFused(f"'{wt.name}' is not a transpose")
            w, b = wt.args[0], None
        if _val(w) is None or _val(w).dim() != 2 or _val(h).dim() < 1:
            raise _NotFused(f"'{head.name}' is not a vocabulary projection")
        if _val(h).shape[-1] != _val(w).shape[1]:
            raise _NotFused(f"'{head.name}': hidden size mismatch")
        if head.target is aten.mm.default and _val(h).dim() != 2:
            raise _NotFused(f"'{head.name}' is not a 2-D matmul")
        return h, w, b

    # -- rewrite -----------------------------------------------------------------------
    def _emit(self, target, args, reason, precision=Precision.FP32, kwargs=None):
        node = self.graph.call_function(target, tuple(args), kwargs or {})
        node._rename(f"loss_head_{node.name}")  # apart from the names of the program as written
        node.meta["amp"] = NodeInfo(precision, reason, op=str(target), module=self.module)
        for key in ("stack_trace", "nn_module_stack"):
            if key in self.node.meta:
                node.meta[key] = self.node.meta[key]
        self.created.append(node)
        return node

    def _rewrite(self, head, h, w, b, row_ops, chain, path, exact, vocab, width, kept) -> dict:
        self.module = next((i.module for i in (info(head), info(self.node)) if i is not None and i.module), "")
        low = _val(head).dtype  # what the head as written computes (and keeps) its logits in
        tokens = self._tokens()
        rows, cols = block_shape(tokens, vocab, _val(h).device.type)
        blocks = f"blocks of {rows} tokens x {cols} vocabulary entries" if rows else "blocks of 4M logits"
        from_logits = self.from_logits
        choice = f"; {self.choice}" if self.choice else ""
        with self.graph.inserting_before(self.node):
            x = head if from_logits else h
            for op in row_ops:  # the views the logits went through, on h (or on the logits)
                args, target = list(op.args), op.target
                args[0] = x
                if target in RESHAPES:  # reshape: the contiguous() copies between were skipped
                    target, args[1] = aten.reshape.default, [*list(args[1])[:-1], vocab if from_logits else width]
                why = (
                    "the logits' view, replayed on the 16-bit logits"
                    if from_logits
                    else "the logits' view, applied to the head's input"
                )
                x = self._emit(target, args, why, Precision.PASSTHROUGH)
            extras, with_sum = "", None
            if self.kind == "log_prob_gather":
                x = self._emit(aten.flatten.using_ints, [x, 0, -2], "rows of the head's input", Precision.PASSTHROUGH)
                target = self._emit(aten.flatten.using_ints, [self.node.args[2]], "gather index as rows")
                ignore, smoothing = NO_IGNORE, 0.0
            elif self.kind == "log_prob_stats":  # its own chain applies after the path's
                target, own, ignore, with_sum = self.node.args[1:5]
                extras = _arg(self.node, 5, "extras", "")
                chain, smoothing = [*chain, *parse_chain(own)], 0.0
            else:
                target = self.node.args[1]
                ignore = _arg(self.node, 4, "ignore_index", -100)
                smoothing = _arg(self.node, 5, "label_smoothing", 0.0) if self.kind == "cross_entropy" else 0.0
            with_sum = bool(smoothing) or bool(with_sum)
            saved_bytes = _saved_bytes(tokens, vocab, low, self.ctx)
            if from_logits:  # the logits stay; only FP32 log-probs kept beside them are spared
                saved_bytes = saved_bytes and tokens * vocab * _log_prob_bytes(self.ctx)
                stats = self._emit(
                    torch.ops.amp.logits_stats.default,
                    [x, target, format_chain(chain), ignore, with_sum, extras],
                    f"loss statistics ({self.kind}, vocabulary {vocab}) read from the {dtype_name(low)} logits "
                    f"the graph keeps for {', '.join(kept)} (not projected again), log-sum-exp and target in "
                    f"FP32 inside one generated kernel; {_saved_log_probs(saved_bytes, self.ctx)}" + choice,
                    Precision.FP32,
                )
            else:
                how = (
                    _EXACT_HOW[exact_products(_val(h).device, _width(h), measure=False)]
                    if exact
                    else f"projection in {dtype_name(low)} (FP32 accumulation)"
                )
                args = [x, w, b, target, format_chain(chain), ignore, exact, with_sum, extras]
                if ahead := self.ahead:
                    args += [self.grads, float(smoothing)]
                    device = _val(h).device
                    itemsize = ahead_itemsize(device, low, exact)
                    rows, cols = ahead_shape(tokens or settings().max_rows, vocab, itemsize, device.type)
                    grads = (
                        f"blocks of up to {rows} tokens x {cols} vocabulary entries, its gradients computed in forward "
                        "while each block's logits are at hand (no projection again in backward, which scales "
                        f"them by the loss's mean or sum; {ahead} of FP32 gradients kept)"
                    )
                else:
                    grads = f"{blocks}, recomputed per block in backward, the weight's gradient FP32"
                stats = self._emit(
                    torch.ops.amp.head_stats.default,
                    args,
                    f"fused loss head ({self.kind}, vocabulary {vocab}): {how}, log-sum-exp and target in FP32, "
                    f"{grads}; {_saved(tokens, vocab, low, self.ctx)} of logits not kept for backward{choice}",
                    Precision.FP32 if exact else Precision.LOW,
                )
            if self.kind == "log_prob_stats":  # the same outputs: its getitem users read them
                out = stats
            else:
                picked, lse, total = (
                    self._emit(operator.getitem, [stats, i], "fused loss head statistic") for i in range(3)
                )
                out = self._loss(picked, lse, total, target, ignore, smoothing, vocab)
        try:
            refresh_vals(self.gm, self.ctx.fake_mode)
        except Exception as e:  # noqa: BLE001 - a view that does not replay on h: left as written
            self._undo()
            raise _NotFused(f"the logits' views do not apply to the head's input ({type(e).__name__})") from None
        for n in self.created:
            i = info(n)
            i.orig = i.planned = _dtype_of(n)
        rows_in, rows_out = _val(x).shape[:-1], _val(self.node.args[0]).shape[:-1]
        if self.kind != "log_prob_gather" and not _same(rows_in, rows_out):
            self._undo()
            raise _NotFused("the head's input does not line up with the logits' rows")
        info(out).replaces = self.consumer.name
        self.consumer.replace_all_uses_with(out)
        self._erase_dead([self.consumer, *([self.node.args[0]] if self.kind != "cross_entropy" else []), *path])
        return {
            "kind": self.kind,
            "node": stats.name,
            "vocab": vocab,
            "block": None if from_logits else (rows, cols),
            "ahead": self.grads if self.ahead else "",
            "from_logits": from_logits,
            "exact": exact,
            "logits_kept_for": kept,
            "saved_bytes": saved_bytes,
        }

    def _ahead(self, h, w, b, low, exact, tokens, vocab: int, width: int) -> str:
        """The bytes of gradients the head keeps when it computes them in forward (its
        loss a mean or sum of cross-entropies, in training), '' where it recomputes them in
        backward: FP16 (its unscaled gradients could leave FP16's range), a loss per token
        (weighed by the caller: its gradient is not known ahead), nothing to train, or
        gradients larger than the logits they spare."""
        if self.kind not in ("cross_entropy", "nll_loss") or _arg(self.node, 3, "reduction", 1) not in (1, 2):
            return ""
        want_h, want_w = needs_grad(h), needs_grad(w) or (b is not None and needs_grad(b))
        self.grads = "h" * want_h + "w" * want_w
        if not (exact or low == torch.bfloat16) or not self.grads:
            return ""
        if isinstance(tokens, int):
            kept = ahead_bytes(tokens * want_h, vocab * want_w, width)
            return _size(kept) if kept <= tokens * vocab * torch.finfo(low).bits // 8 else ""
        per_token = f"{4 * width} bytes per token" if want_h else ""
        return " and ".join(filter(None, (per_token, _size(4 * width * vocab) if want_w else "")))

    def _loss(self, picked, lse, total, target, ignore, smoothing, vocab):
        why = "loss from the fused head's FP32 statistics"
        if self.kind == "log_prob_gather":
            logp = self._emit(aten.sub.Tensor, [picked, lse], why)
            return self._emit(aten.view_as.default, [logp, self.node.args[2]], why)  # the gather's shape
        nll = self._emit(aten.sub.Tensor, [lse, picked], why)
        if smoothing:
            mean_z = self._emit(aten.div.Tensor, [total, float(vocab)], why)
            smooth = self._emit(aten.sub.Tensor, [lse, mean_z], why)
            nll = self._emit(aten.lerp.Scalar, [nll, smooth, float(smoothing)], why)
        valid = self._emit(aten.ne.Scalar, [target, ignore], why)
        per = self._emit(aten.where.ScalarOther, [valid, nll, 0.0], why)
        reduction = _arg(self.node, 3, "reduction", 1)
        if reduction == 0:
            return per
        loss = self._emit(aten.sum.default, [per], why)
        if reduction == 2:
            return loss
        count = self._emit(aten.sum.default, [valid], why)
        return self._emit(aten.div.Tensor, [loss, count], why)

    def _undo(self) -> None:
        for n in reversed(self.created):
            self.graph.erase_node(n)

    def _erase_dead(self, nodes) -> None:
        """The replaced nodes, then whatever only they read (the logits, the head, casts)."""
        todo, erased = list(nodes), set()
        while todo:
            n = todo.pop(0)
            if n in erased or n.users or n.op != "call_function" or n.is_impure():
                continue
            inputs = n.all_input_nodes
            self.ctx.user_casts.discard(n.name)  # the user's .float(): the head computes in FP32
            self.graph.erase_node(n)
            erased.add(n)
            todo.extend(x for x in inputs if x.op == "call_function")


def _same(a, b) -> bool:
    """Equal sizes, symbolic ones compared as expressions (no guard on their values)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, int) and isinstance(y, int):
            if x != y:
                return False
        elif str(x) != str(y):
            return False
    return True


def _source(node):
    """The FP32 value behind an inserted cast (for the exact head)."""
    i = info(node) if isinstance(node, torch.fx.Node) else None
    return node.args[0] if i is not None and i.inserted else node


def _dtype_of(node: torch.fx.Node):
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.dtype
    if isinstance(val, (tuple, list)):
        return tuple(v.dtype for v in val)
    return None


def _recomputes_log_probs(ctx: PassContext) -> bool:
    """Whether the inner compiler keeps only the 16-bit logits of a head as written, its
    FP32 log-probs recomputed in backward (Inductor's partitioner: measured, the 50k-vocabulary
    decoder keeps as much as with no head at all but its 16-bit logits and weight copy)."""
    return ctx.options.inner == "inductor"


def _log_prob_bytes(ctx: PassContext) -> int:
    """Bytes per logit of the FP32 log-probs a head as written keeps beside its logits."""
    return 0 if _recomputes_log_probs(ctx) else 4


def _per_logit(low: torch.dtype, ctx: PassContext) -> int:
    """Bytes a head as written keeps for backward per logit: the 16-bit logits, and the FP32
    log-probs where the inner compiler keeps them too."""
    return torch.finfo(low).bits // 8 + _log_prob_bytes(ctx)


def _saved_bytes(tokens, vocab: int, low: torch.dtype, ctx: PassContext) -> int | None:
    """The logits a 16-bit head as written keeps for backward (None: tokens not known)."""
    if not isinstance(tokens, int):
        return None
    return tokens * vocab * _per_logit(low, ctx)


def _saved_log_probs(n: int | None, ctx: PassContext) -> str:
    if _recomputes_log_probs(ctx):
        return "no memory saved: Inductor keeps no FP32 log-probs beside the logits either"
    return f"{_size(n) if n is not None else '4 bytes a logit'} of FP32 log-probs not kept for backward"


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _saved(tokens, vocab: int, low: torch.dtype, ctx: PassContext) -> str:
    n = _saved_bytes(tokens, vocab, low, ctx)
    per = vocab * _per_logit(low, ctx)
    return f"{n / 2**20:.1f} MiB" if n is not None else f"{per} bytes per token"
