"""All ranks of a distributed job run one precision plan.

Mixed dtypes across ranks (BF16 on one card, FP16 on another) make gradient
all-reduce combine incompatible numbers and training diverges; the design note
says to configure precision once, globally. Two checks, used by
``make_train_step`` whenever ``torch.distributed`` is initialised:

- ``agree_on_dtype``: with ``dtype="auto"`` every rank probes its own device;
  if any rank lacks BF16, all ranks fall back to FP16 together (to FP32 if any
  rank has no fast 16 bit at all). An explicit
  dtype that differs between ranks is an error.
- ``agree_on_memory``: the memory the loss head's automatic choice weighs, the smallest
  rank's, so that choice is the same everywhere.
- ``check_same_settings``: the options every rank was given (its pins, tables, loss head,
  scaler) are the same; one set on one rank only is an error naming it.
- ``check_same_plan``: after the first compile, the plans' fingerprints (every
  node's op and precision) are compared; a difference names the ranks.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from .device import memory_bytes
from .plan import PrecisionPlan


class PrecisionMismatchError(RuntimeError):
    """Ranks of one job would train in different precisions."""


def _active(group=None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _gather(value, group=None) -> list:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def agree_on_dtype(choice: str, reason: str, requested: str, group=None) -> tuple[str, str]:
    """One dtype for every rank (see the module docstring); returns (choice, reason)."""
    if not _active(group):
        return choice, reason
    choices = _gather((choice, requested, reason), group)
    if requested != "auto":
        if len({c for c, _, _ in choices}) > 1:
            ranks = ", ".join(f"rank {i}: {c}" for i, (c, _, _) in enumerate(choices))
            raise PrecisionMismatchError(
                f"ranks were given different dtypes ({ranks}); every rank must train in one "
                "precision: pass the same dtype everywhere, or dtype='auto' to agree automatically"
            )
        return choice, reason
    # the weakest device decides: FP32 if any rank lacks fast 16 bit, else FP16 if any lacks BF16
    for weaker, lacks, then in (("fp32", "fast 16-bit", "FP32"), ("fp16", "BF16", "FP16 with loss scaling")):
        if any(c == weaker for c, _, _ in choices):
            first = next(i for i, (c, _, _) in enumerate(choices) if c == weaker)
            return weaker, (
                f"auto, agreed across {len(choices)} ranks: rank {first} has no {lacks} "
                f"({choices[first][2]}); every rank uses {then}"
            )
    return choice, f"{reason}; agreed across {len(choices)} ranks"


def agree_on_memory(device, given: int | None = None, group=None) -> int:
    """The memory ``loss_head="auto"`` weighs the logits against: ``given``, else the smallest
    of every rank's device memory, so every rank makes the same choice and runs one plan."""
    if given is not None:
        return given
    nbytes = memory_bytes(device)
    return min(_gather(nbytes, group)) if _active(group) else nbytes


def any_rank(flag):
    """``flag`` (a tensor, nonzero = true) made true on every rank if it is on any."""
    if _active():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag


def check_same_settings(settings: dict[str, str], entry: str, group=None) -> None:
    """Raise PrecisionMismatchError, on every rank, naming each setting that differs between ranks."""
    if not _active(group):
        return
    every = _gather(settings, group)
    names = dict.fromkeys(k for s in every for k in s)  # rank 0's order, then any other rank's
    differ = [n for n in names if len({s.get(n) for s in every}) > 1]
    if differ:
        ranks = lambda n: ", ".join(f"rank {i}: {s.get(n, '(unset)')}" for i, s in enumerate(every))  # noqa: E731
        detail = "; ".join(f"{n}: {ranks(n)}" for n in differ)
        raise PrecisionMismatchError(
            f"{entry}: ranks were set up differently ({detail}); every rank must train under one "
            "precision plan: give every rank the same dtype, options, config and policy file"
        )


def plan_fingerprint(plan: PrecisionPlan) -> str:
    text = "\n".join(f"{n.graph}:{n.op}:{n.precision}:{n.dtype}" for n in plan.nodes)
    return hashlib.sha256(f"{plan.dtype}\n{text}".encode()).hexdigest()[:16]


def check_same_plan(plan: PrecisionPlan, group=None) -> str:
    """Raise PrecisionMismatchError unless every rank compiled the same plan; returns the fingerprint."""
    mine = plan_fingerprint(plan)
    if not _active(group):
        return mine
    prints = _gather((mine, plan.dtype, plan.summary()["nodes"]), group)
    if len({p for p, _, _ in prints}) > 1:
        detail = "; ".join(f"rank {i}: {d} {n} [{p}]" for i, (p, d, n) in enumerate(prints))
        raise PrecisionMismatchError(f"ranks compiled different precision plans: {detail}")
    return mine


class CommStats:
    """What a DDP comm hook handed the all-reduce (gradient buckets, this rank's share sent):
    bytes and dtypes of the tensors themselves, not of a width the hook was asked for."""

    def __init__(self, dtype: str):
        self.dtype, self.bytes, self.calls = dtype, 0, 0
        self.sent_dtypes: set[torch.dtype] = set()

    def __repr__(self) -> str:
        return f"CommStats(dtype={self.dtype!r}, bytes={self.bytes}, calls={self.calls})"

    def sent(self, tensor: torch.Tensor) -> None:
        self.bytes += tensor.numel() * tensor.element_size()
        self.calls += 1
        self.sent_dtypes.add(tensor.dtype)


COMM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def install_comm_hook(ddp_model, dtype: str) -> CommStats:
    """All-reduce a DDP model's gradients in ``dtype`` ("bf16", "fp16" or "fp32").

    As PyTorch's compress hooks do: each bucket is cast down and averaged across ranks, then
    cast back into the bucket, so the optimizer still updates the FP32 master weights with
    FP32 gradients; half the bytes cross the network. ``CommStats`` counts the tensors handed
    to the all-reduce. Inside a compiled backward (compiled autograd) PyTorch's own hook runs,
    uncounted.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"ddp_comm_dtype needs a DistributedDataParallel model, got {type(ddp_model).__name__}")
    if dtype not in COMM_DTYPES:
        raise ValueError(f"ddp_comm_dtype={dtype!r}: use one of {sorted(COMM_DTYPES)}")
    stats, wire = CommStats(dtype), COMM_DTYPES[dtype]
    traced = {
        "bf16": default_hooks.bf16_compress_hook,
        "fp16": default_hooks.fp16_compress_hook,
        "fp32": default_hooks.allreduce_hook,
    }[dtype]

    def hook(process_group, bucket):
        if torch.compiler.is_compiling():
            return traced(process_group, bucket)
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        sent = buffer.to(wire).div_(group.size())  # a copy unless FP32: the bucket itself
        stats.sent(sent)
        future = dist.all_reduce(sent, group=group, async_op=True).get_future()
        return future.then(lambda done: buffer.copy_(done.value()[0]))

    ddp_model.register_comm_hook(None, hook)
    return stats
