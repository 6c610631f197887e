#!/bin/bash
# OpenRLHF's examples/python/vlm_multiturn_agent.py as its docstring runs it (train_ppo_ray with
# --train.agent_func_path, --data.image_key images, --data.max_images_per_prompt 4), on the flags of
# rlhfkit's copy of train_vlm_math_hybrid_engine.sh (dotted flags, OpenRLHF 2069b3f6), the agent instead of
# the reward_func. Adapted as a user would for one CPU: module renamed, tiny VLM/data, 1 CPU worker per role,
# sizes cut to one RL step; each changed line says so. Reads VLM_MODEL, DATA, OUT from the environment.

set -x

SCRIPT_DIR="$(dirname "$0")"
WORK_DIR=$(cd "$SCRIPT_DIR/../../.." && pwd)          # changed: ../.. -> ../../.. (this copy lives in tests/openrlhf_scripts/dotted)

MODEL_PATH="$VLM_MODEL"                                # changed: Qwen/Qwen3.5-0.8B -> tiny Qwen3-VL
DATASET_PATH="$DATA/geometry3k.jsonl"                  # changed: hiyouga/geometry3k -> tiny file with pictures
SAVE_PATH="$OUT/exp/Qwen3.5-0.8B-VLM-Agent"            # changed: ${WORK_DIR}/exp -> $OUT/exp
AGENT_PATH="$SCRIPT_DIR/../user_files/vlm_multiturn_agent.py"  # changed: examples/python/ -> rlhfkit's copy

args=(
   --ref.num_nodes 1
   --ref.num_gpus_per_node 1                          # changed: 4 GPUs -> 1 CPU worker
   --actor.num_nodes 1
   --actor.num_gpus_per_node 1                        # changed: 4 -> 1
   --vllm.num_engines 1                               # changed: 4 -> 1
   --vllm.tensor_parallel_size 1
   --train.colocate_all
   --vllm.gpu_memory_utilization 0.7
   --algo.kl.init_coef 0
   --algo.advantage.gamma 1.0
   --algo.kl.use_loss
   --algo.kl.estimator k2
   --algo.advantage.estimator reinforce_baseline
   --actor.model_name_or_path ${MODEL_PATH}
   --train.agent_func_path ${AGENT_PATH}              # changed: --reward.remote_url math_reward_func.py -> the agent (its docstring's command)
   --ckpt.output_dir ${SAVE_PATH}
   --eval.steps -1
   --train.micro_batch_size 1
   --rollout.micro_batch_size 1
   --train.batch_size 4                               # changed: 1024 -> 4
   --rollout.batch_size 2                             # changed: 128 -> 2
   --rollout.n_samples_per_prompt 2                   # changed: 8 -> 2
   --train.num_episodes 1                             # changed: 100 -> 1
   --data.max_len 256                                 # changed: 4096 -> 256 (the tiny model has 512 positions)
   --rollout.max_new_tokens 8                         # changed: 2048 -> 8
   --fsdp.param_dtype bf16
   --actor.adam.lr 2e-6
   --data.prompt_dataset ${DATASET_PATH}
   --data.input_key prompt
   --data.label_key label
   --data.image_key images
   --data.max_images_per_prompt 4                     # the agent docstring's value (prompt and screenshots)
   --actor.freeze_visual_encoder
   --data.apply_chat_template
   --actor.gradient_checkpointing_enable
   --fsdp.attn_implementation eager
   --vllm.sync_backend nccl
   --vllm.enforce_eager
   --vllm.enable_sleep
   --fsdp.enable_sleep
   --data.max_samples 2                               # changed: added (sizes: one RL step of the tiny file)
)

python3 -m rlhfkit.cli.train_ppo_ray "${args[@]}"     # changed: openrlhf -> rlhfkit; one command, flags in an array
