#!/usr/bin/env bash
# rlhfkit's copy of OpenRLHF examples/scripts/train_ppo_with_reward_fn.sh (dotted flags, OpenRLHF after
# ed62d0e2; the --fsdp.* names of that version are written --ds.*, OpenRLHF's own): PPO with a Python
# reward_func file. Adapted as a user would for one CPU: module renamed, tiny model/data, 1 CPU worker per role,
# sizes cut to one RL step; each changed line says so. Reads MODEL, REWARD_FUNC, DATA, OUT.

# /openrlhf/examples/scripts/reward_func.py
# import torch

# def reward_func(queries, prompts, labels):
#     # queries is prompts + responses
#     # labels is answers
#     print(queries)
#     return torch.randn(len(queries))

set -x

args=(
   --ref.num_nodes 1
   --ref.num_gpus_per_node 1                          # changed: 2 GPUs -> 1 CPU worker
   --critic.num_nodes 1
   --critic.num_gpus_per_node 1                       # changed: 2 -> 1
   --actor.num_nodes 1
   --actor.num_gpus_per_node 1                        # changed: 2 -> 1
   --vllm.num_engines 1                               # changed: 2 -> 1
   --vllm.tensor_parallel_size 1                      # changed: 2 -> 1
   --train.colocate_actor_ref
   --actor.model_name_or_path "$MODEL"                # changed: OpenRLHF/Llama-3-8b-sft-mixture -> tiny model
   --reward.remote_url "$REWARD_FUNC"                 # changed: /openrlhf/examples/python/reward_func.py -> the user's file
   --ckpt.output_dir "$OUT/checkpoint/llama3-8b-rlhf" # changed: /openrlhf/examples/checkpoint -> $OUT/checkpoint
   --train.micro_batch_size 2                         # changed: 8 -> 2
   --train.batch_size 4                               # changed: 128 -> 4
   --rollout.micro_batch_size 2                       # changed: 16 -> 2
   --rollout.batch_size 4                             # changed: 1024 -> 4
   --data.max_samples 4                               # changed: 100000 -> 4 (one RL step)
   --train.max_epochs 1
   --data.max_len 72                                  # changed: 2048 -> 72 (tiny model; prompts ~25 tokens)
   --ds.param_dtype bf16
   --actor.adam.lr 5e-7
   --critic.adam.lr 9e-6
   --algo.kl.init_coef 0.01
   --data.prompt_dataset "$DATA/prompt_collection.jsonl"   # changed: OpenRLHF/prompt-collection-v0.1 -> tiny file
   --data.input_key context_messages
   --data.apply_chat_template
   --reward.normalize_enable
   --ds.attn_implementation sdpa                      # changed: flash_attention_2 -> sdpa (flash-attn is GPU-only)
   --actor.gradient_checkpointing_enable
   # --logger.wandb.key {wandb_token}                 # changed: dropped (no wandb account offline)
)

python3 -m rlhfkit.cli.train_ppo_ray "${args[@]}"     # changed: ray job submit --address ... -- python3 -m openrlhf...
                                                      #   -> run directly (joins $RAY_ADDRESS, else a local Ray)
