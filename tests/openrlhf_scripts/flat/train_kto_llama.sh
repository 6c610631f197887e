#!/usr/bin/env bash
# rlhfkit's copy of OpenRLHF examples/scripts/train_kto_llama.sh (flat flags, OpenRLHF 0b08e353; KTO was removed
# from OpenRLHF in v0.9.6, so there is no dotted version), adapted as a user would for CPU: module renamed, tiny
# model/data, sizes cut; each changed line says so. The launcher line is as written: NPROC_PER_NODE picks the
# number of CPU processes. Reads MODEL, DATA, OUT from the environment.
set -x

training_commands=(
   rlhfkit.cli.train_kto                              # changed: openrlhf -> rlhfkit
   --save_path "$OUT/checkpoint/llama3-8b-kto"        # changed: ./checkpoint -> $OUT/checkpoint
   --save_steps -1
   --logging_steps 1
   --eval_steps -1
   --train_batch_size 4                               # changed: 64 -> 4
   --micro_train_batch_size 2                         # changed: 1 -> 2 (rlhfkit's KL reference pairs a prompt with
                                                      #   another answer of its micro-batch; with 1 OpenRLHF pairs it with its own)
   --pretrain "$MODEL"                                # changed: OpenRLHF/Llama-3-8b-sft-mixture -> tiny model
   --param_dtype bf16
   --max_epochs 1
   --max_len 128                                      # changed: 8192 -> 128 (tiny model)
   --learning_rate 5e-7
   --dataset "$DATA/unpaired.jsonl"                   # changed: Dylan2048/ultrafeedback-unpaired-preferences -> tiny file
   --input_key instruction
   --output_key response
   --label_key score
   --attn_implementation sdpa                         # changed: flash_attention_2 -> sdpa (flash-attn is GPU-only)
   --beta 0.1
   --max_samples 8                                    # changed: 1024 -> 8
   --gradient_checkpointing
)
    # --use_wandb [WANDB_TOKENS] or True (use wandb login command)


if [[ ${1} != "slurm" ]]; then
    torchrun --standalone --nproc-per-node ${NPROC_PER_NODE:-8} -m "${training_commands[@]}"
fi
