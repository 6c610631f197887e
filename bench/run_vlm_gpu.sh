#!/usr/bin/env bash
# Vision-language benchmarks of the Qwen2.5-VL-7B shape (random weights) on one host, inside one deadline
# (DEADLINE_S, default 570 s). Parts, in order (arguments pick them; default: rollout_vlm grpo_vlm7b):
#   rollout_vlm    bench/rollout_vlm.py on GPU 0: the builtin engine vs HF generate, batches 64 and 256,
#                  128 text + 256 picture tokens a prompt, 256 new tokens -> rollout_vlm_<gpu>.json
#                  (capped at ROLLOUT_S, default 240 s, and so that grpo keeps GRPO_MIN_S, default 300 s)
#   grpo_vlm7b     bench/rl_step_vlm.py: one GRPO step of the 7B VLM with train_ppo_ray's trainer,
#                  --colocate_all_models over every GPU (policy ranks = GPUs, one engine of TP 1 on each),
#                  32 prompts x 8 samples x 256 new tokens, 448-pixel pictures (256 picture tokens),
#                  --gradient_checkpointing, 1 warm-up + 2 timed steps -> grpo_vlm7b_<gpu>x<n>.json (+ .log)
#   grpo_vlm7b_frozen   the same with --freeze_visual_encoder
#   grpo_vlm7b_lora     the same with --lora_rank 64 --lora_alpha 128 (all linear layers; fits one GPU)
#   grpo_vlm7b_lora_dyn grpo_vlm7b_lora with --use_dynamic_batch --train_max_tokens_per_gpu DYN_TOKENS (32768)
# The GRPO parts' model directory (/tmp/bench_qwen2.5-vl-7b, 16.6 GB) is written on GPU 1 while rollout_vlm
# runs on GPU 0. Ray comes from the carried wheels in .whl/. Writes under $OUT (JSON and .log files).
set -uo pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
DEADLINE_EPOCH=${DEADLINE_EPOCH:-$(($(date +%s) + ${DEADLINE_S:-570}))}
say() { echo "[vlm $(date +%H:%M:%S)] $*"; }
left() { echo $((DEADLINE_EPOCH - $(date +%s))); }
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export PYTHONPATH="$PWD:/tmp/site:${PYTHONPATH:-}"
export RAY_DISABLE_IMPORT_WARNING=1 RAY_USAGE_STATS_ENABLED=0 RAY_OBJECT_STORE_ALLOW_SLOW_STORAGE=1
unset RAY_ADDRESS
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')
n=$(nvidia-smi -L | wc -l)
tag="${gpu}x${n}"
MODEL=/tmp/bench_qwen2.5-vl-7b
parts="${*:-rollout_vlm grpo_vlm7b}"
[[ -d /tmp/site/ray ]] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
python3 -c "import ray, torch, transformers; print('ray', ray.__version__, 'torch', torch.__version__, \
'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())" || exit 1

writer=
if [[ $parts == *grpo* && ! -f $MODEL/.bench_complete ]]; then  # on the last GPU, beside rollout_vlm on GPU 0
  say "writing the 7B VLM to $MODEL on GPU $((n - 1))"
  CUDA_VISIBLE_DEVICES=$((n - 1)) timeout "$(left)" python3 bench/rl_step_vlm.py --shape qwen2.5-vl-7b \
    --write_model_only --model_dir "$MODEL" > "$OUT/vlm7b_model_write.log" 2>&1 &
  writer=$!
fi
wait_model() {
  [[ -n $writer ]] || return 0
  wait "$writer"; local rc=$?; writer=
  say "model written (exit $rc): $(tail -1 "$OUT/vlm7b_model_write.log" | cut -c1-200)"
  return $rc
}
grpo() {  # name [rl_step_vlm flags...]
  wait_model || { say "skipped $1: no model"; return; }
  local l; l=$(left)
  ((l > 90)) || { say "skipped $1: $l s left"; return; }
  say "$1 (timeout $l s)"
  timeout -k 30 "$((l - 5))" python3 bench/rl_step_vlm.py --shape qwen2.5-vl-7b --model_dir "$MODEL" \
    --ray_gpus "$n" --engine_tp 1 --prompts 32 --n 8 --new_tokens 256 --picture 448 --steps 2 --warmup_steps 1 \
    --gradient_checkpointing on "${@:2}" --out "$OUT/$1_$tag.json" > "$OUT/$1_$tag.log" 2>&1
  say "$1 exited $?"
  grep -E "^\[rl_step_vlm\]|Error|error:|Traceback" "$OUT/$1_$tag.log" | tail -12 | cut -c1-300
  PATH="/tmp/site/bin:$PATH" ray stop --force > /dev/null 2>&1 || true
}
for q in $parts; do
  case $q in
    rollout_vlm)
      cap=${ROLLOUT_S:-240}; keep=0; [[ $parts == *grpo* ]] && keep=${GRPO_MIN_S:-300}
      (($(left) - keep < cap)) && cap=$(($(left) - keep))
      if ((cap < 60)); then say "skipped rollout_vlm: $cap s"; continue; fi
      say "rollout_vlm on GPU 0 (timeout $cap s)"
      CUDA_VISIBLE_DEVICES=0 timeout "$cap" python3 bench/rollout_vlm.py --shape qwen2.5-vl-7b --batch 64,256 \
        --shapes 128x256 --out "$OUT/rollout_vlm_$gpu.json" > "$OUT/rollout_vlm_$gpu.log" 2>&1
      say "rollout_vlm exited $?"; tail -c 1500 "$OUT/rollout_vlm_$gpu.log" ;;
    grpo_vlm7b) grpo grpo_vlm7b ;;
    grpo_vlm7b_frozen) grpo grpo_vlm7b_frozen --freeze_visual_encoder ;;
    grpo_vlm7b_lora) grpo grpo_vlm7b_lora --extra "--lora_rank 64 --lora_alpha 128" ;;
    grpo_vlm7b_lora_dyn) grpo grpo_vlm7b_lora_dyn --extra "--lora_rank 64 --lora_alpha 128 --use_dynamic_batch \
--train_max_tokens_per_gpu ${DYN_TOKENS:-32768}" ;;
    *) echo "unknown part $q (rollout_vlm grpo_vlm7b grpo_vlm7b_frozen grpo_vlm7b_lora grpo_vlm7b_lora_dyn)" >&2; exit 2 ;;
  esac
done
wait_model
nvidia-smi --query-gpu=memory.used --format=csv,noheader | tr '\n' ' '; echo
exit 0
