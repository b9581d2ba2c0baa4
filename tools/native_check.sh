#!/usr/bin/env bash
# Every speed figure of a CPU with native BF16, as one command (~60 min on 2 cores), each in
# bench/'s JSON format under $OUT (default bench/native-<date>-<cpu kind>/):
#   bash tools/native_check.sh
# Nothing else may run on the machine meanwhile (variants are interleaved, but a second
# torch process moves every figure). On a CPU that emulates BF16 it refuses: 16-bit times
# there say nothing about native speed (docs/performance.md).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
flags=$(grep -o 'avx512_bf16\|amx_bf16' /proc/cpuinfo 2>/dev/null | sort -u | tr '\n' ' ')
case "$flags" in
    *amx_bf16*) kind=amx ;;
    *avx512_bf16*) kind=avx512bf16 ;;
    *) echo "this CPU emulates BF16 (no avx512_bf16/amx_bf16): its 16-bit times are not native figures" >&2
       exit 2 ;;
esac
OUT=${OUT:-bench/native-$(date +%F)-$kind}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

source tools/steps.sh

echo "cpu flags: $flags" | tee "$OUT/steps.txt"
step bench 1500 "$PY" tools/bench.py --json "$OUT/bench.json"
step loss-head 900 "$PY" tools/bench.py --workloads lm-head-32k,lm-head-128k --dtype bf16 --json "$OUT/loss-head.json"
step hf 900 "$PY" tools/bench.py --workloads hf-gpt2,hf-llama,hf-qwen2 --json "$OUT/hf.json"
# amp's short-attention crossover was measured on AVX512-BF16 only: where it sits here
step attention 900 "$PY" tools/bench.py --workloads lm-sdpa,hf-llama,hf-gpt2 \
    --variants autocast-inductor,amp,amp-fused-attention --json "$OUT/attention.json"
step head-decoder 600 "$PY" tools/head_decoder.py --reps 7 --json "$OUT/head-decoder.json"
step head-decoder-returns-logits 600 "$PY" tools/head_decoder.py --reps 7 --returns-logits \
    --variants autocast-inductor,auto,fused,off --json "$OUT/head-decoder-returns-logits.json"
step head-decoder-reuse-memory 600 "$PY" tools/head_decoder.py --reps 7 --returns-logits --reuse-memory \
    --variants autocast-inductor,auto,fused,off --json "$OUT/head-decoder-reuse-memory.json"
# the one-pass head's row blocks: 4096 tokens in 4, 2 and 1 of them (amp takes 2048 on AMX, 1024 elsewhere)
step head-decoder-rows-1024 600 "$PY" tools/head_decoder.py --batch 4 --reps 7 --reuse-memory \
    --variants autocast-inductor,fused,off --ahead-rows 1024 --json "$OUT/head-decoder-rows-1024.json"
step head-decoder-rows-2048 600 "$PY" tools/head_decoder.py --batch 4 --reps 7 --reuse-memory \
    --variants autocast-inductor,fused,off --ahead-rows 2048 --json "$OUT/head-decoder-rows-2048.json"
step head-decoder-rows-4096 600 "$PY" tools/head_decoder.py --batch 4 --reps 7 --reuse-memory \
    --variants autocast-inductor,fused,off --ahead-rows 4096 --json "$OUT/head-decoder-rows-4096.json"
# the exact head as its timing chooses, against split BF16 products through oneDNN and FP32
# GEMMs (AMX; the JSON's machine.split_timings: what the timing found)
step head-decoder-exact 600 "$PY" tools/head_decoder.py --reps 7 --reuse-memory \
    --variants autocast-inductor,auto,exact,exact-split,exact-fp32 --json "$OUT/head-decoder-exact.json"
step trl-sft 900 "$PY" tools/trl_bench.py
# a restarted job's first step from warm caches, amp against Inductor + autocast (<= 1.0x wanted)
step restart-12l 1500 "$PY" tools/restart_bench.py --layers 12 --d 768 --warm-runs 5 --json "$OUT/restart-12l.json"
grep -h "TRL SFT" "$OUT/trl-sft.log" | tee -a "$OUT/steps.txt"
echo "figures in $OUT; render a table with: $PY tools/bench.py --table $OUT/bench.json"
