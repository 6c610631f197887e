#!/usr/bin/env bash
# Issue 41 part 4 on one H100 / H200: GRPO on SmolLM2-135M-Instruct, two-digit addition, rlhfkit beside TRL's
# GRPOTrainer (bench/grpo_real.py: 16 questions x 8 samples a step, 80 steps, greedy accuracy on 200 held-out
# questions before, every 20 steps and after).
#   bash bench/run_grpo_real_1gpu.sh rlhfkit|trl|both [OUTDIR]      (OUTDIR default: $OUT, else bench/results)
# The model must be on the machine first (bench/real_model_parts.sh: split here, then stash and join there),
# and the wheels of trl, datasets and gguf installed into /tmp/site (its `stash` does it). Each side fits
# one 10-minute device call; the JSON is kept in .cache/bench (git-ignored: it stays while the machine is
# warm) and each call adds its side, so after `rlhfkit` then `trl` OUTDIR/grpo_real_<gpu>.json has both:
#   call 1:  carry [".cache/parts/smollm2.gguf.part0", ".cache/parts/smollm2.gguf.sha256", ".whl"]
#            bash bench/real_model_parts.sh stash
#   call 2:  carry [".cache/parts/smollm2.gguf.part1"]
#            bash bench/real_model_parts.sh join && bash bench/run_grpo_real_1gpu.sh rlhfkit
#   call 3:  bash bench/run_grpo_real_1gpu.sh trl
# Then copy the returned grpo_real_<gpu>.json into bench/results/.
set -uo pipefail
side=${1:?rlhfkit | lean | trl | both}
out=${2:-${OUT:-bench/results}}
model=${REAL_MODEL:-.cache/models/smollm2-135m-instruct}
mkdir -p "$out" .cache/bench
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ -d /tmp/site ]; then export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}; fi
[ -f "$model/config.json" ] || { echo "run_grpo_real_1gpu: no model at $model (bench/real_model_parts.sh join)" >&2; exit 1; }
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
suffix=; [ "$side" = lean ] && suffix=_lean  # its own file: the fp32 side it runs is not TRL's partner run
json=.cache/bench/grpo_real_$gpu$suffix.json
case $side in
rlhfkit) skip=--skip_trl ;;
lean) skip="--skip_trl --rlhfkit_optim both" ;;  # fp32 AdamW, then adamw_8bit over bf16_stochastic weights
trl) skip=--skip_rlhfkit ;;
both) skip= ;;
*) echo "usage: bash bench/run_grpo_real_1gpu.sh rlhfkit|lean|trl|both [OUTDIR]" >&2; exit 2 ;;
esac
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
timeout 570 python3 bench/grpo_real.py --model_dir "$model" --prompts 16 --n 8 --steps 80 --new_tokens 64 \
  --temperature 1.0 --lr 1e-5 --eval_prompts 200 --eval_every 20 $skip --out "$json" 2>&1 \
  | grep -E '^\[grpo_real\]|^\{|Error|error' | cut -c1-3000
rc=${PIPESTATUS[0]}
cp "$json" "$out/$(basename "$json")"
exit "$rc"
