#!/usr/bin/env bash
# rlhfkit's copy of OpenRLHF examples/scripts/train_conditional.sh (conditional SFT; flat flags, OpenRLHF
# <= v0.9.5; removed in v0.9.6, so there is no dotted version), adapted as a user would for one CPU: modules
# renamed, tiny models/data, sizes cut; each changed line says so. Reads MODEL, RM_MODEL, DATA, OUT.
set -x

checkSuccess() {
    if [[ $? != 0 ]]; then
        echo "FAILED $1"
        exit 1
    fi
}

mkdir -p "$OUT/checkpoint/llama-2-8b-csft"             # changed: ./checkpoint -> $OUT/checkpoint
RM_OUTPUT=$OUT/checkpoint/llama-2-8b-csft/rm.jsonl     # changed: ./checkpoint -> $OUT/checkpoint

get_rewards_commands=(
    rlhfkit.cli.batch_inference                        # changed: openrlhf -> rlhfkit
    --eval_task rm
    --pretrain "$RM_MODEL"                             # changed: OpenRLHF/Llama-3-8b-rm-mixture -> tiny RM
    --bf16
    --max_len 128                                      # changed: 4096 -> 128 (tiny model)
    --dataset "$DATA/preference.jsonl"                 # changed: OpenRLHF/preference_dataset_mixture2_and_safe_pku -> tiny file
    --input_key chosen
    --apply_chat_template
    --max_samples 8                                    # changed: 128000 -> 8
    --zero_stage 0
    --post_processor csft
    --normalize_reward
    --micro_batch_size 4
    --output_path "$RM_OUTPUT"
)

sft_commands=(
    rlhfkit.cli.train_sft                              # changed: openrlhf -> rlhfkit
    --max_len 128                                      # changed: 4096 -> 128 (tiny model)
    --dataset "$RM_OUTPUT"
    --dataset_probs 1.0
    --output_key output                                # changed: added; rlhfkit needs the response column named
                                                       #   (OpenRLHF's default None trained on an empty response)
    --train_batch_size 4                               # changed: 128 -> 4
    --micro_train_batch_size 2
    --pretrain "$MODEL"                                # changed: OpenRLHF/Llama-3-8b-sft-mixture -> tiny model
    --save_path "$OUT/checkpoint/llama-3-8b-csft"      # changed: ./checkpoint -> $OUT/checkpoint
    --zero_stage 2
    --max_epochs 1
    --bf16
    --learning_rate 5e-6
    --gradient_checkpointing
)

if [ ! -e $RM_OUTPUT ]; then
    python3 -m "${get_rewards_commands[@]}"           # changed: deepspeed --module -> one CPU process
    checkSuccess "RM"
fi
python3 -m "${sft_commands[@]}"                       # changed: deepspeed --module -> one CPU process
