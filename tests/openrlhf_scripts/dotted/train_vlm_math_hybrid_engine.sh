#!/bin/bash
# rlhfkit's copy of OpenRLHF examples/scripts/train_vlm_math_hybrid_engine.sh (dotted flags, OpenRLHF 2069b3f6):
# REINFORCE++-baseline on a vision-language model with a math reward_func, hybrid engine. Adapted as a user
# would for one CPU: module renamed, tiny VLM/data, 1 CPU worker per role, sizes cut to one RL step; each
# changed line says so. Reads VLM_MODEL, DATA, OUT from the environment.
# The dataset rows: {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": ...}]}],
#                    "images": ["geo/0.png"], "label": "46"}

set -x

SCRIPT_DIR="$(dirname "$0")"
WORK_DIR=$(cd "$SCRIPT_DIR/../../.." && pwd)          # changed: ../.. -> ../../.. (this copy lives in tests/openrlhf_scripts/dotted)

# Model and Dataset Configuration
MODEL_PATH="$VLM_MODEL"                                # changed: Qwen/Qwen3.5-2B -> tiny Qwen3-VL
DATASET_PATH="$DATA/geometry3k.jsonl"                  # changed: hiyouga/geometry3k -> tiny file with pictures
SAVE_PATH="$OUT/exp/Qwen3.5-2B-VLM-RLHF"               # changed: ${WORK_DIR}/exp -> $OUT/exp

# Math reward function for answer verification
REWARD_FUNC_PATH="${WORK_DIR}/examples/math_reward_func.py"   # changed: examples/python/ -> examples/

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
   --reward.remote_url ${REWARD_FUNC_PATH}
   --ckpt.output_dir ${SAVE_PATH}
   --ckpt.path "${SAVE_PATH}/ckpt"
   --ckpt.save_hf
   --ckpt.save_steps 5
   --eval.steps -1
   --train.micro_batch_size 1
   --rollout.micro_batch_size 1
   --train.batch_size 4                               # changed: 1024 -> 4
   --rollout.batch_size 2                             # changed: 128 -> 2
   --rollout.n_samples_per_prompt 2                   # changed: 8 -> 2
   --train.num_episodes 1                             # changed: 100 -> 1
   --data.max_len 128                                 # changed: 4096 -> 128 (the tiny model has 512 positions)
   --rollout.max_new_tokens 8                         # changed: 2048 -> 8
   --fsdp.param_dtype bf16
   --actor.adam.lr 2e-6
   --data.prompt_dataset ${DATASET_PATH}
   --data.input_key prompt
   --data.label_key label
   --data.image_key images
   --data.max_images_per_prompt 1
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
