"""Pure-torch RL math: KL estimators and controllers, reward shaping, advantage estimators,
dynamic filtering and pass@k. Imports nothing but torch (CPU-testable)."""

from rlhfkit.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    AdvantageInputs,
    AdvantageResult,
    compute_advantages,
    get_advantage_estimator,
    group_mean_baseline,
    group_norm_baseline,
    group_reward_std,
    leave_one_out_baseline,
    register_advantage_estimator,
)
from rlhfkit.algo.filters import FilterResult, dynamic_filter, group_passes
from rlhfkit.algo.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    compute_approx_kl,
    make_kl_controller,
)
from rlhfkit.algo.masked import masked_mean, masked_sum, masked_var, whiten
from rlhfkit.algo.passk import pass_at_k, pass_at_k_from_scores
from rlhfkit.algo.returns import discounted_returns, gae_advantages_and_returns, reverse_discounted_cumsum
from rlhfkit.algo.shaping import (
    clip_rewards,
    last_action_index,
    normalize_rewards,
    overlong_penalty,
    reward_stats,
    shape_token_rewards,
    stop_properly_penalty,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AdvantageConfig", "AdvantageInputs", "AdvantageResult", "compute_advantages",
    "get_advantage_estimator", "group_mean_baseline", "group_norm_baseline", "group_reward_std",
    "leave_one_out_baseline", "register_advantage_estimator", "FilterResult", "dynamic_filter", "group_passes",
    "KL_ESTIMATORS", "AdaptiveKLController", "FixedKLController", "compute_approx_kl", "make_kl_controller",
    "masked_mean", "masked_sum", "masked_var", "whiten", "pass_at_k", "pass_at_k_from_scores",
    "discounted_returns", "gae_advantages_and_returns", "reverse_discounted_cumsum", "clip_rewards",
    "last_action_index", "normalize_rewards", "overlong_penalty", "reward_stats", "shape_token_rewards",
    "stop_properly_penalty",
]
