"""Online RL trainers of the Python API: PPO and its family (GRPO, Dr. GRPO, RLOO, REINFORCE++).

    from rlhfkit import GRPOConfig, GRPOTrainer

    def reward_func(queries, prompts, labels):         # the reward_func file format, as a callable
        return [float(q[len(p):].startswith(l)) for q, p, l in zip(queries, prompts, labels)]

    cfg = GRPOConfig(n_samples_per_prompt=8, rollout_batch_size=16, train_batch_size=128,
                     generate_max_len=8, actor_learning_rate=1e-4, max_steps=50, label_key="label")
    history = GRPOTrainer("ckpt/sft", reward_funcs=reward_func, args=cfg, train_dataset=prompts).train()

One loop (`python -m rlhfkit.cli.train_ppo`'s `run()`); the algorithm is the config's
`advantage_estimator` (rlhfkit.algo.advantages):

    PPOConfig()                                    gae: PPO with a critic (value model)
    PPOConfig(advantage_estimator="reinforce")     REINFORCE++ (whitened reward-to-go, no critic)
    GRPOConfig(advantage_estimator="reinforce_baseline")   REINFORCE++-baseline (group mean baseline)
    GRPOConfig()                                   group_norm: GRPO, (r - group mean) / group std
    GRPOConfig(advantage_estimator="dr_grpo")      Dr. GRPO: r - group mean, no std division
    RLOOConfig()                                   rloo: leave-one-out baseline

GRPOConfig and RLOOConfig are PPOConfig with other defaults (listed on each class); every field is
a flag of train_ppo. Rewards (`reward_funcs`): see rlhfkit.api.inputs; a callable is run exactly as
a reward_func file is, `--reward_failure` (stop / drop) included.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Sequence

from rlhfkit.api.base import BaseTrainer
from rlhfkit.api.config import FlagConfig, TRLRLNames, api_config
from rlhfkit.api.inputs import data_source, model_input, reward_inputs
from rlhfkit.config.configs import (BackendFlags, BatchConfig, CheckpointFlags, DataFlags, LabelFlags, LoggingFlags,
                                    ModelFlags, OptimFlags, RefModelFlags, RewardModelFlags, SamplingFlags,
                                    ValueHeadFlags, VisionFlags)
from rlhfkit.config.flag_parser import ConsoleFlags
from rlhfkit.config.rl_flags import (AlgoFlags, BestCheckpointFlags, CompletionLogFlags, CriticOptimFlags, Estimator,
                                     PlacementFlags, PromptDataFlags, RewardSourceFlags, RLModelFlags, RLTrainFlags,
                                     RolloutFlags)
from rlhfkit.models.given import GivenModels


@api_config
class PPOConfig(FlagConfig, TRLRLNames, ConsoleFlags, ModelFlags, BackendFlags, CheckpointFlags, LoggingFlags,
                CompletionLogFlags, BestCheckpointFlags, RewardModelFlags, ValueHeadFlags, RefModelFlags, RLModelFlags,
                RewardSourceFlags, SamplingFlags, RolloutFlags, PromptDataFlags, DataFlags, LabelFlags, VisionFlags,
                BatchConfig, RLTrainFlags, OptimFlags, CriticOptimFlags, AlgoFlags, PlacementFlags):
    """RL settings: the flags of `python -m rlhfkit.cli.train_ppo` as fields (same defaults)."""

    COMMAND: ClassVar[str] = "train_ppo"
    INPUTS: ClassVar[tuple[str, ...]] = ("pretrain", "prompt_data", "eval_dataset", "remote_rm_url")
    wandb_project: str = "rlhfkit_train_ppo"
    max_len: int | None = None
    max_samples: int = 100_000_000
    micro_train_batch_size: int = 1
    max_epochs: int = 1


@api_config
class GRPOConfig(PPOConfig):
    """PPOConfig with GRPO's defaults: group_norm advantages over groups of 8 samples, KL to the
    reference as a loss term (k3, coefficient 1e-3), as OpenRLHF's GRPO recipe."""

    advantage_estimator: Estimator = "group_norm"
    n_samples_per_prompt: int = 8
    use_kl_loss: bool = True
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    init_kl_coef: float = 1e-3


@api_config
class RLOOConfig(PPOConfig):
    """PPOConfig with RLOO's defaults: leave-one-out baseline over groups of 4 samples."""

    advantage_estimator: Estimator = "rloo"
    n_samples_per_prompt: int = 4


class PPOTrainer(BaseTrainer):
    """`PPOTrainer(model, reward_funcs=None, args=PPOConfig(...), train_dataset=prompts, eval_dataset=None,
    processing_class=None, reward_weights=None, ref_model=None)`.

    train_dataset / eval_dataset: prompt rows (`input_key`, optional `label_key` handed to the reward).
    reward_funcs: a callable reward_func(queries, prompts, labels), a list of them (summed with
    `reward_weights`), a reward_func .py path or URL, or a reward model directory; may be None when
    the config names `reward_pretrain` or `agent_func_path`. Evaluation (eval_dataset, eval_steps)
    scores with the same reward functions."""

    config_class = PPOConfig

    def __init__(self, model: Any, reward_funcs: Any = None, args: PPOConfig | None = None,
                 train_dataset: Any = None, eval_dataset: Any = None, processing_class: Any = None,
                 tokenizer: Any = None, reward_weights: Sequence[float] | None = None, ref_model: Any = None) -> None:
        super().__init__(model, args, train_dataset, eval_dataset, processing_class, tokenizer)
        self.reward_funcs, self.reward_weights, self.ref_model = reward_funcs, reward_weights, ref_model
        self._ref_path: str | None = None
        self._ref_module: Any = None
        if ref_model is not None:
            self._ref_path, self._ref_module = model_input(ref_model, "ref_model")
        reward_inputs(reward_funcs, reward_weights)  # bad reward_funcs fail here, not after loading models

    def _inputs(self) -> dict[str, Any]:
        out = {"pretrain": self._pretrain,
               "prompt_data": data_source(self.train_dataset, "train_dataset"),
               "eval_dataset": data_source(self.eval_dataset, "eval_dataset")}
        if self._ref_path is not None:
            out["ref_pretrain"] = self._ref_path
        rewards = reward_inputs(self.reward_funcs, self.reward_weights)
        if "reward_pretrain" in rewards and self.args.reward_pretrain:
            raise ValueError("reward_funcs names a reward model and the config sets reward_pretrain: give one")
        return {**out, **rewards}

    def _run(self, ns: Any, parser: Any) -> Any:
        from rlhfkit.cli import train_ppo

        return train_ppo.run(ns, parser, given=self._given())

    def _given(self) -> GivenModels:
        return GivenModels(policy=self._module, tokenizer=self._tokenizer, ref=self._ref_module)

    @property
    def backend(self) -> Any:
        return self._require_result().placement.policy_backend


class GRPOTrainer(PPOTrainer):
    """PPOTrainer whose default config is GRPOConfig()."""

    config_class = GRPOConfig


class RLOOTrainer(PPOTrainer):
    """PPOTrainer whose default config is RLOOConfig()."""

    config_class = RLOOConfig


__all__ = ["PPOConfig", "PPOTrainer", "GRPOConfig", "GRPOTrainer", "RLOOConfig", "RLOOTrainer"]
