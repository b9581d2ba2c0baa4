"""``torch.ops.aten`` as the op tables read it: a name the running torch lacks is recorded, not fatal.

Torch removes ops between releases (``aten.cholesky`` in 2.14); a table that names one must
still import. The tables write ``aten.<name>`` as before and pass each group through
``present``, which drops the absent ones; ``ABSENT`` says which, for ``amp-compiler env``
and the table tests, which fail when an op the plan rests on (``ESSENTIAL``) is missing.
"""

from __future__ import annotations

import torch


class Absent:
    """An op name the running torch does not define: matches no node."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"aten.{self.name} (absent from torch {torch.__version__})"


ABSENT: set[str] = set()


class _Namespace:
    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return getattr(torch.ops.aten, name)
        except (AttributeError, RuntimeError):
            ABSENT.add(name)
            return Absent(name)


aten = _Namespace()


def present(ops: set | frozenset) -> frozenset:
    """The ops of a table group that the running torch defines."""
    return frozenset(op for op in ops if not isinstance(op, Absent))


# The ops the plan rests on: without one, a matmul, attention, softmax, norm or loss would
# fall out of its table and run as an unknown op. Their absence is a failure, not a note.
ESSENTIAL = (
    "mm",
    "bmm",
    "addmm",
    "baddbmm",
    "matmul",
    "linear",
    "convolution",
    "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "softmax",
    "_softmax",
    "log_softmax",
    "_log_softmax",
    "layer_norm",
    "native_layer_norm",
    "group_norm",
    "native_batch_norm",
    "_native_batch_norm_legit_functional",
    "rms_norm",
    "sum",
    "mean",
    "exp",
    "log",
    "pow",
    "cross_entropy_loss",
    "nll_loss",
    "nll_loss_forward",
    "mse_loss",
    "binary_cross_entropy_with_logits",
    "add",
    "mul",
    "_to_copy",
)
