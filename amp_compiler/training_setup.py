"""One setup behind every way of training with amp.

``make_train_step``, ``AmpCallback`` (Trainer, TRL), ``AmpPrecision`` (Lightning) and
``AmpFabricPrecision`` (Fabric) are adapters over ``TrainingSetup``: each says who it is,
where the model lives and what the user asked, and the setup does the rest the same way
for all of them:

- at construction (``resolve``): the config merged with the arguments, the options
  checked, the dtype resolved for this rank's device, the FP16 loss scaler;
- once the process group is up, at the same point on every rank (``start``): the FP32
  master-weight check, one dtype agreed by all ranks (``dtype="auto"`` falls back together;
  explicit dtypes that differ stop every rank), one memory for the loss head's choice, the
  same settings on every rank (an option set on one rank only stops them all, naming it),
  and the backend built once with what was decided;
- ``compile``: the model's forwards compiled with that backend (DDP's module, FSDP2's
  units, a plain module);
- before the first update (``check_plan``, ``check_coverage``): every rank compiled the
  same plan, and the model ran inside the compiled graphs.

Every check that compares ranks gathers from all of them before any raises, so every rank
stops together with the same message: none is left waiting in a collective.
"""

from __future__ import annotations

import logging
import weakref

import torch

from .backend import AmpBackend
from .coverage import MAX_UNCOMPILED_SHARE, check_share
from .cpu_memory import ReuseRule
from .device import resolve_dtype
from .distributed import agree_on_dtype, agree_on_memory, check_same_plan, check_same_settings
from .ds_config import AmpConfig, merge
from .options import AmpOptions
from .scaler import LossScaler

log = logging.getLogger("amp_compiler")

# options that say where output goes, not what runs: ranks may differ in them
PER_RANK_OPTIONS = frozenset({"dump_dir", "policy_file"})


class MasterWeightsError(TypeError, ValueError):
    """The model's parameters are not FP32, so there is no FP32 master copy."""


def check_master_weights(model: torch.nn.Module, entry: str) -> None:
    low = {p.dtype for p in model.parameters() if p.is_floating_point() and p.dtype != torch.float32}
    if low:
        names = [n for n, p in model.named_parameters() if p.dtype in low][:3]
        raise MasterWeightsError(
            f"{entry}: parameters are {sorted(str(d) for d in low)} (e.g. {names}); amp keeps FP32 master "
            "weights so that small updates are not lost to 16-bit rounding. Call model.float() (or load "
            "the model with torch_dtype=torch.float32) before building the optimizer and the train step; "
            "the backend casts to 16 bit on the fly."
        )


class TrainingSetup:
    """What one entry point decided (see the module docstring).

    ``entry``: the entry point's name, used in messages. ``dtype``, ``config``,
    ``options``, ``scaler``: as the user gave them to the entry point. ``requested_by``:
    where a dtype request came from when not from an argument (the Trainer's
    ``bf16=True``), said in the plan's reason.
    """

    def __init__(
        self,
        entry: str,
        *,
        dtype: str | None = None,
        config=None,
        options: dict | None = None,
        scaler: LossScaler | None = None,
        max_uncompiled_share: float = MAX_UNCOMPILED_SHARE,
        requested_by: str | None = None,
    ):
        self.entry = entry
        self.config = AmpConfig.load(config)
        options = dict(options or {})
        if "dtype" in options:
            raise ValueError(f"pass dtype to {entry} itself, not among its backend options")
        # checked now, where the user built the entry point, not at the first compile
        self.options = AmpOptions.from_mapping({**self.config.options, **options})
        self.requested = AmpOptions(dtype=merge(dtype, self.config.dtype, "dtype", "auto")).dtype
        self.requested_by = requested_by
        self.max_uncompiled_share = check_share(max_uncompiled_share)
        self._given_scaler = scaler
        self.device: torch.device | None = None
        self.dtype: str | None = None
        self.reason: str | None = None
        self.scaler: LossScaler | None = None  # FP16's; None under BF16 and FP32
        self.backend: AmpBackend | None = None  # built by start()
        self.plan_fingerprint: str | None = None  # set by check_plan(), equal on every rank
        self._compiled: weakref.WeakSet = weakref.WeakSet()
        self._coverage_checked = False

    def __getstate__(self) -> dict:
        # a spawned rank (Lightning's ddp_spawn) gets the setup, not this process's modules
        return {**self.__dict__, "_compiled": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _compiled=weakref.WeakSet())

    def __repr__(self) -> str:
        return f"TrainingSetup({self.entry}, dtype={self.dtype!r}, started={self.backend is not None})"

    # -- this rank alone

    def request(self, dtype: str, by: str) -> None:
        """A dtype asked for by the framework around the entry point (the Trainer's
        ``bf16=True``), before anything is resolved."""
        if self.dtype is not None:
            raise RuntimeError(f"{self.entry}: the dtype was already resolved ({self.dtype})")
        self.requested, self.requested_by = AmpOptions(dtype=dtype).dtype, by

    def resolve(self, device: torch.device | str) -> TrainingSetup:
        """The dtype this rank's device runs, and FP16's scaler (once; ``start`` has ranks agree)."""
        if self.dtype is None:
            self.device = torch.device(device)
            dtype, reason = resolve_dtype(self.requested, self.device)
            self._decide(dtype, f"{self.requested_by}; {reason}" if self.requested_by else reason)
        return self

    def _decide(self, dtype: str, reason: str) -> None:
        if dtype != self.dtype:
            given = self._given_scaler
            if given is not None and given.is_enabled() and dtype == "bf16":
                raise ValueError("BF16 needs no loss scaling: pass no scaler, or LossScaler(..., dtype='bf16')")
            if given is not None and not given.is_enabled() and dtype == "fp16":
                log.warning("amp: FP16 without loss scaling; small gradients will underflow to zero")
            if given is not None and given.is_enabled() and dtype == "fp32":
                log.info("amp: training in FP32 (%s); the loss scaler given is kept but not needed", reason)
            self.scaler = given
            if dtype == "fp16" and given is None:
                # a config's fp16 section describes the scaler (it also fixed the dtype to fp16)
                self.scaler = self.config.scaler(self.device.type) or LossScaler(self.device.type)
        self.dtype, self.reason = dtype, reason

    # -- every rank, together

    def start(self, model: torch.nn.Module, device: torch.device | str | None = None) -> TrainingSetup:
        """Check the model's master weights, agree with every rank, build the backend (once).
        Call it on every rank at the same point, with the process group up."""
        if self.backend is not None:
            return self
        check_master_weights(model, self.entry)
        if device is not None or self.dtype is None:
            self.resolve(device if device is not None else _device_of(model))
        self._decide(*agree_on_dtype(self.dtype, self.reason, self.requested))
        memory = agree_on_memory(self.device, self.options.memory_bytes)
        self.options = self.options.replace(dtype=self.dtype, memory_bytes=memory)
        check_same_settings(self.settings(), self.entry)
        self.backend = AmpBackend(self.options, decided=(self.dtype, self.reason), owned=True)
        log.info("amp: %s trains in %s (%s)", self.entry, self.dtype, self.reason)
        return self

    def settings(self) -> dict[str, str]:
        """What must be the same on every rank for them to run one plan, by name."""
        out = {"dtype": self.dtype, "dtype requested": self.requested}
        for name in AmpOptions.names():
            if name in PER_RANK_OPTIONS or name == "dtype":
                continue
            value = getattr(self.options, name)
            if callable(value):  # an inner backend: each rank holds its own object; say what it is
                named = value if hasattr(value, "__qualname__") else type(value)
                value = f"{named.__module__}.{named.__qualname__}"
            out[name] = repr(value)
        if self.options.policy_source is not None:
            out["policy file fingerprints"] = repr(self.options.policy_source.fingerprints)
        if self.scaler is not None and self.scaler.is_enabled():
            state = self.scaler.state_dict()
            out["loss scaler"] = repr({k: v for k, v in state.items() if not k.startswith("_")})
        return out

    def compile(self, model: torch.nn.Module, *, whole: bool = False, children: bool = False):
        """Compile ``model``'s forwards with the backend; returns what to call.

        Under DDP the module inside is compiled (DDP hides it from Dynamo: compiled whole it
        would run as written, in FP32) and DDP's bucketed all-reduce stays around it; under
        FSDP2 each innermost unit and the outer units' own layers (a compiled unit holding
        other units would graph-break at each child's hooks). A plain module: ``whole`` returns
        ``torch.compile(model)`` (a caller that compiles its loss with it inlines the module);
        otherwise its ``forward`` is replaced, and with ``children`` each direct child's that
        holds trainable parameters (a Lightning step that calls ``self.encoder(x)``).
        """
        from torch.distributed.fsdp import FSDPModule
        from torch.nn.parallel import DistributedDataParallel

        backend = self._started()
        if isinstance(model, DistributedDataParallel):
            self._compile_forward(model.module)
            return model
        units = {name: m for name, m in model.named_modules() if isinstance(m, FSDPModule)}
        if units:
            outer = {n for n, m in units.items() if any(isinstance(c, FSDPModule) for c in m.modules() if c is not m)}
            leaves = [m for n, m in units.items() if n not in outer]
            # an outer unit's own layers (an LM's embedding, final norm and head: 10-30% of its
            # weights); what lies between them (residual glue, the loss) runs as written
            own = [m for name in sorted(outer) for m in _own_layers(units[name])]
            for m in (*leaves, *own):
                self._compile_forward(m)
            log.info(
                "amp: %s under FSDP2, %d innermost fully_shard unit(s) and %d layer(s) of outer units compiled",
                self.entry,
                len(leaves),
                len(own),
            )
            return model
        if whole:
            return torch.compile(model, backend=backend)
        for m in (model, *(_callable_children(model) if children else ())):
            self._compile_forward(m)
        return model

    def _compile_forward(self, module: torch.nn.Module) -> None:
        if module not in self._compiled:
            module.forward = self._started().compile(module.forward)
            self._compiled.add(module)

    def reuse_rule(self, at: int = 1) -> ReuseRule:
        """``reuse_cpu_memory`` for a loop that ticks it once a step (``at``: the steps of one update)."""
        return ReuseRule(self.options.reuse_cpu_memory, self.device.type == "cpu", at=at)

    # -- before the first update

    def check_plan(self) -> str:
        """Every rank compiled the same plan (``PrecisionMismatchError`` on every rank if not);
        returns its fingerprint. Call after the first forward, on every rank."""
        self.plan_fingerprint = check_same_plan(self._started().plan())
        return self.plan_fingerprint

    def check_coverage(self, model: torch.nn.Module) -> None:
        """Refuse (once, before the first update) a model too much of which ran outside the
        compiled graphs, as written in FP32."""
        if not self._coverage_checked:
            self._coverage_checked = True
            self._started().coverage.enforce(model, self.entry, self.max_uncompiled_share, self.dtype)

    def before_first_update(self, model: torch.nn.Module) -> None:
        """``check_plan`` and ``check_coverage``, once: for entry points that see the step
        only between backward and the update."""
        if self.plan_fingerprint is None:
            self.check_plan()
        self.check_coverage(model)

    def _started(self) -> AmpBackend:
        if self.backend is None:
            raise RuntimeError(f"{self.entry}: not set up yet: the model compiles when training starts")
        return self.backend


def _device_of(model: torch.nn.Module) -> torch.device:
    from .device import module_device

    return module_device(model)


def _layer(module: torch.nn.Module) -> bool:
    """Whether ``module`` has a forward of its own (not a container) and trainable parameters."""
    return type(module).forward is not torch.nn.Module.forward and any(p.requires_grad for p in module.parameters())


def _callable_children(module: torch.nn.Module) -> list[torch.nn.Module]:
    """Direct children that are layers (``_layer``)."""
    return [child for child in module.children() if _layer(child)]


def _own_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The largest submodules of an FSDP2 unit that are no unit, hold none and are layers
    (``_layer``): the unit's own layers."""
    from torch.distributed.fsdp import FSDPModule

    found = []
    for child in module.children():
        if isinstance(child, FSDPModule):
            continue
        if any(isinstance(m, FSDPModule) for m in child.modules()):
            found += _own_layers(child)
        elif _layer(child):
            found.append(child)
    return found
