#!/usr/bin/env bash
# Issue 18's one-GPU runs (H100 / H200), about 6 minutes in all:
#   bash bench/run_rl_step_1gpu.sh OUTDIR [all|rl|train]   (TRL wheels: carry .whl_trl, see bench/README or wheels.sh trl)
# `rl` runs part 1 (and the GPU tests of the fused head, the optimizer step and the k/v GEMM), `train` part 2: each fits one
# 10-minute device call.
# 1. bench/rl_step.py: a GRPO step of the Qwen2-0.5B shape, 64 prompts x 8 samples x 256 new tokens, and the
#    same at 8 prompts beside TRL's GRPOTrainer (same model, prompts, reward, GPU), with one profiled step each
#    (phases, GPU idle and what the host ran meanwhile: bench/harness/step_profile.py). rlhfkit as a user would run it
#    for speed: --torch_compile, no gradient checkpointing (the 0.5B step fits), micro-batches of 64 samples.
#    TRL: micro-batches of 16 (it keeps fp32 logits), no gradient checkpointing either.
# 2. bench/train_throughput.py: the SFT step at 8 x 2048 tokens, plain HF + AdamW beside --torch_compile,
#    the same with torch's fused AdamW instead of the one-pass master-weight kernel (_torchadam), rlhfkit's
#    default, and --torch_compile with k and v projected by two GEMMs instead of one (_nofuse, models/fused_qkv.py);
#    one profiled step of each. Then the compiled step with four
#    micro-batches per optimizer step, beside HF doing the same.
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
  --rlhfkit_flags='--torch_compile --rollout_compile' --profile "$out/rl_step_profile_$gpu" --out "$out/rl_step_$gpu.json" 2>&1 \
  | grep -E '^\[rl_step\]|^phase|^(generate|logprobs|train|whole) |GPU idle'
python3 -m pytest -q -p no:cacheprovider tests/gpu/test_head_kernels.py tests/gpu/test_optim_step_gpu.py tests/gpu/test_fused_qkv_gpu.py tests/unit/test_master_adamw.py 2>&1 | tail -3
fi
[ "$part" = rl ] && exit 0
timeout 330 python3 bench/train_throughput.py --model qwen2-0.5b --batch 8 --seq 2048 --steps 10 \
  --variants master_compile,master_compile_torchadam,master,master_compile_nofuse \
  --profile "$out/train_throughput_profile_$gpu" --out "$out/train_throughput_$gpu.json" | grep -E '^\{|^\[|^whole' | cut -c1-2000
# four micro-batches per optimizer step (OpenRLHF's SFT default is 16 on one GPU: train 128 / micro 8)
timeout 200 python3 bench/train_throughput.py --model qwen2-0.5b --batch 8 --seq 2048 --steps 4 --accum 4 \
  --variants master_compile --out "$out/train_throughput_${gpu}_accum4.json" | grep -E '^\{' | cut -c1-2000
