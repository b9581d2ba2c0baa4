"""One training step of a model three ways: FP32 eager, eager torch.autocast, and amp.

The amp run goes through ``torch.compile(backend=AmpBackend(inner=<recording aot_eager>))``,
so what executed in 16 bit is read off the ops that ran, never off the loss.
Plain ``torch.compile(backend="aot_eager")`` runs too, to count its graphs: amp
must not compile more (a recompile the rewrite caused). Where eager autocast raises, amp's
gradient cosine must reach 0.99 on its own; where rounding only the weights and inputs to 16 bit
already breaks FP32's gradient, the cosine says nothing and only the other checks hold.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import helpers
import torch
from helpers import OpRecorder, cosine, recording_backend

from amp_compiler import AmpBackend
from amp_compiler.policy import LOW_DTYPES

aten = torch.ops.aten
LOW_EXEC = (*helpers.LOW_EXEC, aten._grouped_mm)  # MoE experts too


def _loss(out) -> torch.Tensor:
    return out["loss"] if isinstance(out, dict) or hasattr(out, "keys") else out.loss


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _flat(g: dict, names) -> torch.Tensor:
    return torch.cat([g[n].flatten().double() for n in names]) if names else torch.zeros(1)


@dataclass
class Step:
    loss_fp32: float
    loss_autocast: float
    loss_amp: float
    grads_fp32: dict = field(repr=False)
    grads_autocast: dict = field(repr=False)
    grads_amp: dict = field(repr=False)
    graphs_plain: int = 0
    graphs_amp: int = 0
    low_matmuls: int = 0  # matmuls/convs executed in 16 bit; -1: not recorded
    backend: AmpBackend | None = field(default=None, repr=False)
    autocast_error: str | None = None  # eager torch.autocast raised: no cosine to compare with
    # Measured when amp's cosine is below autocast's: FP32's gradient cosine to FP32's with only
    # the parameters and inputs rounded to the 16-bit dtype. Under 0.99 the model is
    # ill-conditioned at that precision at this init (random-init MobileNetV2 with BatchNorm over
    # 2 values per channel: 0.05) and every 16-bit cosine is noise.
    cos_rounded: float | None = None

    @property
    def ill_conditioned(self) -> bool:
        return self.cos_rounded is not None and self.cos_rounded < 0.99

    @property
    def cos_amp(self) -> float:
        names = sorted(self.grads_fp32)
        return cosine(_flat(self.grads_amp, names), _flat(self.grads_fp32, names))

    @property
    def cos_autocast(self) -> float:
        if self.autocast_error:
            return math.nan
        names = sorted(self.grads_fp32)
        return cosine(_flat(self.grads_autocast, names), _flat(self.grads_fp32, names))

    def cosine_below_autocast(self, slack: float = 0.01) -> bool:
        if self.autocast_error:  # nothing to compare with: an absolute floor instead
            return self.cos_amp < 0.99
        return self.cos_amp < self.cos_autocast - slack

    def problems(self, slack: float = 0.01) -> list[str]:
        """Every way the amp step is not the FP32 program, in words (empty: faithful)."""
        out = []
        if set(self.grads_amp) != set(self.grads_fp32):
            out.append(
                f"parameters with gradients differ: missing "
                f"{sorted(set(self.grads_fp32) - set(self.grads_amp))[:5]}, extra "
                f"{sorted(set(self.grads_amp) - set(self.grads_fp32))[:5]}"
            )
        if math.isfinite(self.loss_fp32) and not math.isfinite(self.loss_amp):
            out.append(f"loss {self.loss_amp} where FP32 gives {self.loss_fp32}")
        bad = [
            n
            for n, g in self.grads_amp.items()
            if n in self.grads_fp32 and torch.isfinite(self.grads_fp32[n]).all() and not torch.isfinite(g).all()
        ]
        if bad:
            out.append(f"non-finite gradients where FP32's are finite: {bad[:5]}")
        if not out and self.cosine_below_autocast(slack) and not self.ill_conditioned:
            against = (
                f"0.99 (torch.autocast failed: {self.autocast_error})"
                if self.autocast_error
                else f"autocast's {self.cos_autocast:.4f} - {slack}"
            )
            out.append(f"gradient cosine {self.cos_amp:.4f} < {against}")
        if self.graphs_amp > self.graphs_plain:
            out.append(f"{self.graphs_amp} graphs compiled, plain torch.compile needs {self.graphs_plain}")
        if self.low_matmuls == 0:  # -1: not recorded
            out.append("no matmul/conv executed in 16 bit")
        return out


def _no_dropout(model: torch.nn.Module) -> None:
    """Zero every dropout probability: compiled code draws its masks from the RNG in another
    order than eager, so with dropout on, the runs would differ by their masks, not by
    precision (random-init MobileViT: gradient cosine 0.985 with hidden dropout 0.1)."""
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            m.p = 0.0
        for name, value in vars(m).items():
            if "dropout" in name and isinstance(value, float):
                setattr(m, name, 0.0)


def one_step(build, dtype: str = "bf16", options: dict | None = None, inner=None) -> Step:
    """Run ``build() -> (model, inputs)`` one step FP32 / autocast / amp; compare.

    ``inner``: the amp backend's inner compiler (default: a recording aot_eager, which also
    counts the matmuls executed in 16 bit; with another one that count is not taken)."""
    torch.manual_seed(0)
    model, inputs = build()
    _no_dropout(model)
    model.train()
    ref, auto, plain = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    pristine = copy.deepcopy(model)
    low = LOW_DTYPES[dtype]

    torch.manual_seed(1)
    loss_ref = _loss(ref(**inputs))
    loss_ref.backward()
    loss_auto, autocast_error = _autocast_step(auto, inputs, low)

    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.manual_seed(1)
    _loss(torch.compile(plain, backend=count)(**inputs))

    torch._dynamo.reset()
    rec = OpRecorder()
    backend = AmpBackend(dtype=dtype, inner=inner or recording_backend(rec), **(options or {}))
    torch.manual_seed(1)
    loss = _loss(torch.compile(model, backend=backend)(**inputs))
    loss.backward()
    low_calls = len([d for d in rec.dtypes_of(*LOW_EXEC) if d[:2] == [low, low]]) if inner is None else -1
    step = Step(
        loss_ref.item(),
        loss_auto.item(),
        loss.item(),
        _grads(ref),
        _grads(auto),
        _grads(model),
        len(graphs),
        backend.compiled,
        low_calls,
        backend,
        autocast_error,
    )
    if step.cosine_below_autocast():
        step.cos_rounded = _rounded_cosine(pristine, inputs, low, step.grads_fp32)
    return step


def _rounded_cosine(model, inputs: dict, low: torch.dtype, grads_fp32: dict) -> float:
    """Gradient cosine to FP32's of an FP32 step whose parameters and inputs were rounded to
    ``low``: the error no 16-bit computation can avoid."""

    def rounded(t):
        return t.to(low).float() if torch.is_tensor(t) and t.dtype == torch.float32 else t

    with torch.no_grad():
        for p in model.parameters():
            p.copy_(rounded(p))
    torch.manual_seed(1)
    _loss(model(**{k: rounded(v) for k, v in inputs.items()})).backward()
    return _cosine_to(_grads(model), grads_fp32)


def _autocast_step(model, inputs: dict, low: torch.dtype) -> tuple[torch.Tensor, str | None]:
    """Eager torch.autocast's forward and backward: (loss, None), or (NaN, the error) where the
    model does not run under it."""
    try:
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=low):
            loss = _loss(model(**inputs))
        loss.float().backward()
    except Exception as e:  # noqa: BLE001 - the model does not run under eager autocast
        return torch.tensor(math.nan), f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return loss, None


def _cosine_to(grads: dict, grads_fp32: dict) -> float:
    names = sorted(set(grads) & set(grads_fp32))
    return cosine(_flat(grads, names), _flat(grads_fp32, names))


@dataclass
class Update:
    """One optimizer step through ``make_train_step`` against one FP32 eager step."""

    cos: float  # cosine between the two parameter updates
    must_move: set = field(repr=False)  # FP32 moves them clearly
    may_move: set = field(repr=False)  # FP32 moves them at all
    moved: set = field(repr=False)  # amp moved them
    skipped: bool = False
    low_nodes: int = 0  # LOW nodes in the step's plan
    cos_rounded: float | None = None
    # below 0.99: eager torch.autocast's cosine (SGD's first step is the clipped gradient, so
    # its update's direction is its gradient's); random-init MobileViT: amp 0.87, autocast 0.60
    cos_autocast: float | None = None

    def problems(self) -> list[str]:
        out = []
        if self.skipped:
            out.append("the step was skipped (Inf/NaN) where FP32's is finite")
        if self.must_move - self.moved:
            out.append(f"parameters FP32 updates, amp does not: {sorted(self.must_move - self.moved)[:5]}")
        if self.moved - self.may_move:
            out.append(f"parameters amp updates, FP32 leaves in place: {sorted(self.moved - self.may_move)[:5]}")
        ill = self.cos_rounded is not None and self.cos_rounded < 0.99
        below_autocast = self.cos_autocast is None or self.cos < self.cos_autocast - 0.01
        if self.cos < 0.99 and not ill and below_autocast:
            against = (
                "torch.autocast failed" if self.cos_autocast is None else f"< autocast's {self.cos_autocast:.4f} - 0.01"
            )
            out.append(f"update cosine {self.cos:.4f} < 0.99 ({against})")
        if self.low_nodes == 0:
            out.append("the plan has no LOW node")
        return out


def one_update(build, dtype: str = "bf16", **options) -> Update:
    """``build() -> (model, inputs)``: one SGD-with-momentum step clipped at norm 1.0, FP32 eager
    against ``make_train_step`` (Inductor, the fused update; ``options`` its own); compares the
    parameter updates (SGD's update is the clipped gradient, so rounding shows as it is; Adam's
    first step would be its sign)."""
    from amp_compiler import make_train_step

    torch.manual_seed(0)
    model, inputs = build()
    _no_dropout(model)
    model.train()
    ref, pristine = copy.deepcopy(model), copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def sgd(m):
        return torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9)

    opt = sgd(ref)
    torch.manual_seed(1)
    _loss(ref(**inputs)).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    opt.step()
    torch._dynamo.reset()
    step = make_train_step(model, sgd(model), _loss, dtype=dtype, max_grad_norm=1.0, **options)
    torch.manual_seed(1)
    result = step(inputs)

    def delta(m):
        return {n: (p.detach() - before[n]).flatten().double() for n, p in m.named_parameters()}

    d_ref, d_amp = delta(ref), delta(model)
    names = sorted(d_ref)
    cos = cosine(torch.cat([d_ref[n] for n in names]), torch.cat([d_amp[n] for n in names]))
    # Every parameter FP32 clearly moves, amp must move; none FP32 leaves exactly in place
    # (frozen, unused) may amp move. Between the two lies rounding noise: CLIP's first-layer
    # query and key biases, whose true gradient is zero, get ~1e-9 in FP32, 0 or more in BF16.
    clear = 1e-3 * max(d.abs().max().item() for d in d_ref.values() if d.numel())

    def moved(d, above=0.0):
        return {n for n in names if d[n].numel() and d[n].abs().max().item() > above}

    update = Update(
        cos,
        must_move=moved(d_ref, clear),
        may_move=moved(d_ref),
        moved=moved(d_amp),
        skipped=bool(result.skipped),
        low_nodes=step.backend.plan().summary()["nodes"].get("LOW", 0),
    )
    if update.cos < 0.99:
        low = LOW_DTYPES[dtype]
        # clipping scaled FP32's gradients as a whole: their direction is unchanged
        grads_fp32 = _grads(ref)
        update.cos_rounded = _rounded_cosine(copy.deepcopy(pristine), inputs, low, grads_fp32)
        if _autocast_step(pristine, inputs, low)[1] is None:
            update.cos_autocast = _cosine_to(_grads(pristine), grads_fp32)
    return update
