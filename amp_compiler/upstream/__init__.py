"""What amp reaches in other libraries beyond their public API, one module per upstream.

``aten`` resolves the op tables' names against the running torch, ``torch_private`` holds
every private torch name amp uses, ``patches`` every attribute amp replaces in another
library. Each entry is checked by a canary test (``tests/test_upstream.py``) that names it
when an upstream release renames or removes it, so a release that breaks us turns CI red
in one place instead of degrading a job.
"""

from __future__ import annotations

import functools
import logging

import torch

_log = logging.getLogger("amp_compiler")

# The oldest and newest torch minor releases CI runs (.ci/run: the floor with the core and
# integration tests, the newest with the full suite; 2.13 runs the main suite). The floor is
# pyproject.toml's; tests/test_layout.py holds the two and the README's table to each other.
TESTED_TORCH = ((2, 11), (2, 15))


def torch_minor(version: str = torch.__version__) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def tested_range() -> str:
    """The tested torch range as people write it: "2.11-2.15"."""
    (a, b), (c, d) = TESTED_TORCH
    return f"{a}.{b}-{c}.{d}"


def torch_range_said(version: str = torch.__version__) -> str | None:
    """None where ``version`` is in the tested range, else what to expect, in one line."""
    low, high = TESTED_TORCH
    if low <= torch_minor(version) <= high:
        return None
    tested = tested_range()
    if torch_minor(version) < low:
        return (
            f"torch {version} is older than amp-compiler's tested range ({tested}): private torch APIs it "
            f"relies on may be missing; upgrade torch (pip install 'torch>={low[0]}.{low[1]}')"
        )
    return (
        f"torch {version} is newer than amp-compiler's tested range ({tested}): if a compile fails or a "
        "plan looks wrong, report it with `amp-compiler env`'s output"
    )


@functools.cache
def warn_outside_tested_range() -> None:
    """Once per process, where the running torch is outside the tested range."""
    said = torch_range_said()
    if said:
        _log.warning(said)
