#!/usr/bin/env bash
# Issue 17's training runs on a 4-GPU machine (bench/train_parallel.py under torchrun). Parts run in the order
# given, inside one deadline so a call fits the device tool's 10 minutes (DEADLINE_S, default 570 s from the
# start of this script, or DEADLINE_EPOCH); a run starts only with 60 s left and its timeout is cut to the time
# left (`all` runs every part):
#   bash bench/run_parallel_gpu.sh models       write the random 0.5B and 7B model directories to /tmp (cuda;
#                                               first, in a call of its own, on a fresh machine: ~3 min)
#   bash bench/run_parallel_gpu.sh tp           7B SFT throughput, FSDP 4 vs FSDP 2 x TP 2 (global batch 8 x 4096)
#   bash bench/run_parallel_gpu.sh long05       0.5B longest sequence that trains, ring 1, 2, 4
#   bash bench/run_parallel_gpu.sh long7_RING   7B longest sequence that trains with --ring_attn_size RING (1, 2, 4)
#   bash bench/run_parallel_gpu.sh ring32k      tokens/s at 32k tokens (one row) with ring 4, 0.5B and 7B
#   bash bench/run_parallel_gpu.sh all
# JSON under $OUT (default bench/results): train_parallel_<what>_<gpu>x<n>.json, logs next to them.
# A run with --ring_attn_size > 1 before context parallelism lands writes its JSON with "error" (not a crash).
# Each model load + run has a `timeout`: a longest-sequence run cut short keeps the lengths it measured.
set -uo pipefail
OUT=${OUT:-bench/results}
(($#)) || { echo "usage: run_parallel_gpu.sh PART... (models tp long05 long7_1 long7_2 long7_4 ring32k all)" >&2; exit 2; }
mkdir -p "$OUT"
DEADLINE_EPOCH=${DEADLINE_EPOCH:-$(($(date +%s) + ${DEADLINE_S:-570}))}
say() { echo "[parallel $(date +%H:%M:%S)] $*"; }
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 OMP_NUM_THREADS=8
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')
n=$(nvidia-smi -L | wc -l)
tag="${gpu}x${n}"
ATTN=${ATTN:-sdpa}
M05=/tmp/bench_qwen2-0.5b
M7=/tmp/bench_qwen2.5-7b
say "$tag attn=$ATTN"

models() {
  [[ -f $M05/config.json ]] || timeout 120 python3 -m bench.harness.models --shape qwen2-0.5b --out "$M05" --device cuda
  [[ -f $M7/config.json ]] || timeout 200 python3 -m bench.harness.models --shape qwen2.5-7b --out "$M7" --device cuda
}
run() {  # seconds name args...: one torchrun over every GPU
  local secs=$1 name=$2 left=$((DEADLINE_EPOCH - $(date +%s)))
  shift 2
  if ((left < 60)); then say "$name skipped: $left s left"; return; fi
  ((left < secs)) && secs=$left
  say "$name (timeout $secs s)"
  timeout "$secs" torchrun --standalone --nproc_per_node "$n" bench/train_parallel.py --attn "$ATTN" \
    --out "$OUT/train_parallel_${name}_$tag.json" "$@" > "$OUT/train_parallel_${name}_$tag.log" 2>&1
  say "$name exited $?"
  grep -E "^\{|Error|error" "$OUT/train_parallel_${name}_$tag.log" | tail -4 | cut -c1-1200
}
tp() {
  run 280 7b_fsdp4 --model qwen2.5-7b --model_dir "$M7" --batch 8 --seq 4096 --warmup 2 --steps 5
  run 280 7b_fsdp2_tp2 --model qwen2.5-7b --model_dir "$M7" --ds_tensor_parallel_size 2 --batch 8 --seq 4096 \
    --warmup 2 --steps 5
}
long05() {
  for ring in 1 2 4; do
    run 190 longest_05b_ring$ring --mode longest --model qwen2-0.5b --model_dir "$M05" --ring_attn_size "$ring" \
      --lengths 8192:1048576 --long_steps 1 --time_budget_s 120
  done
}
long7() {  # ring
  run 420 longest_7b_ring$1 --mode longest --model qwen2.5-7b --model_dir "$M7" --ring_attn_size "$1" \
    --lengths 4096:524288 --long_steps 1 --time_budget_s 300
}
ring32k() {
  run 150 32k_ring4_05b --model qwen2-0.5b --model_dir "$M05" --ring_attn_size 4 --batch 1 --seq 32768 \
    --warmup 1 --steps 3
  run 300 32k_ring4_7b --model qwen2.5-7b --model_dir "$M7" --ring_attn_size 4 --batch 1 --seq 32768 \
    --warmup 1 --steps 3
}

for what in "$@"; do
  case $what in
    models) models ;;
    tp) models; tp ;;
    long05) models; long05 ;;
    long7_[124]) models; long7 "${what#long7_}" ;;
    ring32k) models; ring32k ;;
    all) models; tp; long05; for r in 1 2 4; do long7 "$r"; done; ring32k ;;
    *) echo "error: unknown part $what (models tp long05 long7_1 long7_2 long7_4 ring32k all)" >&2; exit 2 ;;
  esac
done
