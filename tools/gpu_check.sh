#!/usr/bin/env bash
# Every check that needs a GPU, as one command (< 8 min on one H100/H200), results in one JSON:
#   bash tools/gpu_check.sh            # writes $OUT/gpu-check.json (OUT defaults to /tmp/amp-gpu)
# The machine's own python3 (with CUDA torch) is used, nothing is downloaded: the package is
# installed editable without dependencies. onnxruntime-gpu is needed for the ONNX parity part;
# without it that part records why it was skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/amp-gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

source tools/steps.sh

: >"$OUT/steps.txt"
step install 120 "$PY" -m pip install --no-deps --no-build-isolation -e .
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/nvidia-smi.txt" 2>&1
step gpu-tests 120 "$PY" -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider
step bench-bf16 180 "$PY" tools/bench.py --device cuda --size gpt2-small --dtype bf16 \
    --workloads lm-sdpa --reps 3 --steps 5 --json "$OUT/bench-bf16.json" --plot "$OUT/bench-bf16.png"
step bench-fp16 90 "$PY" tools/bench.py --device cuda --size gpt2-small --dtype fp16 \
    --workloads lm-sdpa --variants fp32-eager,autocast-inductor,amp-step --reps 3 --steps 5 \
    --json "$OUT/bench-fp16.json"
step head-decoder 150 "$PY" tools/head_decoder.py --variants autocast-inductor,auto,fused,off --reps 5 \
    --json "$OUT/head-decoder.json"
if "$PY" -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())"; then
    step onnx-parity 60 "$PY" tools/onnx_cuda_parity.py --out "$OUT/onnx"
else
    echo "onnx-parity skipped: onnxruntime has no CUDAExecutionProvider (carry an onnxruntime-gpu wheel)" \
        | tee -a "$OUT/steps.txt"
fi

"$PY" - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
def read(name):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f) if name.endswith(".json") else f.read()[-4000:]
result = {"steps": read("steps.txt"), "gpu": read("nvidia-smi.txt"),
          "gpu_tests": read("gpu-tests.log"), "bench_bf16": read("bench-bf16.json"),
          "bench_fp16": read("bench-fp16.json"), "head_decoder": read("head-decoder.json"),
          "onnx_parity": read("onnx-parity.log")}
with open(os.path.join(out, "gpu-check.json"), "w") as f:
    json.dump(result, f, indent=1)
print("wrote", os.path.join(out, "gpu-check.json"))
EOF
