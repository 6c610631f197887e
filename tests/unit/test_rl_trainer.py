"""`RLTrainer` over fake role groups: the loop's data flow, checked by hand, with no model at all.

A fake executor returns two prompts x two samples with rewards (1, 0) and (0.5, 0.5); the policy
group records what it is asked. GRPO's group_norm gives the first group advantages
(1 - 0.5) / (std + eps) = +-0.5 / (0.7071 + 1e-6) (unbiased std of (1, 0)) and the second group
exactly 0 (equal rewards); every action token of a sample carries its sample's advantage. The test
also checks the order of the calls (old log-probs before training, weights after), that the
weight-sync object runs once per step, that a step whose rollout returns nothing is skipped and
counted without touching the policy, and that fit() saves at --save_steps with the data cursor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from rlhfkit.agents.contracts import EpisodeBatch
from rlhfkit.algo.advantages import AdvantageConfig
from rlhfkit.algo.experience import RewardShapingConfig
from rlhfkit.algo.kl import FixedKLController
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.trainers.rl import RLLoopConfig, RLTrainer
from rlhfkit.types import PromptSample, Trajectory

PROMPT, ACTIONS = [5, 6, 7], 2  # 3 prompt tokens, 2 action tokens per sample


def traj(reward: float, group: int) -> Trajectory:
    ids = PROMPT + [10 + group, 20]
    return Trajectory(token_ids=ids, action_mask=[0, 0, 0, 1, 1], rollout_logprobs=[0, 0, 0, -0.5, -0.5],
                      prompt_len=3, reward=reward, score=reward, group_index=group)


@dataclass
class FakeExecutor:
    rewards: list[list[float]]
    empty_steps: set[int] = field(default_factory=set)
    calls: int = 0
    seeds: list[int] = field(default_factory=list)

    def reseed(self, seed: int) -> None:
        self.seeds.append(seed)

    async def run_episodes(self, prompts, n):
        step = self.calls
        self.calls += 1
        if step in self.empty_steps:
            return EpisodeBatch([])
        return EpisodeBatch([traj(r, g) for g, group in enumerate(self.rewards[:len(prompts)]) for r in group[:n]])


@dataclass
class FakePolicy:
    """The loop's PolicyCalls contract; records the calls."""
    log: list = field(default_factory=list)
    name: str = "policy"

    def forward_logprobs(self, batch, temperature):
        self.log.append(("forward_logprobs", (batch, temperature)))
        return torch.full(batch.input_ids.shape, -0.5)

    def train_on(self, batch, kl_coef):
        self.log.append(("train_on", (batch, kl_coef)))
        return {"policy_loss": 0.25}


@dataclass
class FakeSync:
    calls: int = 0

    def sync(self) -> dict[str, float]:
        self.calls += 1
        return {"time/weight_push": 0.0}


class FakeLogger:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict]] = []
        self.samples: list[tuple[int, list]] = []

    def start(self, step) -> None:
        pass

    def log(self, step, m, console=False, total=None) -> None:
        self.logged.append((step, dict(m)))

    def log_completions(self, step, rows) -> None:
        self.samples.append((step, rows))

    def truncate(self, step) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class FakeCheckpointer:
    """An RLCheckpointing that records what it saves (no --best_metric_key: never a best checkpoint)."""

    saved: list = field(default_factory=list)

    def save(self, root, tag, client, max_keep) -> None:
        self.saved.append((tag, dict(client)))

    def save_resumable(self, root, tag, client, max_keep) -> str:
        self.save(root, tag, client, max_keep)
        return f"{root}/{tag}"

    def keep_best(self, root, step, metrics, client) -> bool:
        return False

    def load(self, root):
        return None


def make(rewards, steps=2, empty=(), save_steps=-1):
    policy, sync, ex = FakePolicy(), FakeSync(), FakeExecutor(rewards, set(empty))
    cfg = RLLoopConfig(rollout_batch_size=2, n_samples_per_prompt=2, max_steps=steps, show_progress=False,
                       save_steps=save_steps, skip_zero_advantage_steps=False)
    prompts = [PromptSample(prompt=f"p{i}", index=i) for i in range(8)]
    trainer = RLTrainer(cfg, AdvantageConfig(advantage_estimator="group_norm", n_samples_per_prompt=2), RewardShapingConfig(),
                        policy=policy, executor=ex, prompts=prompts, dist=DistInfo(),
                        logger=FakeLogger(), pad_token_id=0, kl_ctl=FixedKLController(0.0),
                        checkpointer=FakeCheckpointer(), weight_sync=sync)
    return trainer, policy, sync, ex


def test_one_step_by_hand():
    trainer, policy, sync, ex = make([[1.0, 0.0], [0.5, 0.5]])
    m = trainer.train_step()
    assert [name for name, _ in policy.log] == ["forward_logprobs", "train_on"]
    batch = policy.log[1][1][0]
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    want = torch.tensor([a, -a, 0.0, 0.0])[:, None] * batch.loss_mask
    torch.testing.assert_close(batch.advantages * batch.loss_mask, want, rtol=1e-5, atol=1e-6)
    assert batch.loss_mask.sum() == 4 * ACTIONS
    assert sync.calls == 1 and m["reward"] == pytest.approx(0.5) and m["policy_loss"] == 0.25
    assert m["skipped_steps"] == 0


def test_a_step_without_trajectories_is_skipped_and_the_loop_goes_on():
    trainer, policy, sync, ex = make([[1.0, 0.0], [0.5, 0.5]], steps=3, empty={1})
    trainer.fit()
    steps = [(s, m["skipped_steps"]) for s, m in trainer.logger.logged]
    assert steps == [(1, 0.0), (2, 1.0), (3, 0.0)]
    assert [name for name, _ in policy.log].count("train_on") == 2  # not for the skipped step
    assert sync.calls == 2 and ex.calls == 3


def test_fit_saves_at_save_steps_with_the_data_cursor():
    trainer, _, _, _ = make([[1.0, 0.0], [0.5, 0.5]], steps=4, save_steps=2)
    trainer.fit()
    tags = [(tag, c["step"], c["batch_in_episode"]) for tag, c in trainer.checkpointer.saved]
    assert tags == [("global_step2", 2, 2), ("global_step4", 4, 4)]


def test_run_coroutine_does_not_repr_the_result():
    """asyncio.run on the main thread formats the finished main task (and its result) when it restores
    the SIGINT handler; run_coroutine returns the same value without that."""
    import asyncio
    import signal
    import threading

    from rlhfkit.trainers.rl import run_coroutine

    calls = []

    class Costly:
        def __repr__(self):
            calls.append(1)
            return "Costly()"

    async def make():
        return [Costly() for _ in range(10)]

    out = run_coroutine(make())
    assert len(out) == 10 and all(isinstance(x, Costly) for x in out)
    assert calls == []
    if threading.current_thread() is threading.main_thread():  # the cost it avoids, where it occurs:
        # asyncio.run installs its own SIGINT handler only over Python's default one (an earlier test of this
        # process may have left the run's stop handler installed)
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            asyncio.run(make())
        finally:
            signal.signal(signal.SIGINT, previous)
        assert calls


def test_max_steps_cycles_the_prompts_past_num_episodes():
    """8 prompts in batches of 2 are 4 steps an episode; --max_steps 6 (num_episodes 1) takes 6 steps,
    the last 2 from the second episode's order."""
    trainer, policy, _, ex = make([[1.0, 0.0], [0.5, 0.5]], steps=6)
    assert trainer.cfg.num_episodes == 1 and trainer.total_steps() == 6
    state = trainer.fit()
    assert state.step == 6 and ex.calls == 6 and [s for s, _ in trainer.logger.logged] == [1, 2, 3, 4, 5, 6]
    assert (state.episode, state.batch_in_episode) == (1, 2)
    with pytest.raises(ValueError, match="--max_steps must be >= 1"):
        RLLoopConfig(rollout_batch_size=2, max_steps=0)


def test_completions_table_at_step_1_and_every_n_steps_from_many_prompts():
    """--log_completions_steps 2 logs steps 1, 2, 4 (of 4); each table takes the first sample of each
    prompt before any second one (rows 3 of 2 prompts x 2 samples: p0 s0, p1 s0, p0 s1)."""
    trainer, _, _, _ = make([[1.0, 0.0], [0.5, 0.25]], steps=4)
    trainer.cfg.log_completions_steps, trainer.cfg.log_completions_rows = 2, 3
    trainer.fit()
    assert [s for s, _ in trainer.logger.samples] == [1, 2, 4]
    rows = trainer.logger.samples[0][1]
    assert [r.reward for r in rows] == [1.0, 0.5, 0.0]
    trainer, _, _, _ = make([[1.0, 0.0], [0.5, 0.25]], steps=2)
    trainer.cfg.log_completions_steps = 0
    trainer.fit()
    assert trainer.logger.samples == []
