#!/usr/bin/env bash
# rlhfkit's copy of OpenRLHF examples/scripts/train_ppo_with_reward_fn.sh (flat flags, OpenRLHF cd7a434f): PPO
# with a Python reward_func file instead of a reward model. Adapted as a user would for one CPU: module renamed,
# tiny model/data, 1 CPU worker per role, sizes cut to one RL step; each changed line says so.
# Reads MODEL, REWARD_FUNC, DATA, OUT from the environment.

# /openrlhf/examples/scripts/reward_func.py
# import torch

# def reward_func(queries, prompts, labels):
#     # queries is prompts + responses
#     # labels is answers
#     print(queries)
#     return torch.randn(len(queries))

set -x

args=(
   --ref_num_nodes 1
   --ref_num_gpus_per_node 1                          # changed: 2 GPUs -> 1 CPU worker
   --critic_num_nodes 1
   --critic_num_gpus_per_node 1                       # changed: 2 -> 1
   --actor_num_nodes 1
   --actor_num_gpus_per_node 1                        # changed: 2 -> 1
   --vllm_num_engines 1                               # changed: 2 -> 1
   --vllm_tensor_parallel_size 1                      # changed: 2 -> 1
   --colocate_actor_ref
   --pretrain "$MODEL"                                # changed: OpenRLHF/Llama-3-8b-sft-mixture -> tiny model
   --remote_rm_url "$REWARD_FUNC"                     # changed: /openrlhf/examples/python/reward_func.py -> the user's file
   --save_path "$OUT/checkpoint/llama3-8b-rlhf"       # changed: /openrlhf/examples/checkpoint -> $OUT/checkpoint
   --micro_train_batch_size 2                         # changed: 8 -> 2
   --train_batch_size 4                               # changed: 128 -> 4
   --micro_rollout_batch_size 2                       # changed: 16 -> 2
   --rollout_batch_size 4                             # changed: 1024 -> 4
   --max_samples 4                                    # changed: 100000 -> 4 (one RL step)
   --max_epochs 1
   --prompt_max_len 64                                # changed: 1024 -> 64
   --generate_max_len 8                               # changed: 1024 -> 8
   --zero_stage 3
   --param_dtype bf16
   --actor_learning_rate 5e-7
   --critic_learning_rate 9e-6
   --init_kl_coef 0.01
   --prompt_data "$DATA/prompt_collection.jsonl"      # changed: OpenRLHF/prompt-collection-v0.1 -> tiny file
   --input_key context_messages
   --apply_chat_template
   --normalize_reward
   --packing_samples
   --adam_offload
   --attn_implementation sdpa                         # changed: flash_attention_2 -> sdpa (flash-attn is GPU-only)
   --gradient_checkpointing
   # --use_wandb {wandb_token}                        # changed: dropped (no wandb account offline)
)

python3 -m rlhfkit.cli.train_ppo_ray "${args[@]}"     # changed: ray job submit --address ... -- python3 -m openrlhf...
                                                      #   -> run directly (joins $RAY_ADDRESS, else a local Ray)
