"""The Python API: config dataclasses and trainers in the style of TRL, over the same code as the CLIs.

    from rlhfkit import SFTConfig, SFTTrainer, GRPOConfig, GRPOTrainer

    history = SFTTrainer(model_dir, args=SFTConfig(...), train_dataset=rows).train()
    history = GRPOTrainer(sft_dir, reward_funcs=reward_func, args=GRPOConfig(...), train_dataset=prompts).train()

| command    | config         | trainer         | module            |
| ---------- | -------------- | --------------- | ----------------- |
| train_sft  | SFTConfig      | SFTTrainer      | api/offline.py    |
| train_rm   | RewardConfig   | RewardTrainer   | api/offline.py    |
| train_dpo  | DPOConfig      | DPOTrainer      | api/offline.py    |
| train_kto  | KTOConfig      | KTOTrainer      | api/offline.py    |
| train_ppo  | PPOConfig      | PPOTrainer      | api/rl.py         |
|            | GRPOConfig     | GRPOTrainer     | (group_norm)      |
|            | RLOOConfig     | RLOOTrainer     | (rloo)            |

A config's fields are its command's flags (config.py); `train()` resolves the config with the
command's parser and calls the command's `run()` (base.py); models, datasets and reward functions
given as Python objects are adapted in inputs.py; history.py reads the returned history.
This package sits at the top of the layering, beside cli/ (docs/architecture.md, "Packages"); nothing below
imports it. See docs/api.md.
"""

from rlhfkit.api.history import mean_metric, metric_values
from rlhfkit.api.inputs import per_sample
from rlhfkit.api.offline import (
                                 DPOConfig,
                                 DPOTrainer,
                                 KTOConfig,
                                 KTOTrainer,
                                 RewardConfig,
                                 RewardTrainer,
                                 SFTConfig,
                                 SFTTrainer,
)
from rlhfkit.api.rl import (
                                 GRPOConfig,
                                 GRPOTrainer,
                                 PPOConfig,
                                 PPOTrainer,
                                 RLOOConfig,
                                 RLOOTrainer,
)

__all__ = ["SFTConfig", "SFTTrainer", "RewardConfig", "RewardTrainer", "DPOConfig", "DPOTrainer", "KTOConfig",
           "KTOTrainer", "PPOConfig", "PPOTrainer", "GRPOConfig", "GRPOTrainer", "RLOOConfig", "RLOOTrainer",
           "per_sample", "metric_values", "mean_metric"]
