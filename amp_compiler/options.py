"""Backend options: one dataclass, validated once, shared by torch.compile and the API."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .policy import Policy

DTYPES = ("bf16", "fp16", "fp32", "auto")
INNER_NAMES = ("inductor", "aot_eager", "eager")
ATTENTION = ("auto", "fused", "explicit")
LOSS_HEAD = ("auto", "fused", "exact", "off")
_DTYPE_ALIASES = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    torch.bfloat16: "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    torch.float16: "fp16",
    "fp32": "fp32",
    "float32": "fp32",
    torch.float32: "fp32",
    "auto": "auto",
}


class AmpOptionsError(ValueError):
    """A bad option name or value; the message lists what is valid."""


@dataclass(frozen=True)
class AmpOptions:
    """Everything the backend can be told.

    dtype: "auto" (default: BF16 where the device computes it natively, else FP32,
        so the one-line backend is never slower than plain ``torch.compile``; never
        FP16, which needs a loss scaler the backend cannot apply: ``make_train_step``
        picks FP16 with dynamic loss scaling where only FP16 is native), "bf16",
        "fp16" or "fp32" (graph handed on unchanged, the BF16 plan recorded only).
        The choice and its reason are recorded in the plan.
    inner: code generator that receives the rewritten graph: "inductor",
        "aot_eager", "eager", or a callable ``(gm, example_inputs) -> callable``.
    low_ops / fp32_ops / promote_ops / passthrough_ops: ATen ops forced into that
        table ("aten.mm" or torch.ops.aten.mm).
    remove_ops: ATen ops taken out of every table (they become unknown: FP32, or an
        error under ``strict``).
    fp32_modules: regexes; a node whose module path (e.g. "lm_head",
        "model.layers.0.mlp") matches one runs in FP32.
    strict: unknown ops raise instead of running in FP32.
    low_precision_outputs: return outputs in the low dtype instead of the
        dtype the FP32 model returns.
    memory_budget: PyTorch's partitioner activation memory budget, in (0, 1],
        for the Inductor inner compiler. 1.0 saves for backward what the
        speed-first partition saves; below it, cheap ops (casts, pointwise
        chains, residual adds) are recomputed in backward instead of saved.
        None (default): 0.8 in a 16-bit plan (23-29% fewer saved bytes at the same
        step time, interleaved, native-BF16 CPU: LMs, Llama, encoder, CNN) with the
        parameters' 16-bit copies saved, not recast in backward; 1.0 (Inductor's
        own) where the dtype is FP32 (the plan not applied). An explicit budget
        lets the partitioner recast the weight copies too (2 bytes per parameter
        fewer saved, one more pass over the weights per step). A graph with
        random ops (dropout) always gets 1.0: below it the partitioner may
        recompute dropout in backward with a new mask.
    attention: how ``scaled_dot_product_attention`` runs in a 16-bit plan. "auto"
        (default): on CPU a short one (batch x heads x queries x keys <= 3M) is
        written out as matmul -> FP32 softmax -> matmul, faster there than the
        fused kernel (measured on a native-BF16 CPU); others stay fused. "fused":
        every one stays fused. "explicit": every one with static shapes is
        written out, on any device (memory grows with the square of the
        sequence). Either way a trainable float mask on CPU is written out:
        the fused kernel cannot give its gradient.
    loss_head: the language-model loss head (vocabulary projection into
        cross-entropy, or log_softmax + gather of target log-probs). "fused": one op
        computes each token's log-sum-exp and target logit in blocks of tokens x
        vocabulary, the projection in the low dtype and the rest in FP32; the logits
        are never stored for backward (recomputed per block) nor made FP32 as a whole.
        "auto" (default): fused where the logits the head as written keeps for
        backward would take at least 1/8 of ``memory_bytes``, else as written (it is
        faster: fusing recomputes the projection in backward), the choice and its
        figures in the plan. "exact": fused with the projection in FP32 (log-probs
        within 1e-3 nats of FP64). "off": the head runs as written. A head that
        cannot be fused stays as written, with the reason in the plan; logits the
        graph also returns or uses elsewhere are kept as written, the loss reading
        their statistics in amp's op under "fused" (and under "auto" where the inner
        compiler would keep FP32 log-probs beside them: not Inductor).
    memory_bytes: the memory ``loss_head="auto"`` weighs the logits against. None
        (default): the device's total (a GPU's memory; on CPU the RAM, or the
        container's limit where smaller); ``make_train_step`` and ``AmpCallback`` in a
        distributed job set the smallest across ranks, so every rank makes the same choice.
    reuse_cpu_memory: keep freed CPU memory for reuse (``cpu_memory.reuse_freed_memory``,
        glibc's mmap and trim thresholds; process-wide). None (default): applied once a
        CPU training step (the one after the first update) has mapped 64 MiB or more
        afresh and the machine has room for the process's peak again, measured by the
        training loop (make_train_step, AmpCallback, the Lightning plugins) or, with the
        bare backend, between calls of its first training graph; ``memory_reuse`` on each
        says what was decided and why. True: applied at the first compile. False: never.
    dump_dir: write the graph after every pass to this directory.
    policy_file: a calibrated policy file (``amp_compiler.calibrate``, see
        docs/calibration.md): its pins and overrides join these options; options
        given explicitly beside it win, per name.
    """

    dtype: str = "auto"
    inner: str | Callable = "inductor"
    low_ops: tuple = ()
    fp32_ops: tuple = ()
    promote_ops: tuple = ()
    passthrough_ops: tuple = ()
    remove_ops: tuple = ()
    fp32_modules: tuple[str, ...] = ()
    strict: bool = False
    low_precision_outputs: bool = False
    memory_budget: float | None = None
    attention: str = "auto"
    loss_head: str = "auto"
    memory_bytes: int | None = None
    reuse_cpu_memory: bool | None = None
    dump_dir: str | None = None
    policy_file: str | None = None
    policy_cache: dict = field(default_factory=dict, compare=False, repr=False)
    # the loaded file and the option names given explicitly beside it
    policy_source: object = field(default=None, compare=False, repr=False)
    policy_overridden: tuple = field(default=(), compare=False, repr=False)
    # names the caller set (None: every field that differs from its default); ``replace``
    # carries only these, so a policy file given later still fills in the rest
    given: tuple | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        dtype = _DTYPE_ALIASES.get(self.dtype) if _hashable(self.dtype) else None
        if dtype is None:
            raise AmpOptionsError(f"dtype={self.dtype!r} is not valid; use one of {DTYPES}")
        object.__setattr__(self, "dtype", dtype)
        if isinstance(self.inner, str):
            if self.inner not in INNER_NAMES:
                if self.inner not in torch.compiler.list_backends(exclude_tags=()):
                    raise AmpOptionsError(
                        f"inner={self.inner!r} is not a torch.compile backend; use one of "
                        f"{INNER_NAMES}, another registered backend name, or a callable "
                        "(gm, example_inputs) -> callable"
                    )
        elif not callable(self.inner):
            raise AmpOptionsError(f"inner={self.inner!r} must be a backend name {INNER_NAMES} or a callable")
        for name in ("low_ops", "fp32_ops", "promote_ops", "passthrough_ops", "remove_ops", "fp32_modules"):
            value = getattr(self, name)
            if isinstance(value, str) or not _iterable(value):
                value = (value,)
            object.__setattr__(self, name, tuple(value))
        for pattern in self.fp32_modules:
            if not isinstance(pattern, str):
                raise AmpOptionsError(f"fp32_modules entries are regex strings, got {pattern!r}")
            try:
                re.compile(pattern)
            except re.error as e:
                raise AmpOptionsError(f"fp32_modules pattern {pattern!r} is not a regex: {e}") from None
        for name in ("strict", "low_precision_outputs"):
            if not isinstance(getattr(self, name), bool):
                raise AmpOptionsError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.reuse_cpu_memory is not None and not isinstance(self.reuse_cpu_memory, bool):
            raise AmpOptionsError(
                f"reuse_cpu_memory must be True, False or None (decide by a measured step), "
                f"got {self.reuse_cpu_memory!r}"
            )
        budget = self.memory_budget
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= 1:
                raise AmpOptionsError(
                    f"memory_budget must be a number in (0, 1] (1.0: save what "
                    f"the fastest partition saves) or None, got {budget!r}"
                )
            object.__setattr__(self, "memory_budget", float(budget))
        if self.attention not in ATTENTION:
            raise AmpOptionsError(
                f"attention={self.attention!r} is not valid; use one of {ATTENTION} "
                "(auto: written out where measured faster)"
            )
        if self.loss_head not in LOSS_HEAD:
            raise AmpOptionsError(
                f"loss_head={self.loss_head!r} is not valid; use one of {LOSS_HEAD} "
                "(auto: fused where the logits would take 1/8 of the memory; fused: chunked 16-bit projection, "
                "FP32 log-sum-exp; exact: FP32 projection; off: as written)"
            )
        mem = self.memory_bytes
        if mem is not None and (isinstance(mem, bool) or not isinstance(mem, int) or mem <= 0):
            raise AmpOptionsError(f"memory_bytes must be a positive int (bytes) or None, got {mem!r}")
        if self.dump_dir is not None and not isinstance(self.dump_dir, str):
            object.__setattr__(self, "dump_dir", str(self.dump_dir))
        try:  # fail now, not at the first compile
            self.policy(torch.bfloat16)
            self.policy(torch.float16)
        except (ValueError, TypeError) as e:
            raise AmpOptionsError(str(e)) from None

    def __getstate__(self) -> dict:
        # the policy cache holds torch ops, which do not pickle: a spawned process (Lightning's
        # ddp_spawn, torch.multiprocessing) rebuilds it on first use
        return {**self.__dict__, "policy_cache": {}}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def policy(self, low_dtype: torch.dtype) -> Policy:
        if low_dtype not in self.policy_cache:
            self.policy_cache[low_dtype] = Policy.build(
                low_dtype,
                low_ops=self.low_ops,
                fp32_ops=self.fp32_ops,
                promote_ops=self.promote_ops,
                passthrough_ops=self.passthrough_ops,
                remove_ops=self.remove_ops,
            )
        return self.policy_cache[low_dtype]

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.name not in _HIDDEN]

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | None = None, **kwargs: Any) -> AmpOptions:
        """Build from torch.compile's ``options={...}`` (and/or keywords)."""
        return cls._build({**(options or {}), **kwargs})

    @classmethod
    def _build(cls, merged: dict, source: object = None) -> AmpOptions:
        unknown = sorted(set(merged) - set(cls.names()))
        if unknown:
            raise AmpOptionsError(f"unknown option(s) {unknown}; valid options are {cls.names()}")
        extra = {"given": tuple(sorted(merged))}
        if merged.get("policy_file") is not None:
            extra.update(_with_policy_file(merged, source))
        return cls(**merged, **extra)

    def explicit(self) -> dict[str, Any]:
        """The options the caller set, by name (a policy file's are not among them)."""
        if self.given is not None:
            return {n: getattr(self, n) for n in self.given}
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in _HIDDEN and getattr(self, f.name) != _default(f)
        }

    def replace(self, **changes: Any) -> AmpOptions:
        """These options with ``changes`` on top. A policy file (kept or newly given) fills
        in what is set neither here nor in ``changes``."""
        merged = {**self.explicit(), **changes}
        same_file = "policy_file" not in changes or changes["policy_file"] == self.policy_file
        return self._build(merged, self.policy_source if same_file else None)


_HIDDEN = ("policy_cache", "policy_source", "policy_overridden", "given")


def _default(f: dataclasses.Field) -> object:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _with_policy_file(merged: dict, source: object = None) -> dict:
    """Fold a policy file into ``merged`` (in place): explicit options win, per name.
    ``source``: the file as already loaded (``replace`` keeping the same file)."""
    from .policy_file import PolicyFile, PolicyFileError

    path = merged["policy_file"]
    if not isinstance(path, (str, os.PathLike)):
        raise AmpOptionsError(f"policy_file must be a path, got {path!r}")
    try:
        policy = source if source is not None else PolicyFile.load(os.fspath(path))
    except PolicyFileError as e:
        raise AmpOptionsError(str(e)) from None
    overridden = []
    for name, value in policy.options().items():
        if name not in AmpOptions.names():
            raise AmpOptionsError(f"policy file {path!r}: unknown option {name!r} in overrides")
        if name not in merged:
            merged[name] = value
        elif _as_tuple(merged[name]) != _as_tuple(value):
            overridden.append(name)
    merged["policy_file"] = os.fspath(path)
    return {"policy_source": policy, "policy_overridden": tuple(overridden)}


def _as_tuple(value: object) -> object:
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _iterable(value: object) -> bool:
    try:
        iter(value)
    except TypeError:
        return False
    return True


def _hashable(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True
