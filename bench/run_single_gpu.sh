#!/usr/bin/env bash
# The single-GPU benchmarks of the README table, in one go (on a lent H100/H200):
#   bash bench/run_single_gpu.sh OUTDIR [train|rollout|all|rollout_long]
# train:   bench/train_throughput.py (plain HF bf16 + AdamW baseline and rlhfkit variants, same process)
#          and a kernel profile of one step;
# rollout: bench/rollout.py at batch 64 and 256 for prompt 128 / 256 new and prompt 512 / 1024 new, builtin vs
#          HF generate and HF generate with the static cache (HF capped at 256 new tokens for the long shape,
#          which can only overstate HF's tokens/s).
set -uo pipefail
out=${1:?output directory}
what=${2:-all}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
if [[ $what == all || $what == train ]]; then
  timeout 330 python3 bench/train_throughput.py --model qwen2-0.5b --batch 8 --seq 2048 --steps 8 \
    --variants master,master_eagerloss,autocast_eagerloss,master_compile --out "$out/train_throughput_$gpu.json"
  timeout 120 python3 bench/profile_train_step.py --variants master --rows 22 > "$out/profile_train_$gpu.txt" 2>&1
fi
if [[ $what == all || $what == rollout ]]; then
  timeout 420 python3 bench/rollout.py --batch 64,256 --shapes 128x256 --profile \
    --out "$out/rollout_${gpu}_128x256.json" 2>&1 | grep '^{"batch'
fi
if [[ $what == rollout_long ]]; then  # a call of its own: about 8 minutes
  timeout 540 python3 bench/rollout.py --batch 64,256 --shapes 512x1024 --hf_max_new 256 \
    --out "$out/rollout_${gpu}_512x1024.json" 2>&1 | grep '^{"batch'
fi
