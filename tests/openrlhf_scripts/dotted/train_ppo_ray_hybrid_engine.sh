#!/usr/bin/env bash
# rlhfkit's copy of OpenRLHF examples/scripts/train_ppo_ray_hybrid_engine.sh (dotted flags, OpenRLHF after
# ed62d0e2): PPO (GAE critic + reward model) with every model and the engine on the same devices, sleeping in
# turn. Adapted as a user would for one CPU: module renamed, tiny model/data, 1 CPU worker per role, sizes cut
# to one RL step; each changed line says so. Reads MODEL, RM_MODEL, DATA, OUT from the environment.
set -x

args=(
   --ref.num_nodes 1
   --ref.num_gpus_per_node 1                          # changed: 8 GPUs -> 1 CPU worker
   --reward.num_nodes 1
   --reward.num_gpus_per_node 1                       # changed: 8 -> 1
   --critic.num_nodes 1
   --critic.num_gpus_per_node 1                       # changed: 8 -> 1
   --actor.num_nodes 1
   --actor.num_gpus_per_node 1                        # changed: 8 -> 1
   --vllm.num_engines 1                               # changed: 4 -> 1 (actor workers = engines x TP)
   --vllm.tensor_parallel_size 1                      # changed: 2 -> 1
   --train.colocate_all
   --vllm.gpu_memory_utilization 0.5
   --actor.model_name_or_path "$MODEL"                # changed: OpenRLHF/Llama-3-8b-sft-mixture -> tiny model
   --reward.model_name_or_path "$RM_MODEL"            # changed: OpenRLHF/Llama-3-8b-rm-700k -> tiny RM
   --ckpt.output_dir "$OUT/final/llama3-8b-rlhf"      # changed: /openrlhf/examples/test_scripts/... -> $OUT
   --ckpt.path "$OUT/ckpt/llama3-8b-rlhf"             # changed: path
   --ckpt.save_hf
   --train.batch_size 4                               # changed: 128 -> 4
   --rollout.batch_size 4                             # changed: 1024 -> 4
   --rollout.n_samples_per_prompt 1
   --train.max_epochs 1
   --data.max_len 72                                  # changed: 2048 -> 72 (tiny model; prompts ~25 tokens)
   --data.max_samples 4                               # changed: 100000 -> 4 (one RL step)
   --ds.zero_stage 3
   --ds.param_dtype bf16
   --actor.adam.lr 5e-7
   --critic.adam.lr 9e-6
   --algo.kl.init_coef 0.01
   --data.prompt_dataset "$DATA/prompt_collection.jsonl"   # changed: OpenRLHF/prompt-collection-v0.1 -> tiny file
   --data.input_key context_messages
   --data.apply_chat_template
   --reward.normalize_enable
   --actor.gradient_checkpointing_enable
   --ds.packing_samples
   --vllm.sync_backend nccl
   --vllm.enforce_eager
   --vllm.enable_sleep
   --ds.enable_sleep
   --train.dynamic_batch_enable
   --train.max_tokens_per_gpu 16384
   --algo.advantage.is_correction_enable
)

python3 -m rlhfkit.cli.train_ppo_ray "${args[@]}"     # changed: openrlhf -> rlhfkit

# Enable tensor parallelism for DeepSpeed
#    --ds.tensor_parallel_size 2 \

# Enable Ring-Attention
#    --ds.ring_attn_size 4 \
#    --ds.ring_attn_head_stride 2 \
