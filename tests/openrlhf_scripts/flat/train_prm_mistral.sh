#!/usr/bin/env bash
# rlhfkit's copy of OpenRLHF examples/scripts/train_prm_mistral.sh (flat flags, OpenRLHF <= v0.9.5; PRM was
# removed in v0.9.6, so there is no dotted version), adapted as a user would for one CPU: module renamed, tiny
# model (whose tokenizer knows the step tag "ки", as Mistral's does) and data, sizes cut; each changed line says
# so. Reads PRM_MODEL, DATA, OUT from the environment.
set -x

training_commands=(
   rlhfkit.cli.train_prm                              # changed: openrlhf -> rlhfkit
   --save_path "$OUT/checkpoint/mistal-7b-prm"        # changed: ./checkpoint -> $OUT/checkpoint
   --save_steps 500
   --logging_steps 1
   --eval_steps 100
   --train_batch_size 4                               # changed: 256 -> 4
   --micro_train_batch_size 2                         # changed: 8 -> 2
   --pretrain "$PRM_MODEL"                            # changed: mistralai/Mistral-7B-v0.1 -> tiny model
   --bf16
   --max_epochs 1
   --max_len 128                                      # changed: 8192 -> 128 (tiny model)
   --zero_stage 3
   --learning_rate 1e-6
   --dataset "$DATA/math_shepherd.jsonl"              # changed: zhuzilin/Math-Shepherd -> tiny file
   --input_key input
   --label_key value
   --attn_implementation sdpa                         # changed: flash_attention_2 -> sdpa (flash-attn is GPU-only)
   --load_checkpoint
   --gradient_checkpointing
   --packing_samples
   --wandb_group prm
   --placeholder_token ки
   --reward_tokens + -
)
     # --use_wandb [WANDB_TOKENS] or True (use wandb login command)
     # --packing_samples


if [[ ${1} != "slurm" ]]; then
    python3 -m "${training_commands[@]}"             # changed: deepspeed --module (8 GPUs) -> one CPU process
fi
