#!/usr/bin/env bash
# rlhfkit's copy of OpenRLHF examples/scripts/train_sft.sh (dotted flags, OpenRLHF after ed62d0e2), adapted as
# a user would for one CPU: module renamed, tiny model/data, sizes cut; each changed line says so.
# Reads MODEL, DATA, OUT from the environment.
set -x

training_commands=(
   rlhfkit.cli.train_sft                              # changed: openrlhf -> rlhfkit
   --data.max_len 128                                 # changed: 2048 -> 128 (tiny model)
   --data.dataset "$DATA/openorca.jsonl"              # changed: Open-Orca/OpenOrca -> tiny file
   --data.input_key question
   --data.output_key response
   --train.batch_size 4                               # changed: 256 -> 4
   --train.micro_batch_size 2
   --data.max_samples 8                               # changed: 500000 -> 8
   --model.model_name_or_path "$MODEL"                # changed: meta-llama/Meta-Llama-3-8B -> tiny model
   --ckpt.output_dir "$OUT/checkpoint/llama3-8b-sft"  # changed: ./checkpoint -> $OUT/checkpoint
   --ckpt.save_steps -1
   --logger.logging_steps 1
   --eval.steps -1
   --ds.zero_stage 2
   --train.max_epochs 1
   --ds.param_dtype bf16
   --ds.attn_implementation sdpa                      # changed: flash_attention_2 -> sdpa (flash-attn is GPU-only)
   --adam.lr 5e-6
   --ckpt.load_enable
   --ds.packing_samples
   --model.gradient_checkpointing_enable
)
    # --wandb [WANDB_TOKENS]
    # --ds.packing_samples

if [[ ${1} != "slurm" ]]; then
    python3 -m "${training_commands[@]}"             # changed: deepspeed --module (8 GPUs) -> one CPU process
fi
