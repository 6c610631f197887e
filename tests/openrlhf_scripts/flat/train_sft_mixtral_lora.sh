#!/usr/bin/env bash
# rlhfkit's copy of OpenRLHF examples/scripts/train_sft_mixtral_lora.sh (flat flags, OpenRLHF c250c21a),
# adapted as a user would for one CPU: module renamed, tiny model (a dense Llama: no MoE router, so
# --aux_loss_coef has nothing to act on) and data, sizes cut; each changed line says so.
# Reads MODEL, DATA, OUT from the environment.
set -x

training_commands=(
    rlhfkit.cli.train_sft                             # changed: openrlhf -> rlhfkit
    --max_len 128                                     # changed: 2048 -> 128 (tiny model)
    --dataset "$DATA/openorca.jsonl"                  # changed: Open-Orca/OpenOrca -> tiny file
    --input_key question
    --output_key response
    --train_batch_size 4                              # changed: 128 -> 4
    --micro_train_batch_size 4
    --max_samples 8                                   # changed: 500000 -> 8
    --pretrain "$MODEL"                               # changed: mistralai/Mixtral-8x7B-v0.1 -> tiny model
    --save_path "$OUT/checkpoint/mixtral-sft-lora"    # changed: ./checkpoint -> $OUT/checkpoint
    --save_steps -1
    --logging_steps 1
    --eval_steps -1
    --zero_stage 3
    --max_epochs 1
    --bf16
    --gradient_checkpointing
    --attn_implementation sdpa                        # changed: flash_attention_2 -> sdpa (flash-attn is GPU-only)
    --learning_rate 5e-6
    --lora_rank 64
    --lora_alpha 64
    --packing_samples
    --aux_loss_coef 0.001
)

if [[ ${1} != "slurm" ]]; then
    python3 -m "${training_commands[@]}"             # changed: deepspeed --module (8 GPUs) -> one CPU process
fi
