#!/usr/bin/env bash
# rlhfkit's copy of OpenRLHF examples/scripts/combine_lora.sh in the dotted spelling (--bf16 became
# --ds.param_dtype bf16), adapted as a user would: module renamed, paths point at the tiny base model and the
# adapter of train_sft_mixtral_lora.sh; each changed line says so. Reads MODEL, LORA_PATH, OUT.
set -x

args=(
    --model_path "$MODEL"                             # changed: meta-llama/Meta-Llama-3-8B -> tiny model
    --lora_path "$LORA_PATH"                          # changed: ./checkpoint/llama-3-8b-sft -> the LoRA SFT output
    --output_path "$OUT/checkpoint/llama-3-8b-sft-combined"   # changed: ./checkpoint -> $OUT/checkpoint
    --ds.param_dtype bf16
)
python -m rlhfkit.cli.lora_combiner "${args[@]}"      # changed: openrlhf -> rlhfkit
