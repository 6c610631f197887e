#!/bin/bash
# rlhfkit's copy of OpenRLHF examples/scripts/train_reinforce_baseline_hybrid_engine.sh (flat flags, OpenRLHF
# 0b08e353, its FSDP2-era version: --fsdp2_enable_sleep, no --zero_stage): REINFORCE++-baseline with an agent
# file, dynamic filtering and dynamic batches on the hybrid engine. Adapted as a user would for a CPU: module
# renamed, tiny model/data, 2 CPU workers (a ring of 2), sizes cut; each changed line says so. Reads MODEL,
# AGENT_FUNC, DATA, OUT from the environment.

SCRIPT_DIR="$(dirname "$0")"
WORK_DIR=$(cd "$SCRIPT_DIR/../../.." && pwd)          # changed: ../.. -> ../../.. (this copy lives in tests/openrlhf_scripts/flat)

set -x

MODEL_PATH="$MODEL"                                    # changed: Qwen/Qwen3-4B-Thinking-2507 -> tiny model
DATASET_PATH="$DATA/math.jsonl"                        # changed: zhuzilin/dapo-math-17k -> tiny file
SAVE_PATH="$OUT/exp/Qwen3-4B-Thinking"                 # changed: ${WORK_DIR}/exp -> $OUT/exp

# For test
AGENT_FUNC_PATH="$AGENT_FUNC"                          # changed: examples/python/agent_func.py -> the user's agent file

# For demo
# git clone https://github.com/Freder-chen/OpenRLHF-Agent.git
# cd OpenRLHF-Agent && pip install -e .
# AGENT_FUNC_PATH="{OpenRLHF-Agent/examples/single_turn/agent_func.py}"

CKPT_ARGS=(
   --pretrain ${MODEL_PATH}
   # --reward_pretrain ${REWARD_MODEL}
   --load_checkpoint

   --save_path ${SAVE_PATH}
   --ckpt_path "${SAVE_PATH}/ckpt"
   --save_hf_ckpt
   --max_ckpt_num 3
   --save_steps 10
)

ROLLOUT_ARGS=(
   --agent_func_path ${AGENT_FUNC_PATH}
   # --remote_rm_url ${REWARD_FUNC_FILENAME}

   --prompt_data ${DATASET_PATH}
   --input_key prompt
   --label_key label
   --prompt_max_len 64                                # changed: 10240 -> 64
   --generate_max_len 8                               # changed: 64000 -> 8
   --apply_chat_template
   --packing_samples

   --rollout_batch_size 2                             # changed: 128 -> 2
   --n_samples_per_prompt 2                           # changed: 8 -> 2
   --train_batch_size 4                               # changed: 1024 -> 4
   --dynamic_filtering
   --dynamic_filtering_reward_range 0.0 1.0

   --use_dynamic_batch
   --train_max_tokens_per_gpu 16192
   --rollout_max_tokens_per_gpu 32768

   --micro_train_batch_size 1
   --micro_rollout_batch_size 2                       # changed: 8 -> 2
   --max_samples 4                                    # changed: 128000 -> 4
   --max_epochs 1
   --num_episodes 1
)

ENGINE_ARGS=(
   --ref_num_nodes 1
   --ref_num_gpus_per_node 2                          # changed: 4 GPUs -> 2 CPU workers
   --actor_num_nodes 1
   --actor_num_gpus_per_node 2                        # changed: 4 -> 2
   --vllm_num_engines 1                               # changed: 2 -> 1 (actor workers = engines x TP)
   --vllm_tensor_parallel_size 2
   --vllm_gpu_memory_utilization 0.7
   --colocate_all_models
   --fsdp2_enable_sleep
   --vllm_sync_backend nccl
   --enforce_eager
   --gradient_checkpointing
   --ring_attn_size 2
   --ring_head_stride 2
   --param_dtype bf16
)

OPTIMIZER_ARGS=(
   --advantage_estimator reinforce_baseline
   --actor_learning_rate 5e-7
   # --critic_learning_rate 9e-6
   --entropy_loss_coef 0.0
   --init_kl_coef 1e-5
   --use_kl_loss
   --kl_estimator k2
   --enable_vllm_is_correction
   --vllm_is_correction_type icepop
)

LOG_ARGS=(
   --use_tensorboard ${SAVE_PATH}/runs
   --logging_steps 1
   --eval_steps -1
)

python3 -m rlhfkit.cli.train_ppo_ray \
   ${CKPT_ARGS[@]} \
   ${ROLLOUT_ARGS[@]} \
   ${ENGINE_ARGS[@]} \
   ${OPTIMIZER_ARGS[@]} \
   ${LOG_ARGS[@]}
# changed (the command above): ray job submit --address="http://127.0.0.1:8265" -- python3 -m openrlhf.cli.train_ppo_ray
#   -> python3 -m rlhfkit.cli.train_ppo_ray, run directly (joins $RAY_ADDRESS, else a local Ray)
