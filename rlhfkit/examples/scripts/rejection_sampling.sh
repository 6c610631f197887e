#!/usr/bin/env bash
# Rejection sampling fine-tuning (best-of-n samples as SFT data, as in RAFT), iterated:
#   for iter in 0 .. ITERS-1:
#     1. batch_inference --eval_task generate: BEST_OF_N samples for prompts
#        [iter * ROLLOUT_BATCH_SIZE, (iter + 1) * ROLLOUT_BATCH_SIZE) from the current policy
#     2. batch_inference --eval_task rm --post_processor rs: keep the best-scoring sample per prompt
#     3. train_sft on those (input, output) rows; the result is the next iteration's policy
# Models are local Hugging Face directories (an SFT policy and a reward model from train_rm).
#
#   POLICY=./ckpt/sft REWARD_MODEL=./ckpt/rm PROMPTS=prompts.jsonl INPUT_KEY=question \
#     bash examples/scripts/rejection_sampling.sh
# Multi-GPU training: TRAIN_LAUNCH="torchrun --nproc_per_node 8 -m". A stopped run resumes at the
# iteration recorded in $WORK_DIR/iter.txt. Sizes: MAX_LEN, PROMPT_MAX_LEN, MAX_NEW_TOKENS, TRAIN_BATCH_SIZE,
# MICRO_TRAIN_BATCH_SIZE, LEARNING_RATE. Extra flags: GEN_ARGS (generation), RM_ARGS (scoring), TRAIN_ARGS (train_sft).
set -euo pipefail

POLICY=${POLICY:-./ckpt/sft}
REWARD_MODEL=${REWARD_MODEL:-./ckpt/rm}
PROMPTS=${PROMPTS:-./data/prompts.jsonl}
INPUT_KEY=${INPUT_KEY:-input}
WORK_DIR=${WORK_DIR:-./ckpt/rejection_sampling}
ITERS=${ITERS:-4}
ROLLOUT_BATCH_SIZE=${ROLLOUT_BATCH_SIZE:-2048}
BEST_OF_N=${BEST_OF_N:-8}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-1024}
TRAIN_LAUNCH=${TRAIN_LAUNCH:-python -m}
MAX_LEN=${MAX_LEN:-2048}
PROMPT_MAX_LEN=${PROMPT_MAX_LEN:-1024}
TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-128}
MICRO_TRAIN_BATCH_SIZE=${MICRO_TRAIN_BATCH_SIZE:-2}
LEARNING_RATE=${LEARNING_RATE:-2e-6}
GEN_ARGS=${GEN_ARGS:-}
RM_ARGS=${RM_ARGS:-}
TRAIN_ARGS=${TRAIN_ARGS:-}

mkdir -p "$WORK_DIR"
iter=0
if [[ -f $WORK_DIR/iter.txt ]]; then
  iter=$(cat "$WORK_DIR/iter.txt")
fi

while ((iter < ITERS)); do
  echo "=== rejection sampling: iteration $iter ==="
  policy=$POLICY
  if ((iter > 0)); then
    policy=$WORK_DIR/iter_$((iter - 1))/model
  fi
  out=$WORK_DIR/iter_$iter
  mkdir -p "$out"

  # shellcheck disable=SC2086  # GEN_ARGS / RM_ARGS / TRAIN_ARGS / TRAIN_LAUNCH are word lists
  python -m rlhfkit.cli.batch_inference --eval_task generate \
    --pretrain "$policy" --param_dtype bf16 \
    --dataset "$PROMPTS" --input_key "$INPUT_KEY" --apply_chat_template \
    --best_of_n "$BEST_OF_N" --temperature 1.0 --top_p 1.0 \
    --prompt_max_len "$PROMPT_MAX_LEN" --max_new_tokens "$MAX_NEW_TOKENS" --max_len "$MAX_LEN" \
    --iter "$iter" --rollout_batch_size "$ROLLOUT_BATCH_SIZE" \
    --output_path "$out/generate.jsonl" $GEN_ARGS

  python -m rlhfkit.cli.batch_inference --eval_task rm \
    --pretrain "$REWARD_MODEL" --param_dtype bf16 --max_len "$MAX_LEN" \
    --dataset "$out/generate.jsonl" --micro_batch_size 16 \
    --post_processor rs --output_path "$out/best.jsonl" $RM_ARGS

  # the inputs are already formatted prompts: --input_template '{}' uses them as they are
  # shellcheck disable=SC2086
  $TRAIN_LAUNCH rlhfkit.cli.train_sft \
    --pretrain "$policy" --dataset "$out/best.jsonl" \
    --input_key input --output_key output --input_template '{}' \
    --max_len "$MAX_LEN" --train_batch_size "$TRAIN_BATCH_SIZE" --micro_train_batch_size "$MICRO_TRAIN_BATCH_SIZE" \
    --max_epochs 1 --learning_rate "$LEARNING_RATE" --lr_scheduler constant --param_dtype bf16 \
    --gradient_checkpointing --save_path "$out/model" $TRAIN_ARGS

  iter=$((iter + 1))
  echo "$iter" > "$WORK_DIR/iter.txt"
done
echo "final policy: $WORK_DIR/iter_$((ITERS - 1))/model"
