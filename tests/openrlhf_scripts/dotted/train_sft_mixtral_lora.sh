#!/usr/bin/env bash
# rlhfkit's copy of OpenRLHF examples/scripts/train_sft_mixtral_lora.sh in the dotted spelling (the flat
# script with each flag renamed by OpenRLHF's flat -> dotted table), adapted as a user would for one CPU:
# module renamed, tiny model (a dense Llama: no MoE router, so --model.aux_loss_coef has nothing to act on)
# and data, sizes cut; each changed line says so. Reads MODEL, DATA, OUT from the environment.
set -x

training_commands=(
    rlhfkit.cli.train_sft                             # changed: openrlhf -> rlhfkit
    --data.max_len 128                                # changed: 2048 -> 128 (tiny model)
    --data.dataset "$DATA/openorca.jsonl"             # changed: Open-Orca/OpenOrca -> tiny file
    --data.input_key question
    --data.output_key response
    --train.batch_size 4                              # changed: 128 -> 4
    --train.micro_batch_size 4
    --data.max_samples 8                              # changed: 500000 -> 8
    --model.model_name_or_path "$MODEL"               # changed: mistralai/Mixtral-8x7B-v0.1 -> tiny model
    --ckpt.output_dir "$OUT/checkpoint/mixtral-sft-lora"   # changed: ./checkpoint -> $OUT/checkpoint
    --ckpt.save_steps -1
    --logger.logging_steps 1
    --eval.steps -1
    --ds.zero_stage 3
    --train.max_epochs 1
    --ds.param_dtype bf16
    --model.gradient_checkpointing_enable
    --ds.attn_implementation sdpa                     # changed: flash_attention_2 -> sdpa (flash-attn is GPU-only)
    --adam.lr 5e-6
    --ds.lora.rank 64
    --ds.lora.alpha 64
    --ds.packing_samples
    --model.aux_loss_coef 0.001
)

if [[ ${1} != "slurm" ]]; then
    python3 -m "${training_commands[@]}"             # changed: deepspeed --module (8 GPUs) -> one CPU process
fi
