"""Precision configured once: a DeepSpeed-style dict or JSON file.

    {"bf16": {"enabled": true}}
    {"fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 16,
              "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}}
    {"amp": {"fp32_modules": ["lm_head"], "fp32_ops": ["aten.cumsum"]}}   # our own section

The same file feeds ``make_train_step(config=...)``, ``AmpBackend(config=...)`` and the
Trainer callback, so every entry point of a job runs one plan. ``fp16.loss_scale`` > 0
is a static scale (overflowing steps are still skipped); 0 means dynamic. DeepSpeed's
``gradient_clipping`` and ``gradient_accumulation_steps`` are honoured by the training
step; its other top-level sections (optimizer, zero_optimization, ...) belong to
DeepSpeed and are left alone. Anything else is an error naming the key, as is a bad
value, both dtypes enabled, or a file that is missing or not JSON.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from .options import AmpOptions, AmpOptionsError

FP16_KEYS = {
    "enabled": bool,
    "loss_scale": (int, float),
    "initial_scale_power": int,
    "loss_scale_window": int,
    "hysteresis": int,
    "min_loss_scale": (int, float),
}
FP16_DEFAULTS = {
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1,
}
# DeepSpeed sections that are not about precision: accepted, not acted on.
DEEPSPEED_KEYS = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "optimizer",
    "scheduler",
    "zero_optimization",
    "steps_per_print",
    "wall_clock_breakdown",
    "dump_state",
    "activation_checkpointing",
    "flops_profiler",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comms_logger",
    "zero_allow_untested_optimizer",
    "communication_data_type",
    "prescale_gradients",
    "gradient_predivide_factor",
    "sparse_gradients",
    "data_types",
    "checkpoint",
    "aio",
    "compression_training",
    "elasticity",
    "autotuning",
    "amp_scaler",
}
HONOURED = {"gradient_clipping", "gradient_accumulation_steps"}


class AmpConfigError(AmpOptionsError):
    """A precision config that cannot be used; the message says what to change."""


@dataclass(frozen=True)
class AmpConfig:
    """What a config file says, checked. ``dtype`` None: the file does not choose one."""

    dtype: str | None = None
    fp16: dict = field(default_factory=dict)  # the scaler's settings, DeepSpeed's names
    options: dict = field(default_factory=dict)  # AmpOptions, from the "amp" section
    max_grad_norm: float | None = None
    grad_accum: int | None = None
    source: str = "dict"

    @classmethod
    def load(cls, config: AmpConfig | dict | str | os.PathLike | None) -> AmpConfig:
        if config is None:
            return cls()
        if isinstance(config, AmpConfig):
            return config
        source = "dict"
        if isinstance(config, (str, os.PathLike)):
            source = os.fspath(config)
            config = _read(source)
        if not isinstance(config, dict):
            raise AmpConfigError(f"config must be a dict or a JSON file path, got {type(config).__name__}")
        return _parse(config, source)

    def scaler(self, device: str):
        """The ``LossScaler`` the fp16 section describes (None: not FP16)."""
        if self.dtype != "fp16":
            return None
        from .scaler import LossScaler

        s = {**FP16_DEFAULTS, **self.fp16}
        if s["loss_scale"] > 0:  # static: the clamp holds it, overflowing steps still skip
            return LossScaler(
                device,
                init_scale=float(s["loss_scale"]),
                growth_interval=2**31 - 1,
                min_scale=float(s["loss_scale"]),
                max_scale=float(s["loss_scale"]),
            )
        return LossScaler(
            device,
            init_scale=2.0 ** s["initial_scale_power"],
            growth_interval=s["loss_scale_window"],
            hysteresis=s["hysteresis"],
            min_scale=float(s["min_loss_scale"]),
        )

    def describe(self) -> str:
        return f"config {self.source}" if self.source != "dict" else "config dict"


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        raise AmpConfigError(f"config file {path!r} not found") from None
    except OSError as e:
        raise AmpConfigError(f"config file {path!r} cannot be read: {e.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise AmpConfigError(
            f"config file {path!r} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}"
        ) from None


def _section(config: dict, name: str) -> dict | None:
    value = config.get(name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise AmpConfigError(f'config {name!r} must be an object like {{"enabled": true}}, got {value!r}')
    return value


def _parse(config: dict, source: str) -> AmpConfig:
    unknown = sorted(set(config) - {"bf16", "fp16", "amp"} - DEEPSPEED_KEYS - HONOURED)
    if unknown:
        raise AmpConfigError(
            f"config has unknown key(s) {unknown}; precision keys are 'bf16', "
            f"'fp16', 'amp', 'gradient_clipping', 'gradient_accumulation_steps'"
        )
    bf16, fp16 = _section(config, "bf16"), _section(config, "fp16")
    if bf16 is not None and set(bf16) - {"enabled"}:
        raise AmpConfigError(
            f"config 'bf16' has unknown key(s) {sorted(set(bf16) - {'enabled'})}; it takes only 'enabled'"
        )
    for name, section in (("bf16", bf16), ("fp16", fp16)):
        if section is not None and "enabled" in section and not isinstance(section["enabled"], bool):
            raise AmpConfigError(f"config '{name}.enabled' must be true or false, got {section['enabled']!r}")
    if fp16 is not None:
        bad = sorted(set(fp16) - set(FP16_KEYS))
        if bad:
            raise AmpConfigError(f"config 'fp16' has unknown key(s) {bad}; valid keys are {sorted(FP16_KEYS)}")
        _check_fp16(fp16)
    on = [n for n, s in (("bf16", bf16), ("fp16", fp16)) if s is not None and s.get("enabled", False)]
    if len(on) == 2:
        raise AmpConfigError("config enables both 'bf16' and 'fp16'; enable one of them")
    if on:
        dtype = on[0]
    elif bf16 is not None or fp16 is not None:
        dtype = "fp32"  # a precision section present and nothing enabled: FP32, as in DeepSpeed
    else:
        dtype = None
    options = dict(_section(config, "amp") or {})
    if "dtype" in options:
        raise AmpConfigError("config 'amp' takes no 'dtype': enable 'bf16' or 'fp16' instead")
    try:
        AmpOptions.from_mapping(options)
    except AmpOptionsError as e:
        raise AmpConfigError(f"config 'amp': {e}") from None
    clip = config.get("gradient_clipping")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0):
        raise AmpConfigError(f"config 'gradient_clipping' must be a number >= 0, got {clip!r}")
    accum = config.get("gradient_accumulation_steps")
    if accum is not None and (isinstance(accum, bool) or not isinstance(accum, int) or accum < 1):
        raise AmpConfigError(f"config 'gradient_accumulation_steps' must be an int >= 1, got {accum!r}")
    return AmpConfig(
        dtype,
        {k: v for k, v in (fp16 or {}).items() if k != "enabled"},
        options,
        float(clip) if clip else None,
        accum,
        source,
    )


def _check_fp16(fp16: dict) -> None:
    for key, kind in FP16_KEYS.items():
        if key not in fp16:
            continue
        value = fp16[key]
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
            raise AmpConfigError(f"config 'fp16.{key}' has the wrong type: {value!r}")
    rules = {
        "loss_scale": lambda v: v >= 0,
        "initial_scale_power": lambda v: 0 <= v <= 64,
        "loss_scale_window": lambda v: v >= 1,
        "hysteresis": lambda v: v >= 1,
        "min_loss_scale": lambda v: v > 0,
    }
    for key, ok in rules.items():
        if key in fp16 and not ok(fp16[key]):
            raise AmpConfigError(f"config 'fp16.{key}' = {fp16[key]!r} is out of range")


def merge(explicit: Any, from_config: Any, name: str, default: Any = None) -> Any:
    """An argument given both directly and by the config: they must agree."""
    if explicit is not None and from_config is not None and explicit != from_config:
        raise AmpConfigError(f"{name}={explicit!r} given, but the config says {from_config!r}; set it in one place")
    if explicit is not None:
        return explicit
    return from_config if from_config is not None else default
