#!/usr/bin/env bash
# rlhfkit's copy of OpenRLHF examples/scripts/train_dpo_llama.sh (flat flags, OpenRLHF 0b08e353), adapted as a
# user would for CPU: module renamed, tiny model/data, sizes cut; each changed line says so. The launcher line is
# as written: NPROC_PER_NODE picks the number of CPU processes. Reads MODEL, DATA, OUT from the environment.
set -x

training_commands=(
   rlhfkit.cli.train_dpo                              # changed: openrlhf -> rlhfkit
   --save_path "$OUT/checkpoint/llama3-8b-dpo"        # changed: ./checkpoint -> $OUT/checkpoint
   --save_steps -1
   --logging_steps 1
   --eval_steps -1
   --train_batch_size 4                               # changed: 256 -> 4
   --micro_train_batch_size 1
   --pretrain "$MODEL"                                # changed: OpenRLHF/Llama-3-8b-sft-mixture -> tiny model
   --param_dtype bf16
   --max_epochs 1
   --max_len 128                                      # changed: 8192 -> 128 (tiny model)
   --learning_rate 5e-7
   --beta 0.1
   --dataset "$DATA/preference.jsonl"                 # changed: OpenRLHF/preference_dataset_mixture2_and_safe_pku -> tiny file
   --apply_chat_template
   --chosen_key chosen
   --rejected_key rejected
   --attn_implementation sdpa                         # changed: flash_attention_2 -> sdpa (flash-attn is GPU-only)
   --load_checkpoint
   --packing_samples
   --gradient_checkpointing
)
    # --use_wandb [WANDB_TOKENS] or True (use wandb login command)
    # --ipo [for IPO]
    # --label_smoothing 0.1 [for cDPO]
    # --ref_offload
    # --packing_samples
    # --nll_loss_coef (Regularization with NLL loss)


if [[ ${1} != "slurm" ]]; then
    torchrun --standalone --nproc-per-node ${NPROC_PER_NODE:-8} -m "${training_commands[@]}"
fi
