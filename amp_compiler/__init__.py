"""amp-compiler: automatic mixed precision as a torch.compile backend.

torch.compile(model, backend="amp")                      # BF16 where native, else FP32
torch.compile(model, backend="amp", options={"dtype": "fp16"})
amp_compiler.explain(model, x).format_table()            # what runs in what, and why
"""

from .backend import AmpBackend, CompileRecord, amp
from .calibrate import Calibration, calibrate
from .cpu_memory import MemoryReuse, reuse_freed_memory
from .distributed import PrecisionMismatchError
from .ds_config import AmpConfig, AmpConfigError
from .explain import explain
from .monitor import AlertEvent, NonFiniteMonitor
from .onnx_export import ExportError, ExportReport, compile_openvino, export_decoder, export_onnx
from .options import AmpOptions, AmpOptionsError
from .passes import AmpVerifyError
from .plan import GraphPlan, NodePlan, PrecisionPlan
from .policy import AmpPolicyError, Policy, Precision
from .scaler import LossScaler
from .train import MasterWeightsError, StepResult, TrainStep, make_train_step
from .version import __version__ as __version__

__all__ = [
    "AlertEvent",
    "AmpBackend",
    "AmpConfig",
    "AmpConfigError",
    "Calibration",
    "calibrate",
    "ExportError",
    "ExportReport",
    "export_onnx",
    "export_decoder",
    "compile_openvino",
    "AmpOptions",
    "AmpOptionsError",
    "AmpPolicyError",
    "AmpVerifyError",
    "CompileRecord",
    "GraphPlan",
    "LossScaler",
    "MasterWeightsError",
    "MemoryReuse",
    "NodePlan",
    "NonFiniteMonitor",
    "Policy",
    "PrecisionMismatchError",
    "Precision",
    "PrecisionPlan",
    "StepResult",
    "TrainStep",
    "amp",
    "explain",
    "make_train_step",
    "reuse_freed_memory",
]
