#!/usr/bin/env bash
# Issue 13's runs on a 4-GPU machine. Parts run in the order given, inside one deadline so a call fits the
# device tool's 10 minutes (DEADLINE_S, default 570 s from the start of this script, or DEADLINE_EPOCH):
#   gen                TP parity (2, 4) on a small fp32 model; rollout of the 7B shape at TP 1 / 2 / 4 and of
#                      the 32B shape at TP 4 (batch 256, 512 / 512)
#   ckpt               GRPO 32 x 8 x 512 of the 7B shape, 4 engines of TP 1 colocated, 3 steps: checkpoint saved
#                      after step 2, resumed (twice: the second gives the noise the first is judged against),
#                      exported to HF and loaded (scale_ckpt.py; about 9 minutes, a call of its own)
#   colo4_tp1 | colo4_tp1_sleep | colo4_tp2_sleep | disagg2_tp2 | disagg2_tp2_async
#                      GRPO 32 x 8 x 512 of the 7B shape in that layout (bench/harness/ray_step.py)
#   colo4_tp1_dyn      colo4_tp1 with micro-batches of 16k tokens (--use_dynamic_batch) instead of 4 samples
#   grpo1 = ckpt colo4_tp2_sleep;  grpo2 = colo4_tp1_sleep disagg2_tp2 disagg2_tp2_async
# A part starts only with enough time left (60 s; 150 s for a layout, 300 s for ckpt), and its timeout is cut to the time left, so a call cut short keeps
# the JSON of the parts that finished. Ray comes from the carried wheels in .whl/ (wheels of ray and its
# dependencies for the GPU machine's Python). Writes under $OUT.
set -uo pipefail
OUT=${OUT:-bench/results}
(($#)) || { echo "usage: run_scale_gpu.sh PART... (gen ckpt grpo1 grpo2 or a layout)" >&2; exit 2; }
mkdir -p "$OUT"
DEADLINE_EPOCH=${DEADLINE_EPOCH:-$(($(date +%s) + ${DEADLINE_S:-570}))}
say() { echo "[scale $(date +%H:%M:%S)] $*"; }
left() { echo $((DEADLINE_EPOCH - $(date +%s))); }
budget() {  # max seconds [min seconds, default 60] -> the timeout to use, or a line and failure when under min are left
  local l; l=$(left)
  if ((l < ${2:-60})); then say "skipped: ${l} s left" >&2; return 1; fi
  echo $((l < $1 ? l : $1))
}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export PYTHONPATH="$PWD:/tmp/site:${PYTHONPATH:-}"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')
n=$(nvidia-smi -L | wc -l)
tag="${gpu}x${n}"
say "$tag, $(left) s to the deadline"
MODEL7=/tmp/bench_qwen2.5-7b

gen() {
  local t
  t=$(budget 150) && timeout "$t" python3 bench/rollout_tp.py --parity --tp 2 --out "$OUT/tp_parity_$tag.json" 2>&1 \
    | grep -E '^\{|Error|error' | cut -c1-600
  t=$(budget 240) && timeout "$t" python3 bench/rollout_tp.py --shape qwen2.5-7b --tp 1,2,4 --batch 256 --prompt 512 \
    --new 512 --repeat 2 --sleep_check --out "$OUT/rollout_tp_7b_$tag.json" 2>&1 | grep -E '^\{|Error' | cut -c1-700
  t=$(budget 170) && timeout "$t" python3 bench/rollout_tp.py --shape qwen2.5-32b --tp 4 --batch 256 --prompt 512 \
    --new 512 --repeat 2 --out "$OUT/rollout_tp_32b_$tag.json" 2>&1 | grep -E '^\{|Error' | cut -c1-700
}
ray_setup() {
  [[ -d /tmp/site/ray ]] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    || exit 1
  unset RAY_ADDRESS
  export RAY_DISABLE_IMPORT_WARNING=1 RAY_USAGE_STATS_ENABLED=0 RAY_OBJECT_STORE_ALLOW_SLOW_STORAGE=1
  if [[ ! -f $MODEL7/config.json ]]; then
    say "writing the 7B shape to $MODEL7"
    timeout 150 python3 -m bench.harness.models --shape qwen2.5-7b --out "$MODEL7" --device cuda || exit 1
  fi
}
ray_clean() {  # a run cut short by its timeout leaves Ray's processes (and their GPU memory) behind
  PATH="/tmp/site/bin:$PATH" ray stop --force > /dev/null 2>&1 || true
  say "GPU memory used (MiB): $(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | tr '\n' ' ')"
}
common=(--model qwen2.5-7b --model_dir "$MODEL7" --prompts 32 --n 8 --prompt_len 128 --new_tokens 512 --steps 2
        --warmup_steps 2 --micro_train_batch_size 4 --micro_rollout_batch_size 16 --gradient_checkpointing on --skip_trl)
grpo() {  # name [layout [more train_ppo_ray flags]]
  local t name=$1 layout=${2:-$1} extra=${3:-}
  t=$(budget 240 150) || return
  say "GRPO $name (timeout $t s)"
  timeout "$t" python3 bench/rl_step.py "${common[@]}" --ray_layout "$layout" --ray_extra "$extra" \
    --out "$OUT/grpo_7b_${name}_$tag.json" > "$OUT/grpo_7b_${name}_$tag.log" 2>&1
  say "$name exited $?"; grep -E "^\[rl_step\]|Error|error:" "$OUT/grpo_7b_${name}_$tag.log" | tail -8 | cut -c1-400
  ray_clean
}
ckpt() {
  local t
  t=$(budget 540 300) || return
  say "checkpoint round trip, 4 engines TP 1 colocated (timeout $t s)"
  timeout "$t" python3 bench/scale_ckpt.py --model_dir "$MODEL7" --work /tmp/scale_ckpt \
    --flags "--actor_num_gpus_per_node 4 --vllm_num_engines 4 --colocate_all_models" --noise_run \
    --out "$OUT/grpo_7b_ckpt_colo4_tp1_$tag.json" > "$OUT/grpo_7b_ckpt_$tag.log" 2>&1
  say "ckpt exited $?"; grep -E "^\{|Error|error:" "$OUT/grpo_7b_ckpt_$tag.log" | tail -5 | cut -c1-1500
  rm -rf /tmp/scale_ckpt/ckpt /tmp/scale_ckpt/hf_a /tmp/scale_ckpt/hf_b /tmp/scale_ckpt/hf_c
  ray_clean
}

parts=()
for p in "$@"; do
  case $p in
    grpo1) parts+=(ckpt colo4_tp2_sleep) ;;
    grpo2) parts+=(colo4_tp1_sleep disagg2_tp2 disagg2_tp2_async) ;;
    gen|ckpt|colo4_tp1|colo4_tp1_dyn|colo4_tp1_sleep|colo4_tp2_sleep|disagg2_tp2|disagg2_tp2_async) parts+=("$p") ;;
    *) echo "error: unknown part $p (gen ckpt grpo1 grpo2 colo4_tp1 colo4_tp1_dyn colo4_tp1_sleep colo4_tp2_sleep disagg2_tp2" \
         "disagg2_tp2_async)" >&2; exit 2 ;;
  esac
done
for p in "${parts[@]}"; do
  case $p in
    gen) gen ;;
    ckpt) ray_setup; ckpt ;;
    colo4_tp1_dyn) ray_setup; grpo colo4_tp1_dyn colo4_tp1 "--use_dynamic_batch --train_max_tokens_per_gpu 16384" ;;
    *) ray_setup; grpo "$p" ;;
  esac
done
exit 0
