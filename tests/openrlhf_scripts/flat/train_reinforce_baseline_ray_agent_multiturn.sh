#!/usr/bin/env bash
# rlhfkit's copy of OpenRLHF examples/scripts/train_reinforce_baseline_ray_agent_multiturn.sh (flat flags,
# OpenRLHF 9f164420): REINFORCE++-baseline with a multi-turn agent on the hybrid engine. Adapted as a user would
# for one CPU: module renamed, tiny model/data, 1 CPU worker, sizes cut; each changed line says so. The agent
# is rlhfkit's multi-turn guessing game (examples/agent_func_multiturn.py): OpenRLHF's file drives the GEM
# environments, which need the gem-llm package. Reads MODEL, DATA, OUT from the environment.
set -x

NUM_GPUS=${1:-1}                                      # changed: 8 -> 1 (CPU workers)
WORK_DIR=$(cd "$(dirname "$0")/../../.." && pwd)      # changed: added, to find the agent file below

# Please install gem from the following link
# pip install git+https://github.com/axon-rl/gem.git

export OPENRLHF_ASYNC_NUM_TASKS=128

args=(
   --ref_num_nodes 1
   --ref_num_gpus_per_node $((NUM_GPUS))
   --actor_num_nodes 1
   --actor_num_gpus_per_node $((NUM_GPUS))
   --vllm_num_engines $((NUM_GPUS))
   --vllm_tensor_parallel_size 1
   --colocate_all_models
   --agent_func_path "$WORK_DIR/examples/agent_func_multiturn.py"   # changed: /openrlhf/examples/python/agent_func_gem_multiturn.py
   --pretrain "$MODEL"                                # changed: Qwen/Qwen3-1.7B -> tiny model
   --save_path "$OUT/checkpoint/llama3-8b-rlhf-rf_baseline"   # changed: /openrlhf/examples/test_scripts -> $OUT
   --vllm_gpu_memory_utilization 0.8
   --l2 0.01
   --micro_train_batch_size 2                         # changed: 8 -> 2
   --train_batch_size 4                               # changed: 256 -> 4
   --micro_rollout_batch_size 2                       # changed: 16 -> 2
   --rollout_batch_size 2                             # changed: 128 -> 2
   --n_samples_per_prompt 2                           # changed: 16 -> 2
   --max_epochs 1
   --prompt_max_len 64                                # changed: 1024 -> 64
   --max_samples 2                                    # changed: 1000000 -> 2 (one RL step)
   --num_episodes 1                                   # changed: 1000000 -> 1
   --generate_max_len 8                               # changed: 10240 -> 8
   --zero_stage 3
   --bf16
   --actor_learning_rate 5e-7
   --advantage_estimator reinforce_baseline
   --init_kl_coef 0
   --kl_estimator k2
   --prompt_data "$DATA/guess_game.jsonl"             # changed: OpenRLHF/gem_guess_game -> tiny file
   --input_key query
   --label_key label
   --normalize_reward
   --vllm_enable_sleep
   --use_dynamic_batch
   --deepspeed_enable_sleep
   --gradient_checkpointing
   --packing_samples
   --save_steps -1
   --enforce_eager
   --eps_clip_low_high 0.2 0.28
   --enable_prefix_caching
   --top_p 0.98
   --enable_vllm_is_correction
)

python3 -m rlhfkit.cli.train_ppo_ray "${args[@]}"     # changed: ray job submit --address ... -- python3 -m openrlhf...
                                                      #   -> run directly (joins $RAY_ADDRESS, else a local Ray)

   # --dynamic_filtering \
   # --load_checkpoint \
   # --save_steps 2 \
   # --ckpt_path /openrlhf/examples/test_scripts/checkpoint/llama3-8b-rlhf-reinforce
