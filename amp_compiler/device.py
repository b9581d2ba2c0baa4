"""Which low dtype a device supports: the probe behind ``dtype="auto"``.

Tests replace ``bf16_support`` to exercise the FP16 fallback.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def bf16_support(device: torch.device) -> tuple[bool, str]:
    """(supported, reason) for BF16 compute on ``device``."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False, "CUDA is not available"
        major, minor = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return True, f"{name} (sm_{major}{minor}) has BF16 tensor cores"
        return False, f"{name} (sm_{major}{minor}) has no BF16 tensor cores (needs Ampere, sm_80+)"
    if device.type == "cpu":
        native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
        return True, ("CPU with native BF16 (oneDNN)" if native else
                      "CPU without native BF16: computed correctly, but slower than FP32")
    if device.type == "mps":
        return True, "Apple GPU supports BF16 (macOS 14+)"
    return False, f"no BF16 capability probe for device type {device.type!r}"


def resolve_dtype(requested: str, device: torch.device) -> tuple[str, str]:
    """Turn "bf16" / "fp16" / "auto" into a concrete choice and its reason."""
    if requested != "auto":
        return requested, f"dtype={requested!r} requested"
    ok, why = bf16_support(device)
    if ok:
        choice, reason = "bf16", f"auto: {why}"
    else:
        choice, reason = "fp16", f"auto: {why}; falling back to FP16 with dynamic loss scaling"
    log.info("amp dtype on %s: %s (%s)", device, choice, reason)
    return choice, reason


def device_of(example_inputs) -> torch.device:
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")
