#!/usr/bin/env bash
# Issue 6's GPU runs on the 2-GPU machine: train_ppo_ray disaggregated (policy on GPU 0, engine on
# GPU 1, NCCL weight broadcast) and colocated over both GPUs (FSDP2 policy + 2 engines, sleep/wake,
# CUDA IPC weight sync), timed by bench/rl_step.py's Ray mode on the Qwen2-0.5B shape; first the
# GPU tests of the weight-sync paths. Run from the repo root with the Ray wheels in .whl/
# (wheels of ray and its dependencies for the GPU machine's Python). Writes to $OUT (default bench/results):
#   rl_step_ray_disaggregated.json, rl_step_ray_colocated.json, their .log files, weight_sync_gpu_tests.txt
# Expected: about 4 minutes (Ray start ~8 s per run, compile / CUDA-graph warm-up in the first step);
# each part is capped (timeout) so the whole stays under 9 minutes.
set -uo pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
say() { echo "[run_ray_gpu $(date +%H:%M:%S)] $*"; }

say "installing the Ray wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="$PWD:/tmp/site:${PYTHONPATH:-}"
unset RAY_ADDRESS
export RAY_DISABLE_IMPORT_WARNING=1 RAY_USAGE_STATS_ENABLED=0 RAY_OBJECT_STORE_ALLOW_SLOW_STORAGE=1 \
  TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi -L
df -h /dev/shm | tail -1
python3 -c "import ray, torch, transformers; print('ray', ray.__version__, 'torch', torch.__version__, \
'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())" || exit 1

say "GPU tests of the weight-sync paths (CUDA IPC, NCCL group, Ray actors)"
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_weight_sync_gpu.py 2>&1 \
  | tee "$OUT/weight_sync_gpu_tests.txt" | tail -15

MODEL=/tmp/rl_step_model_qwen2-0.5b
status=0
for layout in disaggregated colocated; do
  say "rl_step Ray $layout: 16 prompts x 8 samples x 256 new tokens, 1 warm-up + 3 timed steps"
  timeout 210 python3 bench/rl_step.py --ray_layout "$layout" --model qwen2-0.5b --model_dir "$MODEL" \
    --prompts 16 --n 8 --prompt_len 128 --new_tokens 256 --steps 3 --out "$OUT/rl_step_ray_$layout.json" \
    > "$OUT/rl_step_ray_$layout.log" 2>&1
  rc=$?
  grep -E "^\[rl_step\]|^weight sync:|^placement:|Error|error" "$OUT/rl_step_ray_$layout.log" | tail -25
  say "$layout exited $rc"
  [ $rc -eq 0 ] || status=1
done
python3 - "$OUT" <<'PY'
import json, os, sys
for layout in ("disaggregated", "colocated"):
    p = os.path.join(sys.argv[1], f"rl_step_ray_{layout}.json")
    if not os.path.exists(p):
        print(layout, "no JSON"); continue
    d = json.load(open(p))
    r = d["runs"][0] if d.get("runs") else {}
    print(layout, {k: d.get(k) for k in ("device", "step_s", "phases_s", "weight_sync_method", "weight_push_s",
                                         "weight_sync_mb", "ray_phases_s")}, "error:", r.get("error"))
PY
exit $status
