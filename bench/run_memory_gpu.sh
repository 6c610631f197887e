#!/usr/bin/env bash
# The memory plan against measured peaks: GRPO of the 7B shape colocated on every GPU of the host (policy ranks =
# engines = GPUs), each run recording the plan train_ppo_ray printed, each actor's peak reserved memory per call,
# the engines' and NVML's peaks (bench/harness/ray_step.py: memory_plan, memory_steps, memory_check). Parts, in order,
# inside one deadline (DEADLINE_S, default 570 s):
#   mb4        --micro_train_batch_size 4 (4 x 640 tokens a micro-batch), nothing sleeps
#   dyn8k / dyn16k   --use_dynamic_batch --train_max_tokens_per_gpu 8192 / 16384, nothing sleeps
#   sleep32k   --use_dynamic_batch --train_max_tokens_per_gpu 32768 with --vllm_enable_sleep --deepspeed_enable_sleep
#   refuse14b  the 14B shape's plan on this host (no model is loaded: the plan's refusal or its table)
#   grpo14b    the 14B shape, full parameters, 4 policy ranks (ZeRO-2) and 2 engines of TP 2 colocated,
#              nothing sleeps, --use_dynamic_batch --train_max_tokens_per_gpu 8192 (a 4-GPU host)
#   grpo32b    the 32B shape with LoRA (rank 64, all linear layers) over a frozen base at ZeRO-3, 2 engines
#              of TP 2 colocated, nothing sleeps, 8192-token micro-batches (a 4-GPU host)
# Ray comes from the carried wheels in .whl/ (wheels of ray and its dependencies for the GPU machine's Python). Writes under $OUT.
set -uo pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
DEADLINE_EPOCH=${DEADLINE_EPOCH:-$(($(date +%s) + ${DEADLINE_S:-570}))}
say() { echo "[memory $(date +%H:%M:%S)] $*"; }
left() { echo $((DEADLINE_EPOCH - $(date +%s))); }
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export PYTHONPATH="$PWD:/tmp/site:${PYTHONPATH:-}"
export RAY_DISABLE_IMPORT_WARNING=1 RAY_USAGE_STATS_ENABLED=0 RAY_OBJECT_STORE_ALLOW_SLOW_STORAGE=1
unset RAY_ADDRESS
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')
n=$(nvidia-smi -L | wc -l)
tag="${gpu}x${n}"
MODEL7=/tmp/bench_qwen2.5-7b
write_model() {  # shape dir
  [[ -f $2/config.json ]] && return 0
  say "writing the $1 shape"; timeout "$(left)" python3 -m bench.harness.models --shape "$1" --out "$2" --device cuda
}
[[ -d /tmp/site/ray ]] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
common=(--prompts $((8 * n)) --n 8 --prompt_len 128 --new_tokens 512 --micro_train_batch_size 4
        --micro_rollout_batch_size 16 --gradient_checkpointing on --skip_trl --ray_gpus "$n")
grpo() {  # name layout extra-flags [shape [steps]]
  local l shape=${4:-qwen2.5-7b} size; l=$(left); size=${shape#qwen2.5-}
  ((l > 120)) || { say "skipped $1: $l s left"; return; }
  write_model "$shape" "/tmp/bench_$shape" || { say "no $shape model"; return; }
  l=$(left); say "$1 (timeout $l s)"
  timeout "$l" python3 bench/rl_step.py "${common[@]}" --model "$shape" --model_dir "/tmp/bench_$shape" \
    --steps "${5:-2}" --warmup_steps 1 --ray_layout "$2" --ray_extra "$3" \
    --out "$OUT/memory_${size}_$1_$tag.json" > "$OUT/memory_${size}_$1_$tag.log" 2>&1
  say "$1 exited $?"; grep -E "^\[rl_step\]|Error|error:|peak" "$OUT/memory_${size}_$1_$tag.log" | tail -12 | cut -c1-300
  nvidia-smi --query-gpu=memory.used --format=csv,noheader | tr '\n' ' '; echo
  PATH="/tmp/site/bin:$PATH" ray stop --force > /dev/null 2>&1 || true
}
for p in "${@:-mb4 dyn8k dyn16k sleep32k}"; do
  for q in $p; do
    case $q in
      mb4) grpo mb4 colocated_nosleep "" ;;
      dyn8k) grpo dyn8k colocated_nosleep "--use_dynamic_batch --train_max_tokens_per_gpu 8192" ;;
      dyn16k) grpo dyn16k colocated_nosleep "--use_dynamic_batch --train_max_tokens_per_gpu 16384" ;;
      sleep32k) grpo sleep32k colocated "--use_dynamic_batch --train_max_tokens_per_gpu 32768" ;;
      grpo14b) grpo grpo14b colo4_tp2 "--use_dynamic_batch --train_max_tokens_per_gpu 8192" qwen2.5-14b ;;
      grpo32b) grpo grpo32b_lora colo4_tp2 "--lora_rank 64 --lora_alpha 128 --zero_stage 3 --use_dynamic_batch \
--train_max_tokens_per_gpu 8192" qwen2.5-32b 1 ;;
      refuse14b) timeout 120 python3 bench/plan_check.py --shape qwen2.5-14b --gpus "$n" \
                   --out "$OUT/memory_plan_14b_$tag.json" 2>&1 | tail -15 | cut -c1-400 ;;
      *) echo "unknown part $q (mb4 dyn8k dyn16k sleep32k refuse14b grpo14b grpo32b)" >&2; exit 2 ;;
    esac
  done
done
exit 0
