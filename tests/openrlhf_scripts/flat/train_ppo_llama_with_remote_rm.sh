#!/usr/bin/env bash
# rlhfkit's copy of OpenRLHF examples/scripts/train_ppo_llama_with_remote_rm.sh (flat flags, OpenRLHF a58221c9):
# PPO whose reward comes from serve_rm over HTTP (serve_remote_rm.sh, started first). Adapted as a user would
# for one CPU: module renamed, tiny model/data, 1 CPU worker per role, sizes cut to one RL step; each changed
# line says so. Reads MODEL, RM_PORT, DATA, OUT from the environment.
set -x

# python -m openrlhf.cli.serve_rm \
#     --reward_pretrain OpenRLHF/Llama-3-8b-rm-700k \
#     --port 5000 \
#     --bf16 \
#     --flash_attn \
#     --normalize_reward \
#     --max_len 8192 \
#     --batch_size 16

args=(
   --ref_num_nodes 1
   --ref_num_gpus_per_node 1                          # changed: 2 GPUs -> 1 CPU worker
   --reward_num_nodes 1
   --reward_num_gpus_per_node 1                       # changed: 2 -> 1
   --critic_num_nodes 1
   --critic_num_gpus_per_node 1                       # changed: 2 -> 1
   --actor_num_nodes 1
   --actor_num_gpus_per_node 1                        # changed: 2 -> 1
   --vllm_num_engines 1                               # changed: 2 -> 1
   --vllm_tensor_parallel_size 1                      # changed: 2 -> 1
   --colocate_actor_ref
   --pretrain "$MODEL"                                # changed: OpenRLHF/Llama-3-8b-sft-mixture -> tiny model
   --remote_rm_url "http://localhost:$RM_PORT/get_reward"   # changed: port 5000 -> the server's free port
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
   --bf16
   --actor_learning_rate 5e-7
   --critic_learning_rate 9e-6
   --init_kl_coef 0.01
   --prompt_data "$DATA/prompt_collection.jsonl"      # changed: OpenRLHF/prompt-collection-v0.1 -> tiny file
   --input_key context_messages
   --apply_chat_template
   --normalize_reward
   --adam_offload
   # --flash_attn                                     # changed: dropped, flash-attn is GPU-only (sdpa is the default)
   --gradient_checkpointing
   # --use_wandb {wandb_token}                        # changed: dropped (no wandb account offline)
)

python3 -m rlhfkit.cli.train_ppo_ray "${args[@]}"     # changed: ray job submit --address ... -- python3 -m openrlhf...
                                                      #   -> run directly (joins $RAY_ADDRESS, else a local Ray)
