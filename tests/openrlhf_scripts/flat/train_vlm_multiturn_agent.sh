#!/bin/bash
# OpenRLHF's examples/python/vlm_multiturn_agent.py as its docstring runs it (train_ppo_ray with the agent
# file, --image_key images, --max_images_per_prompt 4), on the flags of rlhfkit's copy of
# train_vlm_math_hybrid_engine.sh (flat flags, OpenRLHF e195d7cc), the agent instead of the reward_func.
# Adapted as a user would for one CPU: module renamed, tiny VLM/data, 1 CPU worker per role, sizes cut to
# one RL step; each changed line says so. Reads VLM_MODEL, DATA, OUT from the environment.

set -x

SCRIPT_DIR="$(dirname "$0")"
WORK_DIR=$(cd "$SCRIPT_DIR/../../.." && pwd)          # changed: ../.. -> ../../.. (this copy lives in tests/openrlhf_scripts/flat)

MODEL_PATH="$VLM_MODEL"                                # changed: Qwen/Qwen3.5-0.8B -> tiny Qwen3-VL
DATASET_PATH="$DATA/geometry3k.jsonl"                  # changed: hiyouga/geometry3k -> tiny file with pictures
SAVE_PATH="$OUT/exp/Qwen3.5-0.8B-VLM-Agent"            # changed: ${WORK_DIR}/exp -> $OUT/exp
AGENT_PATH="$SCRIPT_DIR/../user_files/vlm_multiturn_agent.py"  # changed: examples/python/ -> rlhfkit's copy

args=(
   --ref_num_nodes 1
   --ref_num_gpus_per_node 1                          # changed: 4 GPUs -> 1 CPU worker
   --actor_num_nodes 1
   --actor_num_gpus_per_node 1                        # changed: 4 -> 1
   --vllm_num_engines 1                               # changed: 4 -> 1
   --vllm_tensor_parallel_size 1
   --colocate_all_models
   --vllm_gpu_memory_utilization 0.7
   --init_kl_coef 0
   --gamma 1.0
   --use_kl_loss
   --kl_estimator k2
   --advantage_estimator reinforce_baseline
   --pretrain ${MODEL_PATH}
   --agent_func_path ${AGENT_PATH}                    # changed: --remote_rm_url math_reward_func.py -> the agent (its docstring's command)
   --save_path ${SAVE_PATH}
   --eval_steps -1
   --micro_train_batch_size 1
   --micro_rollout_batch_size 1
   --train_batch_size 4                               # changed: 1024 -> 4
   --rollout_batch_size 2                             # changed: 128 -> 2
   --n_samples_per_prompt 2                           # changed: 8 -> 2
   --num_episodes 1                                   # changed: 100 -> 1
   --max_len 256                                      # changed: 4096 -> 256 (the tiny model has 512 positions)
   --max_new_tokens 8                                 # changed: 2048 -> 8
   --zero_stage 3
   --param_dtype bf16
   --actor_learning_rate 2e-6
   --prompt_data ${DATASET_PATH}
   --input_key prompt
   --label_key label
   --image_key images
   --max_images_per_prompt 4                          # the agent docstring's value (prompt and screenshots)
   --freeze_visual_encoder
   --apply_chat_template
   --gradient_checkpointing
   --attn_implementation eager
   --vllm_sync_backend nccl
   --enforce_eager
   --vllm_enable_sleep
   --deepspeed_enable_sleep
   --max_samples 2                                    # changed: added (sizes: one RL step of the tiny file)
)

python3 -m rlhfkit.cli.train_ppo_ray "${args[@]}"     # changed: openrlhf -> rlhfkit; one command, flags in an array
