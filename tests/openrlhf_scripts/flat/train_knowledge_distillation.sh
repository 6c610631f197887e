#!/usr/bin/env bash
# rlhfkit's copy of OpenRLHF examples/scripts/train_knowledge_distillation.sh (flat flags, OpenRLHF <= v0.9.5;
# KD was removed in v0.9.6, so there is no dotted version), adapted as a user would for one CPU: module renamed,
# tiny student/teacher and data, sizes cut; each changed line says so. Reads MODEL, DATA, OUT from the environment.
set -x

training_commands=(
   rlhfkit.cli.train_kd                               # changed: openrlhf -> rlhfkit
   --max_len 128                                      # changed: 2048 -> 128 (tiny model)
   --dataset "$DATA/openorca.jsonl"                   # changed: Open-Orca/OpenOrca -> tiny file
   --input_key question
   --output_key response
   --train_batch_size 4                               # changed: 256 -> 4
   --micro_train_batch_size 2
   --max_samples 8                                    # changed: 500000 -> 8
   --pretrain "$MODEL"                                # changed: meta-llama/Meta-Llama-3-8B-Instruct -> tiny model
   --teacher_model "$MODEL"                           # changed: meta-llama/Meta-Llama-3-70B-Instruct -> tiny model
   --save_path "$OUT/checkpoint/llama3-8b-kd"         # changed: ./checkpoint -> $OUT/checkpoint
   --save_steps -1
   --logging_steps 1
   --eval_steps -1
   --zero_stage 3
   --max_epochs 1
   --bf16
   # --flash_attn                                     # changed: dropped, flash-attn is GPU-only (sdpa is the default)
   --kd_coef 0.4
   --learning_rate 5e-6
   --teacher_offload
   --gradient_checkpointing
)
    # --use_wandb [WANDB_TOKENS] or True (use wandb login command)


if [[ ${1} != "slurm" ]]; then
    python3 -m "${training_commands[@]}"             # changed: deepspeed --module (8 GPUs) -> one CPU process
fi
