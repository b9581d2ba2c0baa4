"""The optimizer half of the training step, on the device, without host round trips.

``FusedUpdate`` computes the total gradient norm of the (still loss-scaled)
gradients, decides Inf/NaN on the device, folds unscaling and clipping into one
``grad_scale`` and runs PyTorch's fused multi-tensor kernels
(``torch._fused_adamw_``, ``_fused_adam_``, ``_fused_sgd_``), which unscale,
update the FP32 master parameters and the optimizer's state in one pass per
tensor, and leave everything untouched when ``found_inf`` is set. Nothing waits
for the host: the caller reads the outcome once, after the scale update, in its
single synchronisation. These kernels need no compilation (the first step costs
what the optimizer's own step costs) and beat both the optimizer's foreach
``step()`` and an Inductor-generated update (10.6 ms, norm included, against 30 ms
and 20 ms for a 14M-parameter AdamW step on 2 CPU cores; the generated one also
took 50 s to compile).

The state lives where the optimizer keeps it (``optimizer.state[p]``: ``step``,
``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``), so ``optimizer.state_dict()``,
checkpoints and the optimizer's own ``step()`` keep working. Any other optimizer,
or an option the update does not implement (amsgrad, SGD dampening, differentiable),
is refused by ``unsupported`` and the training step falls back to ``step()``.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from .upstream.torch_private import private

__all__ = ["FusedUpdate", "unsupported"]


def unsupported(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer`` cannot run as a fused update (None: it can)."""
    kind = type(optimizer)
    if kind not in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
        return f"{kind.__name__} has no fused update (Adam, AdamW and SGD do)"
    devices = set()
    for g in optimizer.param_groups:
        if g.get("differentiable"):
            return "differentiable=True"
        if kind is torch.optim.SGD and g["momentum"] and g["dampening"]:
            return "SGD with dampening"
        if kind is not torch.optim.SGD and g["amsgrad"]:
            return "amsgrad=True"
        if any(p.dtype != torch.float32 for p in g["params"]):
            return "parameters that are not FP32"
        if any(isinstance(p, DTensor) for p in g["params"]):
            return "sharded (DTensor) parameters: the optimizer's own step() handles them"
        devices |= {p.device for p in g["params"]}
    if len(devices) > 1:
        return f"parameters on several devices ({sorted(map(str, devices))})"
    if (
        devices
        and next(iter(devices)).type not in private("torch.utils._foreach_utils._get_fused_kernels_supported_devices")()
    ):
        return f"no fused optimizer kernels for {next(iter(devices)).type}"
    return None


class FusedUpdate:
    """``update(scale) -> (found_inf, grad_norm)`` as device tensors; see the module docstring."""

    def __init__(self, optimizer: torch.optim.Optimizer, max_grad_norm: float | None):
        why = unsupported(optimizer)
        if why:
            raise ValueError(f"no fused update for this optimizer: {why}")
        self.optimizer, self.max_grad_norm = optimizer, max_grad_norm
        self.sgd = isinstance(optimizer, torch.optim.SGD)

    @torch.no_grad()
    def __call__(self, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        groups = [(g, [p for p in g["params"] if p.grad is not None]) for g in self.optimizer.param_groups]
        groups = [(g, ps) for g, ps in groups if ps]
        if not groups:
            raise RuntimeError("no parameter has a gradient: was backward() called?")
        grads = [p.grad for _, ps in groups for p in ps]
        scale = scale.to(device=grads[0].device, dtype=torch.float32)
        total = torch.linalg.vector_norm(torch.stack(private("torch._foreach_norm")(grads))) / scale
        found = (~torch.isfinite(total)).float()  # the kernels skip when it reads 1.0
        grad_scale = scale  # what each gradient is divided by: the loss scale, and clipping
        if self.max_grad_norm is not None:
            grad_scale = scale / torch.clamp(self.max_grad_norm / (total + 1e-6), max=1.0)
        for group, params in groups:
            states = [self._state(p, group) for p in params]
            (self._sgd if self.sgd else self._adam)(group, params, states, grad_scale, found)
        return found.bool(), total

    @staticmethod
    def _adam(group, params, states, grad_scale, found) -> None:
        steps = [s["step"] for s in states]
        private("torch._foreach_add_")(steps, 1)
        adamw = group.get("decoupled_weight_decay")
        kernel = private("torch._fused_adamw_") if adamw else private("torch._fused_adam_")
        beta1, beta2 = group["betas"]
        kernel(
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            steps,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            amsgrad=False,
            maximize=group["maximize"],
            grad_scale=grad_scale,
            found_inf=found,
        )
        private("torch._foreach_sub_")(steps, [found] * len(steps))  # a skipped step does not count

    @staticmethod
    def _sgd(group, params, states, grad_scale, found) -> None:
        # a zero momentum buffer gives the first step's buf = grad, as step() does (no dampening)
        bufs = [s["momentum_buffer"] for s in states] if group["momentum"] else []
        private("torch._fused_sgd_")(
            params,
            [p.grad for p in params],
            bufs,
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            lr=group["lr"],
            dampening=0.0,
            nesterov=group["nesterov"],
            maximize=group["maximize"],
            is_first_step=False,
            grad_scale=grad_scale,
            found_inf=found,
        )

    def _state(self, p: torch.Tensor, group: dict) -> dict:
        state = self.optimizer.state[p]
        if not state:  # the optimizer's own lazy initialisation, done ahead
            if self.sgd:
                if group["momentum"]:
                    state["momentum_buffer"] = torch.zeros_like(p)
            else:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif self.sgd and group["momentum"] and state.get("momentum_buffer") is None:
            state["momentum_buffer"] = torch.zeros_like(p)
        elif not self.sgd and state["step"].device != p.device:
            # a state dict loaded into a non-fused optimizer keeps steps on the CPU
            state["step"] = state["step"].to(p.device)
        return state
