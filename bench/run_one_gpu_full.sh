#!/usr/bin/env bash
# The one-GPU runs (bench/rl_step.py, random Qwen2.5 shapes, 128-token prompts, 256 new tokens, gradient
# checkpointing):
#   bash bench/run_one_gpu_full.sh OUTDIR [VARIANT...]
#   shared / copy   7B full-parameter GRPO, 16 prompts x 8 samples, 8-bit AdamW states and bf16 weights with
#                   stochastic rounding (no fp32 masters); the engine serves the policy's weights (shared) or
#                   holds its own copy (--engine_weights copy)
#   lora            7B LoRA rank 64 on every linear layer, 16 x 8, the engine serving base + adapters unmerged
#   lora_fast       the same for speed where memory allows: the engine's own merged copy, no gradient
#                   checkpointing (76 GiB at peak on an H100)
#   lora_fast_shared  lora_fast with the engine serving base + adapters unmerged (no copy of its own)
#   shared_fast     shared without gradient checkpointing, micro-batches of 8
#   qlora           lora with the base in 4-bit NF4 (--load_in_4bit), the engine dequantizing it a layer at a time
#   qlora32         lora32 with the base in 4-bit NF4
#   qlora32_fast    qlora32 in 2 micro-batches of 32 sequences (a quarter of the dequantizations), KV cache kept
#   load32          host memory of loading the 32B LoRA policy onto the GPU (bench/load_memory.py)
#   lora32          the 32B shape, LoRA rank 16, 8 x 8, the same, the engine's KV cache freed while training
#                   (--vllm_enable_sleep), the random weights in float8 on disk (the device's disk is 64 GiB)
# EXTRA_FLAGS: more train_ppo flags for every variant (e.g. --torch_compile); TAG: appended to the file names;
# STEPS, WARMUP: timed and warm-up steps (3 and 1).
set -uo pipefail
out=${1:?output directory}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
lean='--optim adamw_8bit --master_weights bf16_stochastic'
for variant in "${@:-shared}"; do
  shape=qwen2.5-7b prompts=16 micro=16 disk=bf16 gc=on
  case $variant in
    copy) extra="$lean --engine_weights copy" ;;
    shared) extra="$lean --engine_weights shared" ;;
    lora) extra="--lora_rank 64 --lora_alpha 128 --target_modules all-linear --engine_weights shared" ;;
    lora_fast) extra="--lora_rank 64 --lora_alpha 128 --target_modules all-linear --engine_weights copy"
               gc=off ;;
    lora_fast_shared) extra="--lora_rank 64 --lora_alpha 128 --target_modules all-linear --engine_weights shared"
                      gc=off ;;
    shared_fast) extra="$lean --engine_weights shared" gc=off micro=8 ;;
    lora32) extra="--lora_rank 16 --lora_alpha 32 --target_modules all-linear --engine_weights shared --vllm_enable_sleep"
            shape=qwen2.5-32b prompts=8 micro=4 disk=fp8 ;;
    qlora) extra="--lora_rank 64 --lora_alpha 128 --target_modules all-linear --load_in_4bit --engine_weights shared" ;;
    qlora32) extra="--lora_rank 16 --lora_alpha 32 --target_modules all-linear --load_in_4bit --engine_weights shared --vllm_enable_sleep"
             shape=qwen2.5-32b prompts=8 micro=4 disk=fp8 ;;
    qlora32_fast) extra="--lora_rank 16 --lora_alpha 32 --target_modules all-linear --load_in_4bit --engine_weights shared"
                  shape=qwen2.5-32b prompts=8 micro=32 disk=fp8 ;;
    load32) timeout 400 python3 bench/load_memory.py --shape qwen2.5-32b --model_dir /tmp/bench_qwen2.5-32b \
              --disk_dtype fp8 --path backend --lora_rank 16 --out "$out/load_memory_32b_lora_${gpu}.json" 2>&1 | tail -3
            continue ;;
    *) echo "unknown variant $variant"; exit 2 ;;
  esac
  timeout ${RUN_TIMEOUT:-540} python3 bench/rl_step.py --model $shape --model_dir /tmp/bench_${shape} --prompts $prompts --n 8 --disk_dtype $disk \
    --prompt_len 128 --new_tokens 256 --steps ${STEPS:-3} --warmup_steps ${WARMUP:-1} --skip_trl --gradient_checkpointing $gc \
    --micro_train_batch_size $micro --micro_rollout_batch_size 32 --rlhfkit_flags="$extra ${EXTRA_FLAGS:-}" \
    --out "$out/grpo_1gpu_${variant}${TAG:-}_${gpu}.json" 2>&1 | grep -vE "^\s*$" | tail -25
done
