#!/usr/bin/env bash
# Issue 13's runs on a 4-GPU machine, in calls that each fit the device tool's 10 minutes:
#   bash bench/run_scale_gpu.sh gen     TP parity (2, 4) on a small fp32 model; rollout of the 7B shape at
#                                       TP 1 / 2 / 4 and of the 32B shape at TP 4 (batch 256, 512 / 512)
#   bash bench/run_scale_gpu.sh grpo1   the 7B model written to local disk; GRPO 32 x 8 x 512 with
#                                       4 engines of TP 1 colocated (checkpoint saved, resumed, exported:
#                                       scale_ckpt.py) and 2 engines of TP 2 colocated with sleep
#   bash bench/run_scale_gpu.sh grpo2   GRPO with 4 engines of TP 1 colocated with sleep, and disaggregated
#                                       (2 policy GPUs + 1 engine of TP 2) without and with --async_train
# Ray comes from the carried wheels in .whl/ (bash ../shared/device/wheels.sh ray). Writes under $OUT.
set -uo pipefail
OUT=${OUT:-bench/results}
what=${1:?gen|grpo1|grpo2}
mkdir -p "$OUT"
say() { echo "[scale $(date +%H:%M:%S)] $*"; }
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export PYTHONPATH="$PWD:/tmp/site:${PYTHONPATH:-}"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')
n=$(nvidia-smi -L | wc -l)
tag="${gpu}x${n}"
say "$tag"; nvidia-smi topo -m 2>/dev/null | head -6
MODEL7=/tmp/bench_qwen2.5-7b

if [[ $what == gen ]]; then
  timeout 150 python3 bench/rollout_tp.py --parity --tp 2 --out "$OUT/tp_parity_$tag.json" 2>&1 | grep -E '^\{|Error|error' | cut -c1-600
  timeout 240 python3 bench/rollout_tp.py --shape qwen2.5-7b --tp 1,2,4 --batch 256 --prompt 512 --new 512 --repeat 2 \
    --sleep_check --out "$OUT/rollout_tp_7b_$tag.json" 2>&1 | grep -E '^\{|Error' | cut -c1-700
  timeout 170 python3 bench/rollout_tp.py --shape qwen2.5-32b --tp 4 --batch 256 --prompt 512 --new 512 --repeat 2 \
    --out "$OUT/rollout_tp_32b_$tag.json" 2>&1 | grep -E '^\{|Error' | cut -c1-700
  exit 0
fi

python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
unset RAY_ADDRESS
export RAY_DISABLE_IMPORT_WARNING=1 RAY_USAGE_STATS_ENABLED=0 RAY_OBJECT_STORE_ALLOW_SLOW_STORAGE=1
if [[ ! -f $MODEL7/config.json ]]; then
  say "writing the 7B shape to $MODEL7"
  timeout 150 python3 bench/bench_models.py --shape qwen2.5-7b --out "$MODEL7" --device cuda || exit 1
fi
common=(--model qwen2.5-7b --model_dir "$MODEL7" --prompts 32 --n 8 --prompt_len 128 --new_tokens 512 --steps 1
        --micro_train_batch_size 4 --micro_rollout_batch_size 16 --gradient_checkpointing on --skip_trl)
grpo() {  # layout, seconds
  say "GRPO $1"
  timeout "$2" python3 bench/rl_step.py "${common[@]}" --ray_layout "$1" --out "$OUT/grpo_7b_$1_$tag.json" \
    > "$OUT/grpo_7b_$1_$tag.log" 2>&1
  say "$1 exited $?"; grep -E "^\[rl_step\]|Error|error:" "$OUT/grpo_7b_$1_$tag.log" | tail -8 | cut -c1-400
}
if [[ $what == grpo1 ]]; then
  say "checkpoint round trip, 4 engines TP 1 colocated"
  timeout 330 python3 bench/scale_ckpt.py --model_dir "$MODEL7" --work /tmp/scale_ckpt \
    --flags "--actor_num_gpus_per_node 4 --vllm_num_engines 4 --colocate_all_models" \
    --out "$OUT/grpo_7b_ckpt_colo4_tp1_$tag.json" > "$OUT/grpo_7b_ckpt_$tag.log" 2>&1
  say "ckpt exited $?"; grep -E "^\{|Error|error:" "$OUT/grpo_7b_ckpt_$tag.log" | tail -5 | cut -c1-1500
  rm -rf /tmp/scale_ckpt/ckpt /tmp/scale_ckpt/hf_b
  grpo colo4_tp2_sleep 200
fi
if [[ $what == grpo2 ]]; then
  grpo colo4_tp1_sleep 200
  grpo disagg2_tp2 170
  grpo disagg2_tp2_async 170
fi
