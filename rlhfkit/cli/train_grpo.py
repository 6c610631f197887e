"""GRPO with the defaults of TRL's GRPOConfig: `rlhfkit grpo` (train_ppo's flags and loop).

    rlhfkit grpo --pretrain MODEL --dataset prompts.jsonl --reward_funcs reward.py --output_dir ckpt/grpo

Defaults (rlhfkit.config.rl_flags.PRESETS["grpo"]): --advantage_estimator group_norm, 8 samples per prompt
(--num_generations), completions of up to 512 tokens (--max_completion_length), learning rate 1e-6, no
KL term (--beta 0: no reference model; a --beta is a k3 loss term), 1 prompt x 8 samples per step and
one optimizer step of 8 (--per_device_train_batch_size), 3 passes over the prompts (--num_train_epochs),
a linear schedule without warm-up, a log line every 10 steps, the prompt in the `prompt` column. TRL's
flag names are accepted beside rlhfkit's (--model_name_or_path, --output_dir, --reward_funcs, --dataset,
--learning_rate, ...). The reward file's function may be in TRL's shape, reward(prompts, completions,
**columns), or OpenRLHF's reward_func(queries, prompts, labels). Every flag of `rlhfkit ppo` is here.
"""

from __future__ import annotations

from rlhfkit.cli import train_ppo
from rlhfkit.config.flags import FlagParser

PRESET = "grpo"


def build_parser() -> FlagParser:
    return train_ppo.build_parser(PRESET, "train_grpo", __doc__ or "")


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the command line `argv`; returns the metrics history (as written to metrics.jsonl)."""
    return train_ppo.main(argv, build_parser())


if __name__ == "__main__":
    from rlhfkit.parallel.rendezvous import run_main

    run_main(main)
