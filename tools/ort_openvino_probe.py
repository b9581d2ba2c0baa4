"""Does ONNX Runtime's OpenVINO provider serve our BF16 export? Run in its own environment.

    python -m venv v && v/bin/pip install onnxruntime-openvino numpy
    amp-compiler export tests/fixtures/models.py:tiny -o m.onnx --target openvino --no-check
    v/bin/python tools/ort_openvino_probe.py m.onnx

``onnxruntime-openvino`` installs the module ``onnxruntime``, as ``onnxruntime`` does: never
both in one environment, so this script imports neither torch nor this package.

docs/openvino.md says the provider refuses a BF16 graph. Exit 0 when it still does (the
reason printed), 1 when it loads and runs the file: then the docs are stale and the
provider is a serving path to support.
"""

from __future__ import annotations

import json
import sys


def feeds_for(session) -> dict:
    import numpy as np

    types = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32}
    out = {}
    for i in session.get_inputs():
        shape = [d if isinstance(d, int) else 2 for d in i.shape]
        out[i.name] = np.ones(shape, dtype=types.get(i.type, np.float32))
    return out


def main(argv: list[str]) -> int:
    import onnxruntime as ort

    if len(argv) != 1:
        print(__doc__)
        return 2
    if "OpenVINOExecutionProvider" not in ort.get_available_providers():
        print(f"onnxruntime {ort.__version__} here has no OpenVINO provider: install onnxruntime-openvino")
        return 2
    hint = json.dumps({"CPU": {"INFERENCE_PRECISION_HINT": "f32"}})  # the plan's precision per node
    options = {"device_type": "CPU", "load_config": hint}
    try:
        session = ort.InferenceSession(argv[0], providers=[("OpenVINOExecutionProvider", options)])
        session.run(None, feeds_for(session))
    except Exception as e:  # ORT's own exception types
        print(f"onnxruntime-openvino {ort.__version__} refuses the BF16 export: {str(e).splitlines()[0]}")
        return 0
    print(
        f"onnxruntime-openvino {ort.__version__} loads and runs the BF16 export on "
        f"{session.get_providers()}: docs/openvino.md is stale; check its precision and support it"
    )
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
