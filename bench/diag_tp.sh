# issue 13 TP runs that fit what was left of the device time (see run_scale_gpu.sh gen for the full set)
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
timeout 70 python3 bench/rollout_tp.py --parity --tp 2 --hang_dump_s 60 2>&1 | grep -E '^\{' | cut -c1-400
timeout 150 python3 bench/rollout_tp.py --shape qwen2.5-7b --tp 2,4 --batch 256 --prompt 512 --new 512 --repeat 1 --hang_dump_s 140 --out $OUT/tp7b.json 2>&1 | grep -E '^\{' | cut -c1-900
timeout 150 python3 bench/rollout_tp.py --shape qwen2.5-32b --tp 4 --batch 256 --prompt 512 --new 512 --repeat 1 --hang_dump_s 140 --out $OUT/tp32b.json 2>&1 | grep -E '^\{' | cut -c1-900
