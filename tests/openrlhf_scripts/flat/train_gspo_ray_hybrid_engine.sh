#!/usr/bin/env bash
# rlhfkit's copy of OpenRLHF examples/scripts/train_gspo_ray_hybrid_engine.sh (flat flags, OpenRLHF 5872f0c3):
# GSPO (sequence-level ratio) with group_norm advantages and a reward model, no reference model. Adapted as a
# user would for one CPU: module renamed, tiny model/data, 1 CPU worker per role, sizes cut to one RL step;
# each changed line says so. Reads MODEL, RM_MODEL, DATA, OUT from the environment.
set -x

args=(
   --ref_num_nodes 1
   --ref_num_gpus_per_node 1                          # changed: 8 GPUs -> 1 CPU worker
   --reward_num_nodes 1
   --reward_num_gpus_per_node 1                       # changed: 8 -> 1
   --actor_num_nodes 1
   --actor_num_gpus_per_node 1                        # changed: 8 -> 1
   --vllm_num_engines 1                               # changed: 4 -> 1 (actor workers = engines x TP)
   --vllm_tensor_parallel_size 1                      # changed: 2 -> 1
   --colocate_all_models
   --vllm_gpu_memory_utilization 0.6
   --policy_loss_type gspo
   --advantage_estimator group_norm
   --gamma 1.0
   --init_kl_coef 0
   --pretrain "$MODEL"                                # changed: OpenRLHF/Llama-3-8b-sft-mixture -> tiny model
   --reward_pretrain "$RM_MODEL"                      # changed: OpenRLHF/Llama-3-8b-rm-700k -> tiny RM
   --save_path "$OUT/final/llama3-8b-gspo"            # changed: /openrlhf/examples/test_scripts/... -> $OUT
   --ckpt_path "$OUT/ckpt/llama3-8b-gspo"             # changed: path
   --save_hf_ckpt
   --micro_train_batch_size 2                         # changed: 8 -> 2
   --train_batch_size 4                               # changed: 128 -> 4
   --micro_rollout_batch_size 2                       # changed: 16 -> 2
   --rollout_batch_size 2                             # changed: 128 -> 2
   --n_samples_per_prompt 2                           # changed: 8 -> 2
   --max_epochs 1
   --prompt_max_len 64                                # changed: 1024 -> 64
   --max_samples 2                                    # changed: 100000 -> 2 (one RL step)
   --generate_max_len 8                               # changed: 1024 -> 8
   --zero_stage 3
   --bf16
   --actor_learning_rate 5e-7
   --critic_learning_rate 9e-6
   --prompt_data "$DATA/prompt_collection.jsonl"      # changed: OpenRLHF/prompt-collection-v0.1 -> tiny file
   --input_key context_messages
   --apply_chat_template
   --normalize_reward
   --gradient_checkpointing
   --packing_samples
   --vllm_sync_backend nccl
   --enforce_eager
   --vllm_enable_sleep
   --deepspeed_enable_sleep
)

python3 -m rlhfkit.cli.train_ppo_ray "${args[@]}"     # changed: openrlhf -> rlhfkit

# Notes:
# - GSPO uses sequence-level clipping; group_norm advantages require n_samples_per_prompt > 1.
# - Set --init_kl_coef > 0 to enable reference model KL shaping if desired.
