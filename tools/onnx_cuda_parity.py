"""Run the BF16 ONNX export's parity check on the real CUDA provider.

    pip install onnxruntime-gpu   # in an environment WITHOUT the onnxruntime (CPU) wheel
    python tools/onnx_cuda_parity.py [--out /tmp/amp_onnx]

On a machine with a GPU and onnxruntime-gpu it exports a few small models
(transformer with SDPA, Llama from a config, CNN with BatchNorm) for target="cuda"
and runs each graph on CUDAExecutionProvider with CPU fallback disabled, so a
missing BF16 kernel is an error, not a silent CPU run. Elsewhere it says so and
runs the CPU emulation instead. A few minutes at most.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from amp_compiler import export_onnx  # noqa: E402
from amp_compiler.demo import DemoLM  # noqa: E402
from amp_compiler.onnx_export.parity import ort_cuda  # noqa: E402


def models():
    ids = torch.randint(0, 64, (2, 32))
    yield "demo_lm_sdpa", DemoLM(vocab=64, d=128, seq=32), (ids, ids), {}
    try:
        import transformers

        cfg = transformers.LlamaConfig(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=64,
        )
        yield "llama", transformers.LlamaForCausalLM(cfg), (), {"input_ids": ids, "use_cache": False}
    except ImportError:
        print("transformers not installed: skipping llama")
    from conftest import ConvNet

    yield "cnn_batchnorm", ConvNet(), (torch.randn(4, 3, 32, 32),), {}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/amp_onnx")
    a = p.parse_args()
    import onnxruntime as ort

    os.makedirs(a.out, exist_ok=True)
    cuda = ort_cuda()
    print(
        f"onnxruntime {ort.__version__}, providers {ort.get_available_providers()}, "
        f"torch CUDA {torch.cuda.is_available()}: {'CUDA provider' if cuda else 'CPU emulation'}"
    )
    failures = 0
    for name, model, args, kwargs in models():
        torch.manual_seed(0)
        try:
            report = export_onnx(model, args, os.path.join(a.out, f"{name}.onnx"), kwargs=kwargs, target="cuda")
            print(f"{name}: OK  {report.parity}")
        except Exception as e:  # report every model, then fail
            failures += 1
            print(f"{name}: FAILED {type(e).__name__}: {e}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
