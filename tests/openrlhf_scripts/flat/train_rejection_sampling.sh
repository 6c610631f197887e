#!/usr/bin/env bash
# rlhfkit's copy of OpenRLHF examples/scripts/train_rejection_sampling.sh (flat flags, OpenRLHF <= v0.9.5;
# removed in v0.9.6, so there is no dotted version), adapted as a user would for one CPU: modules renamed, tiny
# models/data, sizes and iterations cut; each changed line says so. Reads MODEL, RM_MODEL, DATA, OUT.
set -x
export VLLM_WORKER_MULTIPROC_METHOD=spawn

checkSuccess() {
   if [[ $? != 0 ]]; then
      echo "FAILED $1"
      exit 1
   fi
}

mkdir -p "$OUT/checkpoint/llama-3-8b-rejection"                       # changed: ./checkpoint -> $OUT/checkpoint
GENERATE_OUTPUT=$OUT/checkpoint/llama-3-8b-rejection/generate.jsonl    # changed: path
RM_OUTPUT=$OUT/checkpoint/llama-3-8b-rejection/rm.jsonl                # changed: path
ITER_LOG_PATH=$OUT/checkpoint/llama-3-8b-rejection/iter.log            # changed: path
MODEL_OUTPUT_PATH=$OUT/checkpoint/llama-3-8b-rejection                 # changed: path

TRAINING_ITERS=2                                       # changed: 10 -> 2
ROLLOUT_BATCH_SIZE=4                                   # changed: 10240 -> 4

POLICY_MODEL_PATH=$MODEL                               # changed: OpenRLHF/Llama-3-8b-sft-mixture -> tiny model

iter=0
if [ -f $ITER_LOG_PATH ]; then
   iter=$(cat $ITER_LOG_PATH)
fi

while (($iter < $TRAINING_ITERS)); do
   echo "Iter: $iter"
   # Use latest model if past first iteration
   if ((iter > 0)); then
      POLICY_MODEL_PATH=$MODEL_OUTPUT_PATH
   fi

   generate_commands=(
      rlhfkit.cli.batch_inference                      # changed: openrlhf -> rlhfkit
      --eval_task generate_vllm
      --pretrain $POLICY_MODEL_PATH
      --bf16
      --max_new_tokens 8                               # changed: 2048 -> 8
      --prompt_max_len 64                              # changed: 2048 -> 64
      --dataset "$DATA/prompt_collection.jsonl"        # changed: OpenRLHF/prompt-collection-v0.1 -> tiny file
      --input_key context_messages
      --apply_chat_template
      --temperature 0.9
      --zero_stage 0
      --best_of_n 4
      --enable_prefix_caching
      --tp_size 1                                      # changed: 4 -> 1 (one CPU process)
      --max_num_seqs 64
      --iter $iter
      --rollout_batch_size $ROLLOUT_BATCH_SIZE
      --output_path $GENERATE_OUTPUT
   )
   echo "${generate_commands[@]}"
   python -m "${generate_commands[@]}"
   checkSuccess "GENERATE"

   get_rewards_commands=(
      rlhfkit.cli.batch_inference                      # changed: openrlhf -> rlhfkit
      --eval_task rm
      --pretrain "$RM_MODEL"                           # changed: OpenRLHF/Llama-3-8b-rm-mixture -> tiny RM
      --bf16
      --max_len 128                                    # changed: 4096 -> 128 (tiny model)
      --dataset $GENERATE_OUTPUT
      --dataset_probs 1.0
      --zero_stage 0
      --post_processor rs
      --micro_batch_size 4
      --output_path $RM_OUTPUT
   )
   echo "${get_rewards_commands[@]}"
   python -m "${get_rewards_commands[@]}"              # changed: deepspeed --module -> one CPU process
   checkSuccess "RM"

   sft_commands=(
      rlhfkit.cli.train_sft                            # changed: openrlhf -> rlhfkit
      --max_len 128                                    # changed: 4096 -> 128 (tiny model)
      --dataset $RM_OUTPUT
      --dataset_probs 1.0
      --output_key output                              # changed: added; rlhfkit needs the response column named
                                                       #   (OpenRLHF's default None trained on an empty response)
      --train_batch_size 4                             # changed: 128 -> 4
      --micro_train_batch_size 2
      --pretrain $POLICY_MODEL_PATH
      --save_path "$OUT/checkpoint/llama-3-8b-rejection"   # changed: ./checkpoint -> $OUT/checkpoint
      --input_template ""
      --zero_stage 2
      --max_epochs 1
      --bf16
      --learning_rate 2e-6
      --gradient_checkpointing
   )
   echo "${sft_commands[@]}"
   python -m "${sft_commands[@]}"                      # changed: deepspeed --module -> one CPU process
   checkSuccess "SFT"

   iter=$((iter + 1))
   if [[ "$ITER_LOG_PATH" != "null" ]]; then
      echo $iter >$ITER_LOG_PATH
   fi
done
