#!/usr/bin/env bash
# rlhfkit's copy of OpenRLHF examples/scripts/train_ppo_llama.sh (flat flags, OpenRLHF ab89f6b8; the
# DeepSpeed-launched train_ppo, removed from OpenRLHF in 2025, so there is no dotted version), adapted as a user
# would for one CPU: module renamed, tiny models/data, sizes cut to one RL step; each changed line says so.
# Reads MODEL, RM_MODEL, DATA, OUT from the environment.
set -x

training_commands=(
   rlhfkit.cli.train_ppo                              # changed: openrlhf -> rlhfkit
   --pretrain "$MODEL"                                # changed: OpenRLHF/Llama-3-8b-sft-mixture -> tiny model
   --reward_pretrain "$RM_MODEL"                      # changed: OpenRLHF/Llama-3-8b-rm-mixture -> tiny RM
   --save_path "$OUT/checkpoint/llama-3-8b-rlhf"      # changed: ./checkpoint -> $OUT/checkpoint
   --save_steps -1
   --logging_steps 1
   --eval_steps -1
   --micro_train_batch_size 2
   --train_batch_size 4                               # changed: 128 -> 4
   --micro_rollout_batch_size 4
   --rollout_batch_size 4                             # changed: 1024 -> 4
   --max_epochs 1
   --prompt_max_len 64                                # changed: 1024 -> 64
   --generate_max_len 8                               # changed: 1024 -> 8
   --zero_stage 2
   --bf16
   --actor_learning_rate 5e-7
   --critic_learning_rate 9e-6
   --init_kl_coef 0.01
   --prompt_data "$DATA/prompt_collection.jsonl"      # changed: OpenRLHF/prompt-collection-v0.1 -> tiny file
   --input_key context_messages
   --apply_chat_template
   --max_samples 4                                    # changed: 100000 -> 4 (one RL step)
   --normalize_reward
   --adam_offload
   # --flash_attn                                     # changed: dropped, flash-attn is GPU-only (sdpa is the default)
   --load_checkpoint
   --gradient_checkpointing
)
    # --use_wandb [WANDB_TOKENS] or True (use wandb login command)
    # --remote_rm_url http://localhost:5000/get_reward

if [[ ${1} != "slurm" ]]; then
    python3 -m "${training_commands[@]}"             # changed: deepspeed --module (8 GPUs) -> one CPU process
fi
