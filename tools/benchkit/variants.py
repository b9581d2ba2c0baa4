"""Variants: one model trained and run each way compared (FP32, autocast, amp)."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from amp_compiler import AmpBackend, make_train_step

VARIANTS = ("fp32-eager", "fp32-inductor", "autocast-eager", "autocast-inductor", "amp", "amp-step")
# run only when named: make_train_step under an explicit memory budget, which lets the
# partitioner recast the 16-bit weight copies in backward instead of saving them
# amp-fused-attention: the backend with every SDPA kept fused (attention="fused"), beside amp's
# default, which writes short ones out on CPU by a crossover measured on one CPU kind only
EXTRA_VARIANTS = ("amp-step-lowmem", "amp-step-unfused", "amp-step-fused", "amp-step-exact", "amp-fused-attention")
# make_train_step's loss_head option per variant (unfused: the head as written)
LOSS_HEAD = {"amp-step-unfused": "off", "amp-step-fused": "fused", "amp-step-exact": "exact"}
LOWMEM_BUDGET = 0.8
LOW_VARIANTS = ("autocast-eager", "autocast-inductor")
HEAD_VARIANTS = ("fp32-eager", "autocast-inductor", "amp-step-unfused", "amp-step-fused", "amp-step-exact")


class CastCounter:
    """Counts floating-point casts in every graph Inductor compiles (forward and backward,
    after decomposition) for the variant being compiled: a post-grad pass of Inductor's."""

    def __init__(self):
        self.current: Variant | None = None

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.current is not None:
            self.current.casts += sum(1 for n in graph.nodes if _is_float_cast(n))

    @contextlib.contextmanager
    def installed(self):
        # caches off: a cache hit skips the passes and would also hide the first-call cost
        with (
            torch._inductor.config.patch(post_grad_custom_post_pass=self, fx_graph_cache=False),
            torch._functorch.config.patch(enable_autograd_cache=False),
        ):
            yield


def _is_float_cast(node) -> bool:
    if node.op != "call_function" or node.target not in (
        torch.ops.prims.convert_element_type.default,
        torch.ops.aten._to_copy.default,
    ):
        return False
    src, out = node.args[0].meta.get("val"), node.meta.get("val")
    return (
        isinstance(src, torch.Tensor)
        and isinstance(out, torch.Tensor)
        and src.is_floating_point()
        and out.is_floating_point()
        and src.dtype != out.dtype
    )


@dataclass
class Variant:
    name: str
    model: nn.Module
    forward: object  # callable(inputs) -> logits
    step: object  # callable(inputs, targets) -> loss tensor
    low: bool  # runs under torch.autocast
    compiled: bool = False
    backend: AmpBackend | None = None
    train_step: object = None  # amp-step: the TrainStep
    loss: object = None  # callable(inputs, targets) -> loss, the way the step computes it
    casts: int = 0
    first: dict = field(default_factory=dict)  # loss and gradients of the first step
    result: dict = field(default_factory=dict)


# The allocator setting is process-wide: a run sets it for every variant (--reuse-memory),
# so amp's variants do not decide it for themselves midway through the run.
SAME_ALLOCATOR = {"reuse_cpu_memory": False}


def make_variant(name, base, loss_fn, dtype, device) -> Variant:
    model = copy.deepcopy(base)
    low = name in LOW_VARIANTS
    ac_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.bfloat16)
    autocast = (lambda: torch.autocast(device, dtype=ac_dtype)) if low else contextlib.nullcontext
    if name.startswith("amp-step"):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        options = dict(SAME_ALLOCATOR)
        if name == "amp-step-lowmem":
            options["memory_budget"] = LOWMEM_BUDGET
        if name in LOSS_HEAD:
            options["loss_head"] = LOSS_HEAD[name]
        ts = make_train_step(model, opt, loss_fn, dtype=dtype, compile_options=options)

        def train(x, y, grab=None):
            fused = ts.fused

            def update(scale):  # read the gradients the fused update receives
                grab["grads"] = [p.grad / scale for p in model.parameters()]
                return fused(scale)

            if grab is not None and fused is not None:
                ts.fused = update
            try:
                return ts(x, y).loss
            finally:
                ts.fused = fused

        return Variant(name, model, ts.compiled, train, False, True, ts.backend, ts, loss=ts.loss)
    backend = None
    if name in ("fp32-inductor", "autocast-inductor"):
        fwd = torch.compile(model)
    elif name in ("amp", "amp-fused-attention"):
        attention = {"attention": "fused"} if name == "amp-fused-attention" else {}
        backend = AmpBackend(dtype=dtype, **attention, **SAME_ALLOCATOR)
        fwd = torch.compile(model, backend=backend)
    else:
        fwd = model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler(device) if low and dtype == "fp16" else None

    def loss_of(x, y):
        with autocast():
            return loss_fn(fwd(x), y)

    def step(x, y, grab=None):
        loss = loss_of(x, y)
        opt.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        if grab is not None:
            grab["grads"] = [p.grad.clone() for p in model.parameters()]
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        return loss.detach()

    def forward(x):
        with autocast():
            return fwd(x)

    return Variant(name, model, forward, step, low, fwd is not model, backend, loss=loss_of)
