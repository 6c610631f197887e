#!/usr/bin/env bash
# One-GPU check of the builtin engine after the step-runner / tensor-parallel refactor (issue 13):
# the GPU engine tests, the 0.5B rollout against the committed numbers, and the 7B shape at TP 1
# with a sleep / wake round trip (generation time before and after).  Writes to $OUT.
set -uo pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi -L
timeout 260 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_engine_gpu.py 2>&1 | tee "$OUT/engine_gpu_tests.txt" | tail -4
timeout 120 python3 bench/rollout.py --batch 256 --shapes 128x256 --skip_hf --out "$OUT/rollout_05b.json" 2>&1 | grep '^{"batch' | cut -c1-400
timeout 200 python3 bench/rollout_tp.py --shape qwen2.5-7b --tp 1 --batch 256 --prompt 512 --new 512 --repeat 2 \
  --sleep_check --out "$OUT/rollout_tp1_7b.json" 2>&1 | grep -E '^\{|Error' | cut -c1-1200
