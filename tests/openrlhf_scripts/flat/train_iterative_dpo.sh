#!/usr/bin/env bash
# rlhfkit's copy of OpenRLHF examples/scripts/train_iterative_dpo.sh (flat flags, OpenRLHF <= v0.9.5; removed
# in v0.9.6, so there is no dotted version), adapted as a user would for one CPU: modules renamed, tiny
# models/data, sizes and iterations cut; each changed line says so. Reads MODEL, RM_MODEL, DATA, OUT.
set -x
export VLLM_WORKER_MULTIPROC_METHOD=spawn

checkSuccess() {
   if [[ $? != 0 ]]; then
      echo "FAILED $1"
      exit 1
   fi
}

mkdir -p "$OUT/checkpoint/llama-3-8b-iter-dpo"                       # changed: ./checkpoint -> $OUT/checkpoint
GENERATE_OUTPUT=$OUT/checkpoint/llama-3-8b-iter-dpo/generate.jsonl    # changed: path
RM_OUTPUT=$OUT/checkpoint/llama-3-8b-iter-dpo/rm.jsonl                # changed: path
MODEL_OUTPUT_PATH=$OUT/checkpoint/llama-3-8b-iter-dpo/checkpoint      # changed: path
ITER_LOG_PATH=null

TRAINING_ITERS=2                                       # changed: 5 -> 2
ROLLOUT_BATCH_SIZE=4                                   # changed: 10240 -> 4

POLICY_MODEL_PATH=$MODEL                               # changed: OpenRLHF/Llama-3-8b-sft-mixture -> tiny model
REF_MODEL_PATH=$POLICY_MODEL_PATH

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
      --max_new_tokens 8                               # changed: 2048 -> 8
      --prompt_max_len 64                              # changed: 2048 -> 64
      --dataset "$DATA/prompt_collection.jsonl"        # changed: OpenRLHF/prompt-collection-v0.1 -> tiny file
      --input_key context_messages
      --apply_chat_template
      --temperature 1.0
      --tp_size 1                                      # changed: 4 -> 1 (one CPU process)
      --best_of_n 8
      --enable_prefix_caching
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
      --post_processor iter_dpo
      --micro_batch_size 4
      --output_path $RM_OUTPUT
   )
   echo "${get_rewards_commands[@]}"
   python -m "${get_rewards_commands[@]}"              # changed: deepspeed --module -> one CPU process
   checkSuccess "RM"

   dpo_commands=(
      rlhfkit.cli.train_dpo                            # changed: openrlhf -> rlhfkit
      --max_len 128                                    # changed: 4096 -> 128 (tiny model)
      --dataset $RM_OUTPUT
      --dataset_probs 1.0
      --prompt_key prompt
      --train_batch_size 4                             # changed: 128 -> 4
      --micro_train_batch_size 2
      --pretrain $POLICY_MODEL_PATH
      --ref_pretrain $REF_MODEL_PATH
      --save_path $MODEL_OUTPUT_PATH
      --zero_stage 3
      --max_epochs 1
      --bf16
      --learning_rate 5e-7
      --gradient_checkpointing
   )
   echo "${dpo_commands[@]}"
   python -m "${dpo_commands[@]}"                      # changed: deepspeed --module -> one CPU process
   checkSuccess "DPO"

   iter=$((iter + 1))
   if [[ "$ITER_LOG_PATH" != "null" ]]; then
      echo $iter >$ITER_LOG_PATH
   fi
done
