#!/usr/bin/env bash
# rlhfkit's copy of OpenRLHF examples/scripts/train_dapo_ray_hybrid_engine.sh (flat flags, OpenRLHF 34ba2900):
# DAPO-style GRPO (group_norm, clip-higher, dynamic sampling, KL loss) on the hybrid engine. That version's
# --vllm_enable_is_correction (a name OpenRLHF's parser never had) is written --enable_vllm_is_correction, as in
# OpenRLHF's other scripts. Adapted as a user would for one CPU: module renamed, tiny model/data, 1 CPU worker,
# sizes cut; each changed line says so. Reads MODEL, REWARD_FUNC, DATA, OUT from the environment.
set -x

args=(
   --ref_num_nodes 1
   --ref_num_gpus_per_node 1                          # changed: 8 GPUs -> 1 CPU worker
   --actor_num_nodes 1
   --actor_num_gpus_per_node 1                        # changed: 8 -> 1
   --vllm_num_engines 1                               # changed: 4 -> 1 (actor workers = engines x TP)
   --vllm_tensor_parallel_size 1                      # changed: 2 -> 1
   --colocate_all_models
   --vllm_gpu_memory_utilization 0.6
   --init_kl_coef 1e-3
   --gamma 1.0
   --use_kl_loss
   --kl_estimator k3
   --advantage_estimator group_norm
   --dynamic_filtering
   --dynamic_filtering_reward_range 0 1
   --eps_clip_low_high 0.2 0.27
   --pretrain "$MODEL"                                # changed: OpenRLHF/Llama-3-8b-sft-mixture -> tiny model
   --remote_rm_url "$REWARD_FUNC"                     # changed: /openrlhf/examples/python/reward_func.py -> the user's file
   --save_path "$OUT/final/llama3-8b-rlhf"            # changed: /openrlhf/examples/test_scripts/... -> $OUT
   --ckpt_path "$OUT/ckpt/llama3-8b-rlhf"             # changed: path
   --save_steps 20
   --save_hf_ckpt
   --micro_train_batch_size 2                         # changed: 8 -> 2
   --train_batch_size 4                               # changed: 128 -> 4
   --micro_rollout_batch_size 2                       # changed: 16 -> 2
   --rollout_batch_size 2                             # changed: 128 -> 2
   --n_samples_per_prompt 2                           # changed: 8 -> 2
   --max_epochs 1
   --prompt_max_len 64                                # changed: 1024 -> 64
   --max_samples 4                                    # changed: 20000 -> 4
   --generate_max_len 8                               # changed: 1024 -> 8
   --zero_stage 3
   --bf16
   --actor_learning_rate 5e-7
   --prompt_data "$DATA/prompt_collection.jsonl"      # changed: OpenRLHF/prompt-collection-v0.1 -> tiny file
   --input_key context_messages
   --apply_chat_template
   --gradient_checkpointing
   --packing_samples
   --vllm_sync_backend nccl
   --enforce_eager
   --vllm_enable_sleep
   --deepspeed_enable_sleep
   --enable_vllm_is_correction
)

python3 -m rlhfkit.cli.train_ppo_ray "${args[@]}"     # changed: openrlhf -> rlhfkit

# You could also try
#   --kl_estimator k2 \
