#!/usr/bin/env bash
# rlhfkit's copy of OpenRLHF examples/scripts/train_ppo_llama_ray_tensor_parallelism.sh (flat flags, OpenRLHF
# 45de3db2): PPO with every model colocated, engines asleep between phases, and DeepSpeed AutoTP training, here
# --ds_tensor_parallel_size 2 on FSDP2 for the actor, reference, critic and reward model. Adapted as a user would
# for a CPU: module renamed, tiny models/data (vocabulary padded to 104, so 2 divides it), 2 CPU workers per role
# (one tensor-parallel pair each) and one engine of tensor parallel 2 on them, sizes cut to one RL step; each
# changed line says so. Reads TP_MODEL, TP_RM_MODEL, DATA, OUT from the environment.
set -x

args=(
   --ref_num_nodes 1
   --ref_num_gpus_per_node 2                          # changed: 8 GPUs -> 2 CPU workers
   --reward_num_nodes 1
   --reward_num_gpus_per_node 2                       # changed: 8 -> 2
   --critic_num_nodes 1
   --critic_num_gpus_per_node 2                       # changed: 8 -> 2
   --actor_num_nodes 1
   --actor_num_gpus_per_node 2                        # changed: 8 -> 2
   --vllm_num_engines 1                               # changed: 4 -> 1 (actor workers = engines x TP)
   --vllm_tensor_parallel_size 2
   --colocate_all_models
   --vllm_gpu_memory_utilization 0.5
   --pretrain "$TP_MODEL"                             # changed: OpenRLHF/Llama-3-8b-sft-mixture -> tiny model
   --reward_pretrain "$TP_RM_MODEL"                   # changed: OpenRLHF/Llama-3-8b-rm-700k -> tiny RM
   --save_path "$OUT/final/llama3-8b-rlhf"            # changed: /openrlhf/examples/test_scripts -> $OUT
   --ckpt_path "$OUT/ckpt/llama3-8b-rlhf"             # changed: /openrlhf/examples/test_scripts -> $OUT
   --save_hf_ckpt
   --micro_train_batch_size 2                         # changed: 8 -> 2
   --train_batch_size 4                               # changed: 128 -> 4
   --micro_rollout_batch_size 2                       # changed: 16 -> 2
   --rollout_batch_size 4                             # changed: 1024 -> 4
   --n_samples_per_prompt 1
   --max_epochs 1
   --prompt_max_len 64                                # changed: 1024 -> 64
   --max_samples 4                                    # changed: 100000 -> 4 (one RL step)
   --generate_max_len 8                               # changed: 1024 -> 8
   --zero_stage 2
   --bf16
   --actor_learning_rate 5e-7
   --critic_learning_rate 9e-6
   --init_kl_coef 0.01
   --prompt_data "$DATA/prompt_collection.jsonl"      # changed: OpenRLHF/prompt-collection-v0.1 -> tiny file
   --input_key context_messages
   --apply_chat_template
   --normalize_reward
   --gradient_checkpointing
   --packing_samples
   --vllm_sync_backend nccl
   --enforce_eager
   --vllm_enable_sleep
   --ds_tensor_parallel_size 2
   --adam_offload
)

python3 -m rlhfkit.cli.train_ppo_ray "${args[@]}"     # changed: ray job submit --address ... -- python3 -m openrlhf...
                                                      #   -> run directly (joins $RAY_ADDRESS, else a local Ray)
