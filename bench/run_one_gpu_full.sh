#!/usr/bin/env bash
# Issue 43's one-GPU runs: 7B full-parameter GRPO on one 80 GB card (bench/rl_step.py, random Qwen2.5-7B
# shape, 16 prompts x 8 samples x 256 new tokens, 128-token prompts, gradient checkpointing, 8-bit AdamW
# states and bf16 weights with stochastic rounding, no fp32 masters).
#   bash bench/run_one_gpu_full.sh OUTDIR [copy|shared|...]
# Each variant is one rl_step.py run; `copy`: the engine keeps its own copy of the weights
# (--engine_weights copy), `shared`: the engine serves the policy's weights.
set -uo pipefail
out=${1:?output directory}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
lean='--optim adamw_8bit --master_weights bf16_stochastic'
for variant in "${@:-shared}"; do
  case $variant in
    copy) extra="$lean --engine_weights copy" ;;
    shared) extra="$lean --engine_weights shared" ;;
    *) echo "unknown variant $variant"; exit 2 ;;
  esac
  timeout 480 python3 bench/rl_step.py --model qwen2.5-7b --model_dir /tmp/bench_7b --prompts 16 --n 8 \
    --prompt_len 128 --new_tokens 256 --steps 3 --warmup_steps 1 --skip_trl --gradient_checkpointing on \
    --micro_train_batch_size 16 --micro_rollout_batch_size 32 --rlhfkit_flags="$extra" \
    --out "$out/grpo7b_full_${variant}_${gpu}.json" 2>&1 | grep -vE "^\s*$" | tail -25
done
