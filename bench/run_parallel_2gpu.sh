#!/usr/bin/env bash
# Issue 17 on a 2-GPU machine (the 4-GPU kinds were withheld): the NCCL path of tensor parallelism and ring
# attention on the Qwen2-0.5B shape, in one call of about 7 minutes. Same script and JSON as
# run_parallel_gpu.sh (bench/train_parallel.py under torchrun over every GPU of the host):
#   SFT throughput, FSDP 2 vs TP 2 (global batch 8 x 4096); the longest sequence that trains with ring 1 and
#   ring 2; tokens/s of one 32k-token row with ring 2. `bash bench/run_parallel_2gpu.sh ring`: the ring runs only.
set -uo pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 OMP_NUM_THREADS=8
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')
n=$(nvidia-smi -L | wc -l)
tag="${gpu}x${n}"
M05=/tmp/bench_qwen2-0.5b
[[ -f $M05/config.json ]] || timeout 120 python3 -m bench.harness.models --shape qwen2-0.5b --out "$M05" --device cuda
run() {  # seconds name args...
  local secs=$1 name=$2
  shift 2
  echo "[parallel $(date +%H:%M:%S)] $name"
  timeout "$secs" torchrun --standalone --nproc_per_node "$n" bench/train_parallel.py \
    --out "$OUT/train_parallel_${name}_$tag.json" --model qwen2-0.5b --model_dir "$M05" "$@" \
    > "/tmp/train_parallel_${name}.log" 2>&1
  echo "[parallel] $name exited $?"
  grep -E "Error|error" "/tmp/train_parallel_${name}.log" | tail -3 | cut -c1-400
}
what=${1:-all}  # all | ring (the ring runs only)
if [[ $what == all ]]; then
  run 100 05b_fsdp2 --batch 8 --seq 4096 --warmup 2 --steps 5
  run 100 05b_tp2 --ds_tensor_parallel_size 2 --batch 8 --seq 4096 --warmup 2 --steps 5
  run 110 longest_05b_ring1 --mode longest --lengths 8192:524288 --long_steps 1 --time_budget_s 80
fi
run 130 longest_05b_ring2 --mode longest --ring_attn_size 2 --lengths 8192:524288 --long_steps 1 --time_budget_s 100
run 90 32k_ring2_05b --ring_attn_size 2 --batch 1 --seq 32768 --warmup 1 --steps 3
