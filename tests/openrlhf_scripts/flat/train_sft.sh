#!/usr/bin/env bash
# rlhfkit's copy of OpenRLHF examples/scripts/train_sft.sh (flat flags, OpenRLHF 17b714b5), adapted as a user
# would for one CPU: module renamed, tiny model/data, sizes cut; each changed line says so.
# Reads MODEL, DATA, OUT from the environment.
set -x

training_commands=(
   rlhfkit.cli.train_sft                              # changed: openrlhf -> rlhfkit
   --max_len 128                                      # changed: 2048 -> 128 (tiny model)
   --dataset "$DATA/openorca.jsonl"                   # changed: Open-Orca/OpenOrca -> tiny file
   --input_key question
   --output_key response
   --train_batch_size 4                               # changed: 256 -> 4
   --micro_train_batch_size 2
   --max_samples 8                                    # changed: 500000 -> 8
   --pretrain "$MODEL"                                # changed: meta-llama/Meta-Llama-3-8B -> tiny model
   --save_path "$OUT/checkpoint/llama3-8b-sft"        # changed: ./checkpoint -> $OUT/checkpoint
   --save_steps -1
   --logging_steps 1
   --eval_steps -1
   --zero_stage 2
   --max_epochs 1
   --param_dtype bf16
   --attn_implementation sdpa                         # changed: flash_attention_2 -> sdpa (flash-attn is GPU-only)
   --learning_rate 5e-6
   --load_checkpoint
   --packing_samples
   --gradient_checkpointing
)
    # --wandb [WANDB_TOKENS]
    # --packing_samples

if [[ ${1} != "slurm" ]]; then
    python3 -m "${training_commands[@]}"             # changed: deepspeed --module (8 GPUs) -> one CPU process
fi
