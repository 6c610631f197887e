set -u; export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
M=/tmp/bench_model; R=$OUT
rs() { tag=$1; shift; timeout 250 python3 bench/rl_step.py --model qwen2-0.5b --model_dir $M --n 8 --new_tokens 256 --skip_trl --gradient_checkpointing off --micro_train_batch_size 64 --micro_rollout_batch_size 64 --rlhfkit_flags=--torch_compile --out $R/rl_$tag.json "$@" 2>&1 | grep -vE "USDT|Warning|warn" | tail -60 | cut -c1-220; }
rs p8 --prompts 8 --warmup_steps 3 --steps 3 --profile $R/prof_p8
rs p64 --prompts 64 --warmup_steps 2 --steps 2
