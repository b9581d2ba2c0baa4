"""The policy file: measured FP32 pins written down, reviewable, loaded by every entry point.

    {"format": "amp-policy", "version": 1, "dtype": "bf16", "budget": 0.01,
     "amp_compiler": "0.1.0", "torch": "2.13.0+cpu", "fingerprints": ["3f2a..."],
     "measured": {"error_before": 0.031, "error_after": 0.004, "batches": 4,
                  "fp32_flops_share": 0.08},
     "pins": [{"option": "fp32_modules", "pattern": "^h\\.1\\.attn$",
               "reason": "...", "error_before": 0.031, "error_after": 0.004}],
     "overrides": {"fp32_ops": ["aten.cumsum"]}}

``options={"policy_file": path}`` merges the pins and overrides into the options;
options given explicitly beside it win (per option name) and the plan says so. A
file whose graph fingerprints do not match the model warns once: it may still be
right after small code edits. A malformed file, an unknown format or version, or a
pin that is not a valid regex is a one-line error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, field

log = logging.getLogger("amp_compiler")

FORMAT, VERSION = "amp-policy", 1
PIN_OPTIONS = ("fp32_modules", "fp32_ops")


class PolicyFileError(ValueError):
    """A policy file that cannot be used."""


@dataclass(frozen=True)
class PolicyFile:
    path: str
    dtype: str | None
    pins: tuple[dict, ...]
    overrides: dict
    fingerprints: tuple[str, ...] = ()
    notes: dict = field(default_factory=dict)  # pattern -> what the file says about it

    @classmethod
    def load(cls, path: str) -> PolicyFile:
        where = f"policy file {path!r}"
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError:
            raise PolicyFileError(f"{where} not found") from None
        except json.JSONDecodeError as e:
            raise PolicyFileError(f"{where} is not valid JSON: {e.msg} at line {e.lineno}") from None
        except OSError as e:
            raise PolicyFileError(f"{where} cannot be read: {e.strerror}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise PolicyFileError(f'{where} is not an amp policy file (no "format": "{FORMAT}")')
        if data.get("version") != VERSION:
            raise PolicyFileError(
                f"{where} has format version {data.get('version')!r}; this "
                f"amp-compiler reads version {VERSION}: re-run amp-compiler calibrate"
            )
        pins = data.get("pins", [])
        if not isinstance(pins, list):
            raise PolicyFileError(f'{where}: "pins" must be a list')
        notes = {}
        for i, pin in enumerate(pins):
            if (
                not isinstance(pin, dict)
                or pin.get("option") not in PIN_OPTIONS
                or not isinstance(pin.get("pattern"), str)
            ):
                raise PolicyFileError(f'{where}: pin {i} needs "option" (one of {PIN_OPTIONS}) and a string "pattern"')
            if pin["option"] == "fp32_modules":
                try:
                    re.compile(pin["pattern"])
                except re.error as e:
                    raise PolicyFileError(
                        f"{where}: pin {i} pattern {pin['pattern']!r} is not a valid regex: {e}"
                    ) from None
            notes[pin["pattern"]] = _note(path, pin)
        overrides = data.get("overrides", {})
        if not isinstance(overrides, dict):
            raise PolicyFileError(f'{where}: "overrides" must be an object of backend options')
        prints = data.get("fingerprints", [])
        return cls(path, data.get("dtype"), tuple(pins), overrides, tuple(prints), notes)

    def options(self) -> dict:
        """Backend options this file stands for (pins merged into their option lists)."""
        return with_pins(self.overrides, ((p["option"], p["pattern"]) for p in self.pins))


def with_pins(options: dict, pins) -> dict:
    """``options`` with each ``(option, pattern)`` pin appended to that option's list."""
    out = dict(options)
    for option, pattern in pins:
        out[option] = tuple(out.get(option, ())) + (pattern,)
    return out


def _note(path: str, pin: dict) -> str:
    measured = ""
    if isinstance(pin.get("error_before"), (int, float)) and isinstance(pin.get("error_after"), (int, float)):
        measured = f"; measured output error {pin['error_before']:.2e} -> {pin['error_after']:.2e}"
    reason = f": {pin['reason']}" if pin.get("reason") else ""
    return f"policy file {os.path.basename(path)}{reason}{measured}"


def fingerprint(nodes) -> str:
    """Which graph this is, independent of precision: its ops and modules in order."""
    text = "\n".join(f"{n.op}|{n.module}" for n in nodes)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


_warned: set[tuple[str, str]] = set()


def check_fingerprint(policy: PolicyFile, graph_print: str) -> None:
    if not policy.fingerprints or graph_print in policy.fingerprints:
        return
    key = (policy.path, graph_print)
    if any(k[0] == policy.path for k in _warned):
        return
    _warned.add(key)
    log.warning(
        "amp: policy file %s was calibrated on another graph (fingerprint %s not among "
        "%s); its pins may still fit after small code edits: re-run calibrate to be sure",
        policy.path,
        graph_print,
        list(policy.fingerprints),
    )
