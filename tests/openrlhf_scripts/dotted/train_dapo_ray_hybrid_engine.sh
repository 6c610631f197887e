#!/usr/bin/env bash
# rlhfkit's copy of OpenRLHF examples/scripts/train_dapo_ray_hybrid_engine.sh (dotted flags, OpenRLHF after
# ed62d0e2): DAPO-style GRPO (group_norm, clip-higher, dynamic sampling, KL loss) on the hybrid engine.
# Adapted as a user would for one CPU: module renamed, tiny model/data, 1 CPU worker, sizes cut; each changed
# line says so. Reads MODEL, REWARD_FUNC, DATA, OUT from the environment.
set -x

args=(
   --ref.num_nodes 1
   --ref.num_gpus_per_node 1                          # changed: 8 GPUs -> 1 CPU worker
   --actor.num_nodes 1
   --actor.num_gpus_per_node 1                        # changed: 8 -> 1
   --vllm.num_engines 1                               # changed: 4 -> 1 (actor workers = engines x TP)
   --vllm.tensor_parallel_size 1                      # changed: 2 -> 1
   --train.colocate_all
   --vllm.gpu_memory_utilization 0.6
   --algo.kl.init_coef 1e-3
   --algo.advantage.gamma 1.0
   --algo.kl.use_loss
   --algo.kl.estimator k3
   --algo.advantage.estimator group_norm
   --algo.dynamic_filtering_enable
   --algo.dynamic_filtering_range 0 1
   --actor.eps_clip_low_high 0.2 0.27
   --actor.model_name_or_path "$MODEL"                # changed: OpenRLHF/Llama-3-8b-sft-mixture -> tiny model
   --reward.remote_url "$REWARD_FUNC"                 # changed: /openrlhf/examples/python/reward_func.py -> the user's file
   --ckpt.output_dir "$OUT/final/llama3-8b-rlhf"      # changed: /openrlhf/examples/test_scripts/... -> $OUT
   --ckpt.path "$OUT/ckpt/llama3-8b-rlhf"             # changed: path
   --ckpt.save_steps 20
   --ckpt.save_hf
   --train.micro_batch_size 2                         # changed: 8 -> 2
   --train.batch_size 4                               # changed: 128 -> 4
   --rollout.micro_batch_size 2                       # changed: 16 -> 2
   --rollout.batch_size 2                             # changed: 128 -> 2
   --rollout.n_samples_per_prompt 2                   # changed: 8 -> 2
   --train.max_epochs 1
   --data.max_len 72                                  # changed: 2048 -> 72 (tiny model; prompts ~25 tokens)
   --data.max_samples 4                               # changed: 20000 -> 4
   --ds.zero_stage 3
   --ds.param_dtype bf16
   --actor.adam.lr 5e-7
   --data.prompt_dataset "$DATA/prompt_collection.jsonl"   # changed: OpenRLHF/prompt-collection-v0.1 -> tiny file
   --data.input_key context_messages
   --data.apply_chat_template
   --actor.gradient_checkpointing_enable
   --ds.packing_samples
   --vllm.sync_backend nccl
   --vllm.enforce_eager
   --vllm.enable_sleep
   --ds.enable_sleep
   --algo.advantage.is_correction_enable
)

python3 -m rlhfkit.cli.train_ppo_ray "${args[@]}"     # changed: openrlhf -> rlhfkit

# You could also try
#   --algo.kl.estimator k2 \
