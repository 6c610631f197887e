"""SFT then GRPO from Python on 1-digit addition with a tiny model built offline (about 30 s on a CPU).

    python examples/api_sft_then_grpo.py [RUN_DIR]      # prints GRPO's reward before and after
"""
import sys

from rlhfkit import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer, mean_metric
from rlhfkit.models.tiny import TinyModelSpec, make_tiny_model
from rlhfkit.tasks.addition import addition_splits, reward_func  # exact match of the sum

run = sys.argv[1] if len(sys.argv) > 1 else "runs/api_example"
base = make_tiny_model(f"{run}/base", TinyModelSpec(hidden_size=64, num_hidden_layers=2, max_position_embeddings=64))
rows, _ = addition_splits(4000, 0, digits=1, seed=0)  # {"input": "7+5=", "output": "12", "label": "12"}
common = dict(device="cpu", param_dtype="fp32", input_template="{}", seed=0, disable_progress=True,
              lr_warmup_ratio=0.0, lr_scheduler="constant")

sft = SFTTrainer(base, train_dataset=rows, args=SFTConfig(
    output_key="output", max_len=32, train_batch_size=64, micro_train_batch_size=64, max_epochs=100, max_steps=200,
    learning_rate=1e-3, logging_steps=50, save_path=f"{run}/sft", **common))
sft.train()

grpo = GRPOTrainer(sft.model, processing_class=sft.tokenizer, reward_funcs=reward_func, train_dataset=rows,
                   args=GRPOConfig(label_key="label", n_samples_per_prompt=8, rollout_batch_size=16,
                                   train_batch_size=128, micro_train_batch_size=128, micro_rollout_batch_size=128,
                                   generate_max_len=4, prompt_max_len=16, init_kl_coef=0.0, actor_learning_rate=2e-4,
                                   max_steps=40, save_path=f"{run}/grpo", **common))
history = grpo.train()
print(f"GRPO reward: {mean_metric(history[:5], 'reward'):.3f} (first 5 steps) -> "
      f"{mean_metric(history[-5:], 'reward'):.3f} (last 5 steps)")
