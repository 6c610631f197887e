#!/bin/bash
# rlhfkit's copy of OpenRLHF examples/scripts/train_prorlv2_math_hybrid_engine.sh (flat flags, OpenRLHF
# 160b08e4), adapted as a user would for one CPU: module renamed, tiny model/data, 1 CPU worker, sizes cut;
# each changed line says so. The reward is OpenRLHF's math_reward_func.py as the project ships it
# (examples/math_reward_func.py). Reads MODEL, DATA, OUT from the environment.
# ProRL v2: Prolonged Reinforcement Learning for LLM Reasoning
# Reference: https://developer.nvidia.com/blog/scaling-llm-reinforcement-learning-with-prolonged-training-using-prorl-v2/
#
# Key techniques:
# - REINFORCE++-baseline with batch advantage normalization
# - Clip-Higher (--eps_clip_low_high 0.2 0.27) for exploration
# - Dynamic Sampling (--dynamic_filtering) to reduce noise
# - KL-regularized trust regions (--use_kl_loss --kl_estimator k2)
# - ICEPOP (--use_icepop) for importance sampling correction
# - Stop Properly Penalty (--stop_properly_penalty_coef) for truncated samples

set -x

SCRIPT_DIR="$(dirname "$0")"
WORK_DIR=$(cd "$SCRIPT_DIR/../../.." && pwd)          # changed: ../.. -> ../../.. (this copy lives in tests/openrlhf_scripts/flat)

# Model and Dataset Configuration
MODEL_PATH="$MODEL"                                    # changed: deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B -> tiny model
DATASET_PATH="$DATA/math.jsonl"                        # changed: OpenRLHF/dapo-math-17k -> tiny file
SAVE_PATH="$OUT/exp/DeepSeek-R1-Qwen-1.5B-PRORLV2"     # changed: ${WORK_DIR}/exp -> $OUT/exp

# Math reward function for answer verification
REWARD_FUNC_PATH="${WORK_DIR}/examples/math_reward_func.py"   # changed: examples/python/ -> examples/

args=(
   --ref_num_nodes 1
   --ref_num_gpus_per_node 1                          # changed: 8 GPUs -> 1 CPU worker
   --actor_num_nodes 1
   --actor_num_gpus_per_node 1                        # changed: 8 -> 1
   --vllm_num_engines 1                               # changed: 8 -> 1
   --vllm_tensor_parallel_size 1
   --colocate_all_models
   --vllm_gpu_memory_utilization 0.75
   --init_kl_coef 1e-4
   --gamma 1.0
   --use_kl_loss
   --kl_estimator k2
   --advantage_estimator reinforce_baseline
   --dynamic_filtering
   --dynamic_filtering_reward_range 0 1
   --eps_clip_low_high 0.2 0.27
   --pretrain ${MODEL_PATH}
   --remote_rm_url ${REWARD_FUNC_PATH}
   --save_path ${SAVE_PATH}
   --ckpt_path "${SAVE_PATH}/ckpt"
   --save_steps 5
   --save_hf_ckpt
   --train_batch_size 4                               # changed: 1024 -> 4
   --rollout_batch_size 2                             # changed: 512 -> 2
   --n_samples_per_prompt 2                           # changed: 16 -> 2
   --use_dynamic_batch
   --num_episodes 1                                   # changed: 100 -> 1
   --prompt_max_len 64                                # changed: 1024 -> 64
   --generate_max_len 8                               # changed: 8192 -> 8
   --zero_stage 3
   --param_dtype bf16
   --actor_learning_rate 1e-6
   --prompt_data ${DATASET_PATH}
   --input_key prompt
   --label_key label
   --eval_dataset "$DATA/math.jsonl"                  # changed: OpenRLHF/aime-2024 -> tiny file
   --eval_steps 5
   --eval_temperature 1.0
   --eval_n_samples_per_prompt 4
   --apply_chat_template
   --gradient_checkpointing
   --packing_samples
   --vllm_sync_backend nccl
   --enforce_eager
   --vllm_enable_sleep
   --deepspeed_enable_sleep
   --enable_vllm_is_correction
   --vllm_is_truncated_threshold 0.5 5.0
   --use_icepop
   --train_max_tokens_per_gpu 32768
   --stop_properly_penalty_coef 0.0
   --max_samples 4                                    # changed: added (sizes: 4 of the tiny file's prompts)
)

python3 -m rlhfkit.cli.train_ppo_ray "${args[@]}"     # changed: openrlhf -> rlhfkit
