#!/usr/bin/env bash
# The routed experts' Triton decode kernels on one GPU, in one device call (< 10 minutes):
#   bash bench/run_moe_1gpu.sh OUTDIR
# 1. their GPU tests and the families' bf16 GPU tests (tests/gpu/test_triton_moe_gpu.py, test_engine_families_gpu.py);
# 2. bench/moe_kernels.py: one routed layer, Triton kernels against torch's grouped GEMMs and a dense twin;
# 3. bench/families.py for qwen3_moe and gpt_oss: parity and tokens/s beside each one's Qwen2 twin.
set -uo pipefail
out=${1:?output directory}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
timeout 200 python3 -m pytest -q -p no:cacheprovider -rf --show-capture=no tests/gpu/test_triton_moe_gpu.py \
  tests/gpu/test_engine_families_gpu.py 2>&1 | grep -E "passed|failed|FAILED|Error|assert" | cut -c1-400 | tail -15
timeout 150 python3 bench/moe_kernels.py --tokens ${MOE_TOKENS:-8 16 32 64 128 256 1024 4096} --out "$out/moe_kernels_$gpu.json" 2>&1 | tail -30
timeout ${FAMILIES_TIMEOUT:-240} python3 bench/families.py --families qwen3_moe,gpt_oss --repeat 2 \
  --out "$out/families_moe_$gpu.json" 2>&1 | python3 -c "
import sys, json
for line in sys.stdin:
    if line.startswith('{'):
        r = json.loads(line); f = r.get('family_throughput', {}); q = r.get('qwen2_throughput', {})
        print(r['family'], r['parity'].get('greedy_equal'), r['parity'].get('logprob_max_abs_gap'),
              r['parity'].get('routing_agreement'), round(f.get('builtin_ms_per_step', 0), 3),
              round(q.get('builtin_ms_per_step', 0), 3), 'ratio', r.get('ratio_vs_qwen2'))
    else:
        print(line.rstrip()[:300])
"
