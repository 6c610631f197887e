#!/usr/bin/env bash
# rlhfkit's copy of OpenRLHF examples/scripts/train_continue_pretrain_llama.sh (flat flags, OpenRLHF 1445b3ba),
# adapted as a user would for one CPU: module renamed, tiny model/data, sizes cut; each changed line says so.
# Reads MODEL, DATA, OUT from the environment.
set -x

training_commands=(
    rlhfkit.cli.train_sft                             # changed: openrlhf -> rlhfkit
    --max_len 128                                     # changed: 4096 -> 128 (tiny model)
    --dataset "$DATA/pretrain.jsonl"                  # changed: {your_pretrain_dataset} -> tiny file
    --dataset_probs 1.0
    --train_batch_size 4                              # changed: 128 -> 4
    --micro_train_batch_size 1
    --pretrain "$MODEL"                               # changed: meta-llama/Llama-2-7b-hf -> tiny model
    --save_path "$OUT/checkpoint/llama-2-7b-continue" # changed: ./checkpoint -> $OUT/checkpoint
    --save_steps -1
    --logging_steps 1
    --eval_steps -1
    --zero_stage 2
    --max_epochs 1
    --bf16
    # --flash_attn                                    # changed: dropped, flash-attn is GPU-only (sdpa is the default)
    --learning_rate 3e-5
    --gradient_checkpointing
    --pretrain_mode
)
    # --use_wandb [WANDB_TOKENS] or True (use wandb login command)

if [[ ${1} != "slurm" ]]; then
    python3 -m "${training_commands[@]}"             # changed: deepspeed --module (8 GPUs) -> one CPU process
fi
