#!/usr/bin/env bash
# Issue 41's one-GPU measurements that remain after the first H100 session, in two device calls (each < 10 minutes):
#   bash bench/run_families_1gpu.sh OUTDIR a      (1-3)
#   bash bench/run_families_1gpu.sh OUTDIR b      (4-5)
#   bash bench/run_families_1gpu.sh OUTDIR c      (1-3 again, after a change to the engine's kernels,
#                                                  with bench/probe/gpt_oss_bf16.py)
# 1. the GPU tests of the families (bf16 log-probs against fp32, tests/gpu/test_engine_families_gpu.py) and the
#    engine's kernels;
# 2. bench/families.py: every family's parity and tokens/s beside its Qwen2 twin (the engine as a user gets it);
# 3. bench/first_step.py: the 0.5B bench model's first GRPO step, cold and warm caches;
# 4. bench/moe_rollout.py: Qwen3-30B-A3B's shape on the builtin engine (the HF engine is in moe_rollout_h100.json);
# 5. bench/rl_step.py: one LoRA GRPO step of the Qwen3-MoE 15B shape (half of 30B-A3B's depth), 8 x 8 x 256,
#    gradient checkpointing (its 30 GB model is written to /tmp first).
set -uo pipefail
out=${1:?output directory}
part=${2:?a, b or c}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
if [ "$part" = c ]; then
timeout 170 python3 -m pytest -q -p no:cacheprovider -rf --show-capture=no tests/unit/test_rollout_norm_kernel.py \
  tests/gpu/test_engine_families_gpu.py tests/unit/test_rollout_attention_kernel.py tests/gpu/test_engine_gpu.py 2>&1 \
  | grep -E "passed|failed|FAILED|Error|assert" | cut -c1-400 | tail -15
timeout 60 python3 bench/probe/gpt_oss_bf16.py 2>&1 | grep variant
timeout 290 python3 bench/families.py --repeat 2 --out "$out/families_$gpu.json" | python3 -c "
import sys, json
for line in sys.stdin:
    if line.startswith('{'):
        r = json.loads(line); f = r.get('family_throughput', {}); q = r.get('qwen2_throughput', {})
        print(r['family'], r['parity'].get('greedy_equal'), round(f.get('builtin_ms_per_step', 0), 2),
              round(q.get('builtin_ms_per_step', 0), 2), round(r.get('ratio_vs_qwen2') or 0, 3))"
timeout 130 python3 bench/first_step.py --steps 2 --out "$out/first_step_$gpu.json" | tail -1
exit 0
fi
if [ "$part" = a ]; then
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_engine_families_gpu.py tests/unit/test_rollout_attention_kernel.py \
  tests/gpu/test_engine_gpu.py 2>&1 | tail -4
timeout 330 python3 bench/families.py --repeat 2 --out "$out/families_$gpu.json" | cut -c1-600
timeout 120 python3 bench/first_step.py --steps 2 --out "$out/first_step_$gpu.json" | tail -1
exit 0
fi
timeout 150 python3 bench/moe_rollout.py --batch 64 --prompt 128 --new 128 --skip_hf --out "$out/moe_rollout_$gpu.json" | tail -1
timeout 420 python3 bench/rl_step.py --model qwen3-moe-15b --model_dir /tmp/bench_moe15 --prompts 8 --n 8 --new_tokens 256 \
  --steps 2 --warmup_steps 1 --skip_trl --gradient_checkpointing on \
  --rlhfkit_flags='--lora_rank 64 --lora_alpha 128' --out "$out/rl_step_moe15b_lora_$gpu.json" 2>&1 | grep -E '^\{' | cut -c1-800
