"""SFT then GRPO from Python (rlhfkit's API) on 2-digit addition with a tiny model; about a minute on a CPU.

    python examples/api_sft_then_grpo.py [RUN_DIR]
"""
import sys

from rlhfkit import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer, mean_metric
from rlhfkit.models.tiny import TinyModelSpec, make_tiny_model
from rlhfkit.tasks.addition import addition_splits, reward_func

run = sys.argv[1] if len(sys.argv) > 1 else "runs/api_example"
base = make_tiny_model(f"{run}/base", TinyModelSpec(hidden_size=64, num_hidden_layers=2, max_position_embeddings=64))
rows, _ = addition_splits(4000, 0, digits=2, seed=0, reverse_answer=True)  # {"input": "12+34=", "output": "64", "label": "64"}
common = dict(device="cpu", param_dtype="fp32", input_template="{}", seed=0, disable_progress=True, lr_warmup_ratio=0.0)

sft = SFTTrainer(base, train_dataset=rows, args=SFTConfig(
    save_path=f"{run}/sft", output_key="output", max_len=32, train_batch_size=64, micro_train_batch_size=64,
    max_steps=150, learning_rate=1e-3, lr_scheduler="constant", logging_steps=25, **common))
sft.train()

grpo = GRPOTrainer(sft.model, processing_class=sft.tokenizer, reward_funcs=reward_func, train_dataset=rows, args=GRPOConfig(
    save_path=f"{run}/grpo", label_key="label", n_samples_per_prompt=8, rollout_batch_size=16, train_batch_size=128,
    micro_train_batch_size=128, micro_rollout_batch_size=128, generate_max_len=5, prompt_max_len=16, init_kl_coef=0.0,
    actor_learning_rate=1e-4, lr_scheduler="constant", max_steps=30, **common))
history = grpo.train()
print(f"GRPO reward: first 5 steps {mean_metric(history[:5], 'reward'):.3f} -> last 5 {mean_metric(history[-5:], 'reward'):.3f}")
