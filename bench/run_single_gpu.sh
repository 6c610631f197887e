#!/usr/bin/env bash
# The single-GPU benchmarks of the README table, in one go (on a lent H100/H200):
#   bash bench/run_single_gpu.sh OUTDIR [train|rollout|all]
# train:   bench/train_throughput.py (plain HF bf16 + AdamW baseline and rlhfkit variants, same process)
#          and a kernel profile of one step;
# rollout: bench/rollout.py, builtin engine only, batch 256, prompt 128 / 256 new, engine knobs compared.
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
  for knob in "" "--sync_every 64" "--compile_mode max-autotune-no-cudagraphs"; do
    tag=$(echo "default $knob" | awk '{print $NF}' | tr -c 'a-z0-9\n' '_')
    timeout 200 python3 bench/rollout.py --engines builtin --batch 256 --shapes 128x256 --profile $knob \
      --out "$out/rollout_${gpu}_$tag.json" 2>&1 | grep -v Warning | tail -3
  done
fi
