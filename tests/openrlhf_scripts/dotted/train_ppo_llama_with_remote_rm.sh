#!/usr/bin/env bash
# rlhfkit's copy of OpenRLHF examples/scripts/train_ppo_llama_with_remote_rm.sh in the dotted spelling (the
# flat script with each flag renamed by OpenRLHF's flat -> dotted table): PPO whose reward comes from serve_rm
# over HTTP (serve_remote_rm.sh, started first). Adapted as a user would for one CPU: module renamed, tiny
# model/data, 1 CPU worker per role, sizes cut to one RL step; each changed line says so.
# Reads MODEL, RM_PORT, DATA, OUT from the environment.
set -x

args=(
   --ref.num_nodes 1
   --ref.num_gpus_per_node 1                          # changed: 2 GPUs -> 1 CPU worker
   --reward.num_nodes 1
   --reward.num_gpus_per_node 1                       # changed: 2 -> 1
   --critic.num_nodes 1
   --critic.num_gpus_per_node 1                       # changed: 2 -> 1
   --actor.num_nodes 1
   --actor.num_gpus_per_node 1                        # changed: 2 -> 1
   --vllm.num_engines 1                               # changed: 2 -> 1
   --vllm.tensor_parallel_size 1                      # changed: 2 -> 1
   --train.colocate_actor_ref
   --actor.model_name_or_path "$MODEL"                # changed: OpenRLHF/Llama-3-8b-sft-mixture -> tiny model
   --reward.remote_url "http://localhost:$RM_PORT/get_reward"   # changed: port 5000 -> the server's free port
   --ckpt.output_dir "$OUT/checkpoint/llama3-8b-rlhf" # changed: /openrlhf/examples/checkpoint -> $OUT/checkpoint
   --train.micro_batch_size 2                         # changed: 8 -> 2
   --train.batch_size 4                               # changed: 128 -> 4
   --rollout.micro_batch_size 2                       # changed: 16 -> 2
   --rollout.batch_size 4                             # changed: 1024 -> 4
   --data.max_samples 4                               # changed: 100000 -> 4 (one RL step)
   --train.max_epochs 1
   --data.max_len 72                                  # changed: 2048 (1024 + 1024) -> 72 (tiny model)
   --rollout.max_new_tokens 8                         # changed: 1024 -> 8
   --ds.zero_stage 3
   --ds.param_dtype bf16
   --actor.adam.lr 5e-7
   --critic.adam.lr 9e-6
   --algo.kl.init_coef 0.01
   --data.prompt_dataset "$DATA/prompt_collection.jsonl"   # changed: OpenRLHF/prompt-collection-v0.1 -> tiny file
   --data.input_key context_messages
   --data.apply_chat_template
   --reward.normalize_enable
   --ds.adam_offload
   --actor.gradient_checkpointing_enable
   # --logger.wandb.key {wandb_token}                 # changed: dropped (no wandb account offline)
)

python3 -m rlhfkit.cli.train_ppo_ray "${args[@]}"     # changed: ray job submit --address ... -- python3 -m openrlhf...
                                                      #   -> run directly (joins $RAY_ADDRESS, else a local Ray)
