"""Load a model named on the command line: ``package.module:factory`` or ``file.py:factory``."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "long": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}
_INPUT = re.compile(r"^(\d+(?:x\d+)*)(?::(\w+))?(?::(-?\d+)-(-?\d+))?$")


class ModelSpecError(Exception):
    """A target or input spec the user must fix; the message says how."""


def load_factory(spec: str):
    if ":" not in spec:
        raise ModelSpecError(f"target {spec!r} must be 'package.module:factory' or 'path/to/file.py:factory'")
    where, _, name = spec.rpartition(":")
    if where.endswith(".py") or os.sep in where:
        if not os.path.isfile(where):
            raise ModelSpecError(f"no such file: {where!r}")
        mod_name = "_amp_target_" + re.sub(r"\W", "_", os.path.abspath(where))
        module_spec = importlib.util.spec_from_file_location(mod_name, where)
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, os.path.dirname(os.path.abspath(where)))
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            raise ModelSpecError(f"importing {where!r} failed: {type(e).__name__}: {e}") from None
        finally:
            sys.path.pop(0)
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:
            raise ModelSpecError(f"cannot import module {where!r}: {type(e).__name__}: {e}") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ModelSpecError(f"{where!r} has no callable {name!r}")
    return factory


def parse_input(spec: str) -> torch.Tensor:
    """'2x128:int64' -> random ints in [0, 10); '2x3x32x32' -> randn; ':lo-hi' sets the int range."""
    m = _INPUT.match(spec)
    if not m:
        raise ModelSpecError(f"--input {spec!r}: write SHAPE[:DTYPE[:LOW-HIGH]], e.g. 2x128:int64 or 4x3x32x32")
    shape = [int(s) for s in m.group(1).split("x")]
    dtype = _DTYPES.get(m.group(2) or "float32")
    if dtype is None:
        raise ModelSpecError(f"--input {spec!r}: unknown dtype {m.group(2)!r}; use one of {sorted(_DTYPES)}")
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype)
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    low, high = int(m.group(3) or 0), int(m.group(4) or 10)
    return torch.randint(low, high, shape, dtype=dtype)


def load_model(
    spec: str, inputs: list[str] | None = None, need_inputs: bool = True
) -> tuple[torch.nn.Module, tuple, dict]:
    """(model, args, kwargs) from a factory returning a model or (model, example_inputs);
    without ``need_inputs`` a model alone gives no args."""
    torch.manual_seed(0)
    factory = load_factory(spec)
    try:
        made = factory()
    except Exception as e:
        raise ModelSpecError(f"factory {spec!r} failed: {type(e).__name__}: {e}") from None
    model, example = (
        made if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module) else (made, None)
    )
    if not isinstance(model, torch.nn.Module):
        raise ModelSpecError(
            f"factory {spec!r} returned {type(model).__name__}, not an nn.Module (or a (model, example_inputs) pair)"
        )
    if inputs:
        example = tuple(parse_input(s) for s in inputs)
    if example is None and not need_inputs:
        return model, (), {}
    if example is None:
        raise ModelSpecError(
            f"factory {spec!r} returned no example inputs; give them with "
            "--input SHAPE[:DTYPE] (repeatable), e.g. --input 2x128:int64"
        )
    args, kwargs = _split(example)
    return model, args, kwargs


def _split(example: Any) -> tuple[tuple, dict]:
    if isinstance(example, dict):
        return (), dict(example)
    if isinstance(example, (tuple, list)):
        return tuple(example), {}
    return (example,), {}


def load_batches(spec: str, inputs: list[str] | None, n: int) -> tuple[torch.nn.Module, list]:
    """(model, n batches): the model from the first factory call; each batch from another
    call under its own seed (or freshly drawn from the ``--input`` specs)."""
    model, args, kwargs = load_model(spec, inputs)
    batches = [kwargs or args]
    factory = load_factory(spec)
    for i in range(1, n):
        torch.manual_seed(i)
        if inputs:
            batches.append(tuple(parse_input(s) for s in inputs))
            continue
        made = factory()
        example = made[1] if isinstance(made, tuple) and len(made) == 2 else None
        a, k = _split(example)
        batches.append(k or a)
    return model, batches
