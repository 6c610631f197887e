#!/usr/bin/env bash
# rlhfkit's copy of OpenRLHF examples/scripts/train_rm.sh (dotted flags, OpenRLHF after ed62d0e2), adapted as
# a user would for one CPU: module renamed, tiny model/data, sizes cut; each changed line says so.
# Reads MODEL, DATA, OUT from the environment.
set -x

training_commands=(
   rlhfkit.cli.train_rm                               # changed: openrlhf -> rlhfkit
   --ckpt.output_dir "$OUT/checkpoint/llama3-8b-rm"   # changed: ./checkpoint -> $OUT/checkpoint
   --ckpt.save_steps -1
   --logger.logging_steps 1
   --eval.steps -1
   --train.batch_size 4                               # changed: 256 -> 4
   --train.micro_batch_size 1
   --model.model_name_or_path "$MODEL"                # changed: OpenRLHF/Llama-3-8b-sft-mixture -> tiny model
   --ds.param_dtype bf16
   --train.max_epochs 1
   --data.max_len 128                                 # changed: 8192 -> 128 (tiny model)
   --ds.zero_stage 3
   --adam.lr 9e-6
   --data.dataset "$DATA/preference.jsonl"            # changed: OpenRLHF/preference_dataset_mixture2_and_safe_pku -> tiny file
   --data.apply_chat_template
   --data.chosen_key chosen
   --data.rejected_key rejected
   --ds.attn_implementation sdpa                      # changed: flash_attention_2 -> sdpa (flash-attn is GPU-only)
   --ckpt.load_enable
   --ds.packing_samples
   --model.gradient_checkpointing_enable
)
     # --logger.wandb.key [WANDB_TOKENS] or True (use wandb login command)
     # --ds.packing_samples


if [[ ${1} != "slurm" ]]; then
    python3 -m "${training_commands[@]}"             # changed: deepspeed --module (8 GPUs) -> one CPU process
fi
