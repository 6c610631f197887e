#!/usr/bin/env bash
# rlhfkit's copy of OpenRLHF examples/scripts/train_sft_llama_tensor_parallelism.sh (flat flags, OpenRLHF 473f61bd):
# SFT with DeepSpeed AutoTP, here --ds_tensor_parallel_size 2 on FSDP2. Adapted as a user would for a CPU: module
# renamed, tiny model/data (the tiny Llama with its vocabulary padded to 104, so 2 divides it), 2 CPU processes
# (one tensor-parallel pair), sizes cut to one step; each changed line says so. Reads TP_MODEL, DATA, OUT.
set -x

training_commands=(
   rlhfkit.cli.train_sft                              # changed: openrlhf -> rlhfkit
   --max_len 128                                      # changed: 2048 -> 128 (tiny model)
   --dataset "$DATA/openorca.jsonl"                   # changed: Open-Orca/OpenOrca -> tiny file
   --input_key question
   --output_key response
   --train_batch_size 8                               # changed: 256 -> 8
   --micro_train_batch_size 4
   --max_samples 8                                    # changed: 500000 -> 8 (one step)
   --pretrain "$TP_MODEL"                             # changed: meta-llama/Meta-Llama-3-8B -> tiny model
   --save_path "$OUT/checkpoint/llama3-8b-sft"        # changed: ./checkpoint -> $OUT/checkpoint
   --save_steps -1
   --logging_steps 1
   --eval_steps -1
   --zero_stage 2
   --max_epochs 1
   --bf16
   --attn_implementation sdpa                         # changed: flash_attention_2 -> sdpa (flash-attn is GPU-only)
   --learning_rate 5e-6
   --load_checkpoint
   --gradient_checkpointing
   --packing_samples
   --ds_tensor_parallel_size 2
)
    # --wandb [WANDB_TOKENS]
    # --packing_samples

if [[ ${1} != "slurm" ]]; then
    torchrun --standalone --nproc-per-node 2 -m "${training_commands[@]}"  # changed: deepspeed --module (8 GPUs)
fi                                                                        #   -> torchrun, 2 CPU processes
