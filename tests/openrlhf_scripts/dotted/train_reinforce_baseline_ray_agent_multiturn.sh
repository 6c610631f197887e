#!/usr/bin/env bash
# rlhfkit's copy of OpenRLHF examples/scripts/train_reinforce_baseline_ray_agent_multiturn.sh in the dotted
# spelling (the flat script with each flag renamed by OpenRLHF's flat -> dotted table): REINFORCE++-baseline
# with a multi-turn agent on the hybrid engine. Adapted as a user would for one CPU: module renamed, tiny
# model/data, 1 CPU worker, sizes cut; each changed line says so. The agent is rlhfkit's multi-turn guessing
# game (examples/agent_func_multiturn.py): OpenRLHF's file drives the GEM environments, which need the gem-llm
# package. Reads MODEL, DATA, OUT from the environment.
set -x

NUM_GPUS=${1:-1}                                      # changed: 8 -> 1 (CPU workers)
WORK_DIR=$(cd "$(dirname "$0")/../../.." && pwd)      # changed: added, to find the agent file below

# Please install gem from the following link
# pip install git+https://github.com/axon-rl/gem.git

export OPENRLHF_ASYNC_NUM_TASKS=128

args=(
   --ref.num_nodes 1
   --ref.num_gpus_per_node $((NUM_GPUS))
   --actor.num_nodes 1
   --actor.num_gpus_per_node $((NUM_GPUS))
   --vllm.num_engines $((NUM_GPUS))
   --vllm.tensor_parallel_size 1
   --train.colocate_all
   --train.agent_func_path "$WORK_DIR/examples/agent_func_multiturn.py"   # changed: /openrlhf/examples/python/agent_func_gem_multiturn.py
   --actor.model_name_or_path "$MODEL"                # changed: Qwen/Qwen3-1.7B -> tiny model
   --ckpt.output_dir "$OUT/checkpoint/llama3-8b-rlhf-rf_baseline"   # changed: /openrlhf/examples/test_scripts -> $OUT
   --vllm.gpu_memory_utilization 0.8
   --actor.adam.weight_decay 0.01
   --train.micro_batch_size 2                         # changed: 8 -> 2
   --train.batch_size 4                               # changed: 256 -> 4
   --rollout.micro_batch_size 2                       # changed: 16 -> 2
   --rollout.batch_size 2                             # changed: 128 -> 2
   --rollout.n_samples_per_prompt 2                   # changed: 16 -> 2
   --train.max_epochs 1
   --data.max_len 72                                  # changed: 11264 (1024 + 10240) -> 72 (tiny model)
   --rollout.max_new_tokens 8                         # changed: 10240 -> 8
   --data.max_samples 2                               # changed: 1000000 -> 2 (one RL step)
   --train.num_episodes 1                             # changed: 1000000 -> 1
   --ds.zero_stage 3
   --ds.param_dtype bf16
   --actor.adam.lr 5e-7
   --algo.advantage.estimator reinforce_baseline
   --algo.kl.init_coef 0
   --algo.kl.estimator k2
   --data.prompt_dataset "$DATA/guess_game.jsonl"     # changed: OpenRLHF/gem_guess_game -> tiny file
   --data.input_key query
   --data.label_key label
   --reward.normalize_enable
   --vllm.enable_sleep
   --train.dynamic_batch_enable
   --ds.enable_sleep
   --actor.gradient_checkpointing_enable
   --ds.packing_samples
   --ckpt.save_steps -1
   --vllm.enforce_eager
   --actor.eps_clip_low_high 0.2 0.28
   --vllm.enable_prefix_caching
   --rollout.top_p 0.98
   --algo.advantage.is_correction_enable
)

python3 -m rlhfkit.cli.train_ppo_ray "${args[@]}"     # changed: ray job submit --address ... -- python3 -m openrlhf...
                                                      #   -> run directly (joins $RAY_ADDRESS, else a local Ray)

   # --algo.dynamic_filtering_enable \
   # --ckpt.load_enable \
   # --ckpt.save_steps 2 \
   # --ckpt.path /openrlhf/examples/test_scripts/checkpoint/llama3-8b-rlhf-reinforce
