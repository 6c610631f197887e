"""RLOO with the defaults of TRL's RLOOConfig: `rlhfkit rloo` (train_ppo's flags and loop).

    rlhfkit rloo --pretrain MODEL --dataset prompts.jsonl --reward_funcs reward.py --output_dir ckpt/rloo

Defaults (rlhfkit.config.rl_flags.PRESETS["rloo"]): --advantage_estimator rloo (leave-one-out baseline),
2 samples per prompt (--num_generations), completions of up to 256 tokens (--max_completion_length),
learning rate 1e-6, a KL penalty of 0.05 in the reward (--beta), 4 prompts x 2 samples per step and one
optimizer step of 8 (--per_device_train_batch_size), 3 passes over the prompts (--num_train_epochs), a
linear schedule without warm-up, a log line every 10 steps, the prompt in the `prompt` column. TRL's flag
names are accepted beside rlhfkit's, and reward functions in TRL's shape, as in `rlhfkit grpo`. Every flag
of `rlhfkit ppo` is here.
"""

from __future__ import annotations

from rlhfkit.cli import train_ppo
from rlhfkit.config.flags import FlagParser

PRESET = "rloo"


def build_parser() -> FlagParser:
    return train_ppo.build_parser(PRESET, "train_rloo", __doc__ or "")


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the command line `argv`; returns the metrics history (as written to metrics.jsonl)."""
    return train_ppo.main(argv, build_parser())


if __name__ == "__main__":
    from rlhfkit.parallel.rendezvous import run_main

    run_main(main)
