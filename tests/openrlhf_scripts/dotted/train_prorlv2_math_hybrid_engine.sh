#!/bin/bash
# rlhfkit's copy of OpenRLHF examples/scripts/train_prorlv2_math_hybrid_engine.sh (dotted flags, OpenRLHF after
# ed62d0e2), adapted as a user would for one CPU: module renamed, tiny model/data, 1 CPU worker, sizes cut;
# each changed line says so. The reward is OpenRLHF's math_reward_func.py as the project ships it
# (examples/math_reward_func.py). Reads MODEL, DATA, OUT from the environment.
# ProRL v2: Prolonged Reinforcement Learning for LLM Reasoning
# Reference: https://developer.nvidia.com/blog/scaling-llm-reinforcement-learning-with-prolonged-training-using-prorl-v2/

set -x

SCRIPT_DIR="$(dirname "$0")"
WORK_DIR=$(cd "$SCRIPT_DIR/../../.." && pwd)          # changed: ../.. -> ../../.. (this copy lives in tests/openrlhf_scripts/dotted)

# Model and Dataset Configuration
MODEL_PATH="$MODEL"                                    # changed: deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B -> tiny model
DATASET_PATH="$DATA/math.jsonl"                        # changed: OpenRLHF/dapo-math-17k -> tiny file
SAVE_PATH="$OUT/exp/DeepSeek-R1-Qwen-1.5B-PRORLV2"     # changed: ${WORK_DIR}/exp -> $OUT/exp

# Math reward function for answer verification
REWARD_FUNC_PATH="${WORK_DIR}/examples/math_reward_func.py"   # changed: examples/python/ -> examples/

args=(
   --ref.num_nodes 1
   --ref.num_gpus_per_node 1                          # changed: 8 GPUs -> 1 CPU worker
   --actor.num_nodes 1
   --actor.num_gpus_per_node 1                        # changed: 8 -> 1
   --vllm.num_engines 1                               # changed: 8 -> 1
   --vllm.tensor_parallel_size 1
   --train.colocate_all
   --vllm.gpu_memory_utilization 0.75
   --algo.kl.init_coef 1e-4
   --algo.advantage.gamma 1.0
   --algo.kl.use_loss
   --algo.kl.estimator k2
   --algo.advantage.estimator reinforce_baseline
   --algo.dynamic_filtering_enable
   --algo.dynamic_filtering_range 0 1
   --actor.eps_clip_low_high 0.2 0.27
   --actor.model_name_or_path ${MODEL_PATH}
   --reward.remote_url ${REWARD_FUNC_PATH}
   --ckpt.output_dir ${SAVE_PATH}
   --ckpt.path "${SAVE_PATH}/ckpt"
   --ckpt.save_steps 5
   --ckpt.save_hf
   --train.batch_size 4                               # changed: 1024 -> 4
   --rollout.batch_size 2                             # changed: 512 -> 2
   --rollout.n_samples_per_prompt 2                   # changed: 16 -> 2
   --train.dynamic_batch_enable
   --train.num_episodes 1                             # changed: 100 -> 1
   --data.max_len 72                                  # changed: 9216 -> 72 (tiny model; prompts ~25 tokens)
   --rollout.max_new_tokens 8                         # changed: 8192 -> 8
   --ds.zero_stage 3
   --ds.param_dtype bf16
   --actor.adam.lr 1e-6
   --data.prompt_dataset ${DATASET_PATH}
   --data.input_key prompt
   --data.label_key label
   --eval.dataset "$DATA/math.jsonl"                  # changed: OpenRLHF/aime-2024 -> tiny file
   --eval.steps 5
   --eval.temperature 1.0
   --eval.n_samples_per_prompt 4
   --data.apply_chat_template
   --actor.gradient_checkpointing_enable
   --ds.packing_samples
   --vllm.sync_backend nccl
   --vllm.enforce_eager
   --vllm.enable_sleep
   --ds.enable_sleep
   --algo.advantage.is_correction_enable
   --algo.advantage.is_correction_threshold 0.5 5.0
   --algo.advantage.is_correction_type icepop
   --train.max_tokens_per_gpu 32768
   --reward.stop_properly_penalty_coef 0.0
   --data.max_samples 4                               # changed: added (sizes: 4 of the tiny file's prompts)
)

python3 -m rlhfkit.cli.train_ppo_ray "${args[@]}"     # changed: openrlhf -> rlhfkit
