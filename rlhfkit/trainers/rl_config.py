"""The RL loop's configuration (`RLLoopConfig`, from the flags by rl_run/builders.loop_config), its
resumable progress (`RLState`) and the error that ends a run of failed steps."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlhfkit.config.configs import BackendFlags, BatchConfig, CheckpointFlags, LoggingFlags, SamplingFlags
from rlhfkit.config.declare import default_of
from rlhfkit.config.rl_flags import AlgoFlags, CompletionLogFlags, PromptDataFlags, RLTrainFlags, RolloutFlags


@dataclass
class RLLoopConfig:
    rollout_batch_size: int  # global prompts per step
    n_samples_per_prompt: int = default_of(RolloutFlags, "n_samples_per_prompt")
    num_episodes: int = default_of(RLTrainFlags, "num_episodes")
    # RL steps, cycling the prompts; overrides num_episodes
    max_steps: int | None = default_of(BatchConfig, "max_steps")
    seed: int = default_of(BackendFlags, "seed")
    temperature: float = default_of(SamplingFlags, "temperature")
    init_kl_coef: float = 0.0
    kl_estimator: str = default_of(AlgoFlags, "kl_estimator")
    use_kl_loss: bool = default_of(AlgoFlags, "use_kl_loss")
    dynamic_filtering: bool = default_of(AlgoFlags, "dynamic_filtering")
    dynamic_filtering_reward_range: tuple[float, float] = default_of(AlgoFlags, "dynamic_filtering_reward_range",
                                                                     convert=tuple)
    # generation rounds of one step under dynamic filtering (the first included)
    max_filter_rounds: int = default_of(AlgoFlags, "max_filter_rounds")
    freezing_actor_steps: int = default_of(RLTrainFlags, "freezing_actor_steps")
    skip_zero_advantage_steps: bool = True
    logging_steps: int = default_of(LoggingFlags, "logging_steps")
    # a table of samples at step 1 and every N steps (0: off)
    log_completions_steps: int = default_of(CompletionLogFlags, "log_completions_steps")
    log_completions_rows: int = default_of(CompletionLogFlags, "log_completions_rows")
    eval_steps: int = default_of(LoggingFlags, "eval_steps")
    eval_temperature: float = default_of(PromptDataFlags, "eval_temperature")
    eval_n_samples_per_prompt: int = default_of(PromptDataFlags, "eval_n_samples_per_prompt")
    save_steps: int = default_of(CheckpointFlags, "save_steps")
    ckpt_path: str = "./ckpt/checkpoints_ppo"
    max_ckpt_num: int = default_of(CheckpointFlags, "max_ckpt_num")
    load_checkpoint: bool = default_of(CheckpointFlags, "load_checkpoint")
    show_progress: bool = True
    # steps in a row without a trajectory to train on before the run stops
    max_failed_steps: int = default_of(RLTrainFlags, "max_failed_steps")
    # what a dropped sample failed in, as the step lines say it: "user code" (a reward_func file, an agent)
    # or "the reward server" (--remote_rm_url http://...)
    failure_source: str = "user code"
    # the policy's update shape: a rollout that makes one optimizer step (one epoch, at most
    # train_batch_size samples) takes its old log-probs from the training pass (ratio 1) unless
    # recompute_old_logprobs; None = unknown, the separate pass always runs
    policy_max_epochs: int = 1
    policy_train_batch_size: int | None = None
    recompute_old_logprobs: bool = default_of(RLTrainFlags, "recompute_old_logprobs")
    # what makes the run this run (rlhfkit.trainers.run_settings), recorded in each checkpoint and
    # compared on resume; the settings accepted as changed [--allow_resume_changes]
    run_settings: dict[str, Any] = field(default_factory=dict)
    allowed_changes: frozenset[str] = frozenset()
    # a VLM's picture placeholders and markers: never in the loss (where they stand in a trajectory)
    no_loss_token_ids: tuple[int, ...] = ()
    # constants logged with every step, e.g. rows the data reading dropped (data/dropped_image_rows)
    data_metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_failed_steps < 1:
            raise ValueError(f"--max_failed_steps must be >= 1, got {self.max_failed_steps}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"--max_steps must be >= 1, got {self.max_steps}")
        if self.log_completions_steps < 0 or self.log_completions_rows < 1:
            raise ValueError("--log_completions_steps must be >= 0 and --log_completions_rows >= 1, got "
                             f"{self.log_completions_steps} and {self.log_completions_rows}")
        if self.max_filter_rounds < 1:
            raise ValueError(f"--max_filter_rounds must be >= 1, got {self.max_filter_rounds}")


class FailedStepsError(RuntimeError):
    """--max_failed_steps steps in a row left no trajectory to train on; the message names the cause."""


@dataclass
class RLState:
    """Progress of a run. The data cursor: `episode`, the global batches drawn from its order
    (`batch_in_episode`) and the prompts of its order skipped because the step that crossed into
    it had drawn them from the previous episode (`skipped_in_episode`); the next batch starts at
    position `batch_in_episode * rollout_batch_size + skipped_in_episode` of the episode's order."""

    step: int = 0
    episode: int = 0
    batch_in_episode: int = 0
    kl_coef: float = 0.0
    history: list[dict[str, float]] = field(default_factory=list)
    skipped_in_episode: int = 0

    @property
    def cursor(self) -> tuple[int, int, int]:
        return self.episode, self.batch_in_episode, self.skipped_in_episode

    @cursor.setter
    def cursor(self, value: tuple[int, int, int]) -> None:
        self.episode, self.batch_in_episode, self.skipped_in_episode = value
