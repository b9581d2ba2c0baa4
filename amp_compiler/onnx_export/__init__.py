"""``export_onnx``: a BF16 inference graph for ONNX Runtime, from the same plan as training.

    torch.export (ATen, the tables' vocabulary) -> the amp pipeline (tag, casts, fold,
    verify) -> weights read only in 16 bit stored in 16 bit -> torch.onnx.export
    -> checks -> the file appears.

Everything is written into a temporary folder beside ``path`` and moved into place only
when export and checks succeeded, so a failure leaves nothing behind.

Modules: ``program`` (the planned torch.export program), ``export`` (writing and moving
into place), ``structure`` and ``parity`` (the checks), ``emulation`` (BF16 rounded
through Cast pairs, for ORT's CPU provider), ``coverage`` (ORT's kernels per provider),
``openvino`` (serving on OpenVINO Runtime, the executed precision per node), ``generation``
(decoders with their KV cache, served token by token), ``causal_lm`` (such a decoder driven
by transformers' ``generate()``).
"""

from .base import EXPORT_DTYPES, TARGETS, ExportError
from .emulation import emulate_low
from .export import ExportReport, export_onnx
from .generation import Decoder, DecoderReport, export_decoder
from .openvino import compile_openvino, native_bf16, run_openvino
from .parity import check_parity
from .structure import check_structure


def __getattr__(name: str):
    if name == "CausalLM":  # needs transformers, which the export alone does not
        from .causal_lm import CausalLM

        return CausalLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CausalLM",
    "Decoder",
    "DecoderReport",
    "EXPORT_DTYPES",
    "TARGETS",
    "ExportError",
    "ExportReport",
    "check_parity",
    "check_structure",
    "compile_openvino",
    "emulate_low",
    "export_decoder",
    "export_onnx",
    "native_bf16",
    "run_openvino",
]
