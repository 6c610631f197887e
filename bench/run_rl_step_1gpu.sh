#!/usr/bin/env bash
# Issue 18's one-GPU runs (H100 / H200), about 6 minutes in all:
#   bash bench/run_rl_step_1gpu.sh OUTDIR [all|rl|train]   (TRL wheels: carry .whl_trl, see bench/README or wheels.sh trl)
# `rl` runs part 1 (and the GPU tests of the fused head), `train` parts 2 and 3: each fits one 10-minute device call.
# 1. bench/rl_step.py: a GRPO step of the Qwen2-0.5B shape, 64 prompts x 8 samples x 256 new tokens, and the
#    same at 8 prompts beside TRL's GRPOTrainer (same model, prompts, reward, GPU), with one profiled step each
#    (phases, GPU idle and what the host ran meanwhile: bench/step_profile.py). rlhfkit as a user would run it
#    for speed: --torch_compile, no gradient checkpointing (the 0.5B step fits), micro-batches of 64 samples.
#    TRL: micro-batches of 16 (it keeps fp32 logits), no gradient checkpointing either.
# 2. bench/train_throughput.py: the SFT step at 8 x 2048 tokens, plain HF + AdamW beside rlhfkit's default,
#    --torch_compile, and --torch_compile with the head's softmax gradient recomputed in backward (what the
#    fused head does when the logits do not fit in memory); one profiled step of each.
# 3. The 8 x 8 step again with --recompute_old_logprobs: what skipping the old-log-prob pass saves (by default a
#    rollout that makes one optimizer step takes its old log-probs from the training pass).
set -uo pipefail
out=${1:?output directory}
part=${2:-all}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if compgen -G ".whl_trl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_trl .whl_trl/*.whl && export PYTHONPATH=/tmp/site_trl:${PYTHONPATH:-}
fi
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
if [ "$part" != train ]; then
timeout 420 python3 bench/rl_step.py --model qwen2-0.5b --model_dir /tmp/bench_model --prompts 64 --n 8 \
  --new_tokens 256 --trl_prompts 8 --warmup_steps 3 --steps 4 --gradient_checkpointing off \
  --micro_train_batch_size 64 --micro_rollout_batch_size 64 --trl_micro_train_batch_size 16 \
  --rlhfkit_flags=--torch_compile --profile "$out/rl_step_profile_$gpu" --out "$out/rl_step_$gpu.json" 2>&1 \
  | grep -E '^\[rl_step\]|^phase|^(generate|logprobs|train|whole) |GPU idle'
python3 -m pytest -q -p no:cacheprovider tests/gpu/test_head_kernels.py 2>&1 | tail -3
fi
[ "$part" = rl ] && exit 0
timeout 170 python3 bench/train_throughput.py --model qwen2-0.5b --batch 8 --seq 2048 --steps 8 \
  --variants master,master_compile,master_compile_recompute --profile "$out/train_throughput_profile_$gpu" \
  --out "$out/train_throughput_$gpu.json" | grep -E '^\{|^\[|^whole' | cut -c1-2000
timeout 150 python3 bench/rl_step.py --model qwen2-0.5b --model_dir /tmp/bench_model --prompts 8 --n 8 \
  --new_tokens 256 --warmup_steps 3 --steps 6 --gradient_checkpointing off --micro_train_batch_size 64 \
  --micro_rollout_batch_size 64 --skip_trl "--rlhfkit_flags=--torch_compile --recompute_old_logprobs" \
  --out "$out/rl_step_${gpu}_recompute_old_8x8.json" 2>&1 | grep -E '^\[rl_step\]'
