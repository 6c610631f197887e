"""The online RL loop (PPO, REINFORCE++, RLOO, GRPO, ...), written once against role groups.

    prompts (this rank's share of --rollout_batch_size)
      -> executor.run_episodes(prompts, n)  [engine generates; reward_func / HTTP / agent scores]
      -> dynamic filtering (whole groups)   [--dynamic_filtering]
         (group estimators also leave out a group that lost a sample under --reward_failure drop)
      -> pad into an ExperienceBatch
      -> reward.forward_rewards(batch)     [reward model, when no reward source scored it]
      -> length penalties
      -> policy.forward_logprobs(batch) = old     [skipped when the rollout makes one optimizer step]
         ref.forward_logprobs(batch) = ref, critic.forward_values(batch)
      -> KL (in reward or as loss), advantages / returns    (rlhfkit.algo)
      -> critic.train_on(batch), policy.train_on(batch, kl)   (max_epochs x mini-batches)
      -> weight_sync.sync()                  [the policy's weights into the engines; one object per placement]

Under torchrun every data-parallel rank runs this loop on its own prompts (the tp / cp ranks of
one dp rank share its prompts and train on the trajectories the first of them sampled); roles
reduce their loss counts over the dp group, and every logged metric is reduced over it (rank 0
logs the global values); decisions every rank must share (skip a step, stop filtering) are
reduced over the world. The roles are typed handles (rlhfkit/roles/handles.py) over a group in this
process or, on Ray, a group whose calls fan out to actors; the loop does not change.

A step after which some rank has no trajectory to train on (every sample dropped under
--reward_failure drop, or dynamic filtering kept no group) is skipped on every rank (the decision
is all-reduced) and logged with `skipped_steps` = 1 and one line naming the cause;
--max_failed_steps such steps in a row end the run with `FailedStepsError`.

Prompts: each episode is a seeded permutation of the prompt set, read one global batch of
--rollout_batch_size prompts at a time (rank r takes its share of each). Under dynamic filtering
a step that lacks groups draws further batches ("rounds", logged as `filter_rounds`), at most
--max_filter_rounds in all; a round never repeats a prompt this step already drew: when it runs
into the next episode it skips those prompts there (`RLState.skipped_in_episode` counts them,
so the cursor saved with a checkpoint resumes at the same prompt), and the rounds stop when
fewer than a batch of prompts remain undrawn in this step.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import math
import os
from typing import Any, Sequence

import torch

from rlhfkit.backend import host_gc
from rlhfkit.checkpoint.layout import checkpoint_gap
from rlhfkit.algo.advantages import AdvantageConfig, equal_groups, get_advantage_estimator
from rlhfkit.algo.experience import (RewardShapingConfig, apply_length_penalties, finish_experience,
                                     pad_trajectories)
from rlhfkit.algo.filters import dynamic_filter
from rlhfkit.algo.passk import pass_at_k_from_scores
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.trainers.metrics import PhaseClock, SampleRow, metrics_record, progress_bar
from rlhfkit.trainers.offline import epoch_order, warn_if_no_space
from rlhfkit.roles.handles import CriticCalls, PolicyCalls, ReferenceCalls, RewardCalls
from rlhfkit.trainers.rl_config import FailedStepsError, RLLoopConfig, RLState
from rlhfkit.trainers.rl_contracts import EngineMemory, EpisodeRunner, KLControl, RLCheckpointing, StepLogger
from rlhfkit.trainers.run_settings import check_same_run
from rlhfkit.weightsync.sync import WeightSync
from rlhfkit.trainers.stop import StepAbandoned
from rlhfkit.trainers.stop import current as stop_signals
from rlhfkit.trainers.rl_step_info import complete_groups, global_experience_metrics, skip_cause
from rlhfkit.types import PromptSample, Trajectory

log = logging.getLogger(__name__)

__all__ = ["FailedStepsError", "RLLoopConfig", "RLState", "RLTrainer", "freeze_gc_once"]


def run_coroutine(coro: Any) -> Any:
    """`asyncio.run(coro)`, with the result kept out of the main task. On the main thread asyncio.run
    asks `signal.getsignal(SIGINT)` when it ends, and CPython's conversion of the handler to an enum
    fails with a message that formats the handler, a partial holding the finished task and so its
    result: the repr of six whole trajectories, every step."""
    box: list[Any] = []

    async def main() -> None:
        box.append(await coro)

    asyncio.run(main())
    return box[0]


_GC_FROZEN = False


def freeze_gc_once() -> None:
    """After the first full step, move everything alive (models, compiled graphs, CUDA graphs, tokenizers:
    millions of objects that live for the whole run) out of the cyclic garbage collector's reach: a later
    full collection no longer walks them (a full collection of them costs a large share of a small
    step: bench/rl_step.py's gc_s_each). Cycles made later are still collected."""
    global _GC_FROZEN
    if not _GC_FROZEN:
        gc.collect()
        gc.freeze()
        _GC_FROZEN = True


def sample_rows(trajs: Sequence[Trajectory], n: int, rows: int) -> list[SampleRow]:
    """`rows` of a step's trajectories for the completions table, from as many prompts as possible: the
    first sample of each prompt's group of `n`, then the second, ..."""
    order = sorted(range(len(trajs)), key=lambda i: (i % max(n, 1), i // max(n, 1)))[:rows]
    return [SampleRow(trajs[i].prompt, trajs[i].response, trajs[i].reward, trajs[i].label) for i in order]


class RLTrainer:
    def __init__(self, cfg: RLLoopConfig, adv_cfg: AdvantageConfig, shaping: RewardShapingConfig, *,
                 policy: PolicyCalls, weight_sync: WeightSync, executor: EpisodeRunner,
                 prompts: Sequence[PromptSample], dist: DistInfo, logger: StepLogger, pad_token_id: int,
                 kl_ctl: KLControl, ref: ReferenceCalls | None = None, critic: CriticCalls | None = None,
                 reward_model: RewardCalls | None = None, eval_executor: EpisodeRunner | None = None,
                 eval_prompts: Sequence[PromptSample] = (), checkpointer: RLCheckpointing | None = None,
                 engine_memory: EngineMemory | None = None) -> None:
        self.cfg, self.adv_cfg, self.shaping = cfg, adv_cfg, shaping
        self.policy, self.ref, self.critic, self.reward_model = policy, ref, critic, reward_model
        self.executor, self.eval_executor = executor, eval_executor
        self.weight_sync = weight_sync
        self.prompts, self.eval_prompts = list(prompts), list(eval_prompts)
        self.dist, self.logger, self.pad_token_id = dist, logger, pad_token_id
        self.kl_ctl, self.checkpointer = kl_ctl, checkpointer
        self.engine_memory = engine_memory  # released after each rollout, restored before a generation
        if cfg.rollout_batch_size % dist.dp_size:
            what = "world size" if dist.dp_size == dist.world_size else "data-parallel size"
            raise ValueError(f"--rollout_batch_size ({cfg.rollout_batch_size}) must be a multiple of the {what} "
                             f"({dist.dp_size})")
        self.per_rank = cfg.rollout_batch_size // dist.dp_size
        self.batches_per_episode = len(self.prompts) // cfg.rollout_batch_size
        if self.batches_per_episode == 0:
            raise ValueError(f"--prompt_data has {len(self.prompts)} prompts, fewer than --rollout_batch_size "
                             f"({cfg.rollout_batch_size})")
        self.state = RLState(kl_coef=kl_ctl.value)
        self._total: int | None = None  # the step count, set by fit()
        self.group_estimator = get_advantage_estimator(adv_cfg.advantage_estimator).group
        self.num_dropped = 0
        self.num_skipped = 0  # steps skipped for want of a trajectory, in all
        self.failed_in_row = 0  # ... in a row, up to now
        self._skip_cause = ""
        self._samples: list[Trajectory] = []  # the last step's trajectories (--log_completions_steps)
        self._no_signal_noted = False  # the hint about a step whose groups all had equal rewards was printed

    # ------------------------------------------------------------------ prompts

    def total_steps(self) -> int:
        """--max_steps when given (the prompts cycled as often as needed), else --num_episodes passes."""
        c = self.cfg
        return c.max_steps if c.max_steps is not None else self.batches_per_episode * c.num_episodes

    def _next_prompts(self, used: set[int] | None = None) -> tuple[list[PromptSample], int] | None:
        """This rank's prompts of the next global batch and the global index of its first one (for
        the sampling seeds), skipping the dataset indices in `used` (the prompts this step already
        drew; they are added to it). None when fewer than a batch of prompts lie outside `used`."""
        s, c = self.state, self.cfg
        size, count = c.rollout_batch_size, len(self.prompts)
        used = set() if used is None else used
        if count - len(used) < size:
            return None
        while True:
            start = s.batch_in_episode * size + s.skipped_in_episode
            if s.batch_in_episode >= self.batches_per_episode or start + size > count:
                s.episode, s.batch_in_episode, s.skipped_in_episode = s.episode + 1, 0, 0
                continue
            picked: list[int] = []
            skipped = 0
            for i in epoch_order(count, s.episode, c.seed)[start:]:
                if len(picked) == size:
                    break
                if i in used:
                    skipped += 1
                else:
                    picked.append(i)
            if len(picked) < size:  # this episode's remaining prompts were drawn already: the next one
                s.episode, s.batch_in_episode, s.skipped_in_episode = s.episode + 1, 0, 0
                continue
            me = self.dist.dp_rank
            first = s.batch_in_episode * size + me * self.per_rank
            s.batch_in_episode += 1
            s.skipped_in_episode += skipped
            used.update(picked)
            mine = picked[me * self.per_rank:(me + 1) * self.per_rank]
            return [self.prompts[i] for i in mine], first

    # ------------------------------------------------------------------ rollout

    def _reseed(self, executor: EpisodeRunner, salt: int, first_global: int, n: int) -> None:
        """Per-episode seeds that depend on (seed, step, global sample index) only, so runs are
        reproducible across resumes and equal for any number of ranks."""
        base = (self.cfg.seed * 1_000_003 + salt * 10_007) % (2**31 - 1)
        executor.reseed(base + first_global * n)

    def _generate(self, executor: EpisodeRunner, prompts: list[PromptSample], n: int, salt: int, first_global: int):
        self._reseed(executor, salt, first_global, n)
        if self.engine_memory is not None:
            self.engine_memory.restore()
        return run_coroutine(executor.run_episodes(prompts, n))

    def rollout(self) -> tuple[list[Trajectory], dict[str, float]]:
        """Trajectories of this dp rank's prompts (and refill rounds under dynamic filtering); the
        tp / cp ranks of one dp rank all get those of its first rank (sampling need not be
        bit-identical across devices, and they must train on the same rows)."""
        c, n = self.cfg, self.cfg.n_samples_per_prompt
        kept: list[Trajectory] = []
        passed = seen = dropped = incomplete = 0
        first_drop = None  # this rank's first dropped sample (one line per step names it)
        used: set[int] = set()  # dataset indices drawn in this step (the same set on every rank)
        rounds = 0
        for r in range(c.max_filter_rounds if c.dynamic_filtering else 1):
            drawn = self._next_prompts(used)
            if drawn is None:  # every prompt was drawn in this step (r >= 1: round 0 always has a batch)
                break
            prompts, first = drawn
            rounds += 1
            out = self._generate(self.executor, prompts, n, self.state.step * 131 + r, first)
            dropped += out.num_dropped
            first_drop = first_drop or (out.dropped[0] if out.dropped else None)
            trajs = out.trajectories
            if not c.dynamic_filtering:
                kept = trajs
                if out.num_dropped and n > 1 and self.group_estimator:
                    # a group missing a dropped sample would shift every later row into the wrong group
                    kept = [t for g in complete_groups(trajs, n) for t in g]
                    incomplete += len(trajs) - len(kept)
                break
            groups = complete_groups(trajs, n)
            seen += len(groups)
            if groups:
                scores = torch.tensor([t.score for g in groups for t in g], dtype=torch.float64)
                lo, hi = c.dynamic_filtering_reward_range
                res = dynamic_filter(scores, n, (lo, hi))
                for gi in res.kept_groups.tolist():
                    kept.extend(groups[gi])
                passed += len(res.kept_groups)
            need = self.per_rank * n
            if float(self.dist.all_reduce_world(torch.tensor(float(len(kept) >= need)), op="min")) == 1.0:
                kept = kept[:need]
                break
        dropped, incomplete, passed, seen = self.dist.all_reduce_dp(
            torch.tensor([dropped, incomplete, passed, seen], dtype=torch.float64)).tolist()
        self.num_dropped += int(dropped)
        if dropped and self.dist.rank == 0:
            which = (f"; the first: {first_drop.reason}; prompt: {first_drop.prompt[:200]!r}" if first_drop
                     else " (on other ranks)")
            log.warning(f"step {self.state.step + 1}: {int(dropped)} sample(s) dropped (--reward_failure drop){which}")
        metrics = {"dropped_samples": dropped}
        if incomplete:
            metrics["incomplete_group_samples"] = incomplete
        if c.dynamic_filtering:
            metrics["dynamic_filtering_pass_rate"] = passed / max(seen, 1.0)
            metrics["filter_rounds"] = float(rounds)
        return self.dist.broadcast_replica((kept, metrics))

    # ------------------------------------------------------------------ one step

    def train_step(self) -> dict[str, float]:
        host_gc.pause()  # the garbage collector runs where the host next waits for the GPU (host_gc.py)
        try:
            return self._train_step()
        finally:
            host_gc.collect_deferred()  # if no optimizer step of this process did

    def _train_step(self) -> dict[str, float]:
        self._samples = []
        t = PhaseClock()
        with t("generate"):
            trajs, metrics = self.rollout()
        if self.engine_memory is not None:
            with t("engine_sleep"):
                self.engine_memory.release()
        # decided on every rank together: a rank skipping alone would leave the others in a collective
        empty_ranks = int(self.dist.all_reduce_world(torch.tensor(float(not trajs))).item())
        metrics["skipped_steps"] = float(empty_ranks > 0)
        if empty_ranks:
            self._skip_cause = skip_cause(metrics, self.cfg, empty_ranks, self.dist.world_size)
            metrics["time/generate"] = metrics["time/step"] = t["generate"]
            return metrics
        batch = pad_trajectories(trajs, self.pad_token_id, self.cfg.no_loss_token_ids)
        with t("reward"):
            if self.reward_model is not None:
                batch.rewards = self.reward_model.forward_rewards(batch)
                for tr, r in zip(trajs, batch.rewards.tolist()):
                    tr.score = tr.reward = r
        self._samples = trajs
        resp_len = batch.loss_mask.sum(-1).float()
        truncated = torch.tensor([float(tr.truncated) for tr in trajs])
        assert batch.rewards is not None  # pad_trajectories gives every row its reward
        raw_reward = batch.rewards.clone()
        batch.rewards = apply_length_penalties(batch.rewards, resp_len, truncated.bool(), self.shaping)
        group_rewards = batch.rewards.clone()  # what the advantage estimator compares within a group
        with t("logprobs"):
            if self._old_logprobs_pass(batch):
                batch.old_logprobs = self.policy.forward_logprobs(batch, self.cfg.temperature)
            metrics["old_logprobs_pass"] = float(batch.old_logprobs is not None)
            if self.ref is not None:
                batch.ref_logprobs = self.ref.forward_logprobs(batch, self.cfg.temperature)
            if self.critic is not None:
                batch.values = self.critic.forward_values(batch)
        batch, exp_m = finish_experience(batch, self.adv_cfg, self.kl_ctl.value, self.cfg.kl_estimator,
                                         kl_in_reward=not self.cfg.use_kl_loss, reduce=self.dist.all_reduce_dp)
        exp_m = global_experience_metrics(exp_m, batch, self.dist)
        train_m: dict[str, float] = {}
        stop_signals().commit()  # from here the step changes the weights: it is never abandoned
        with t("train"):
            if self.critic is not None:
                train_m.update(self.critic.train_on(batch))
            if self.state.step >= self.cfg.freezing_actor_steps:
                if self._has_signal(batch):
                    train_m.update(self.policy.train_on(batch, self.kl_ctl.value))
                else:
                    train_m["skipped_zero_advantage"] = 1.0
        with t("weight_sync"):
            metrics.update(self.weight_sync.sync())
        self.kl_ctl.update(train_m.get("kl", exp_m.get("kl", 0.0)), self.cfg.rollout_batch_size * self.cfg.n_samples_per_prompt)
        shaped = exp_m.pop("reward", None)  # every rank has rows here: always there
        if shaped is not None and (self.shaping.overlong_buffer_len
                                   or self.shaping.stop_properly_penalty_coef is not None):
            metrics["shaped_reward"] = shaped  # after length penalties; `reward` is the raw one
        metrics.update(self._rollout_metrics(trajs, raw_reward, resp_len, truncated, group_rewards))
        metrics.update(exp_m)
        metrics.update(train_m)
        if "ppo_clip_ratio" in train_m:
            metrics["clip_ratio"] = train_m["ppo_clip_ratio"]  # the name for it
        metrics["kl_coef"] = self.kl_ctl.value
        step_time = sum(t.values())
        metrics.update({f"time/{k}": v for k, v in t.items()})
        metrics["time/step"] = step_time
        metrics["generate_share"] = t["generate"] / max(step_time, 1e-9)
        metrics.update(self.cfg.data_metrics)
        freeze_gc_once()
        return metrics

    def _old_logprobs_pass(self, batch) -> bool:
        """Whether the old policy's log-probs need a pass of their own. Not when this rollout makes
        exactly one optimizer step of a policy that trains this step: the policy that scores the
        samples in training is then the old one, so its log-probs (detached) are the old ones and the
        ratio is 1 (as TRL's GRPOTrainer does). Also needed for a KL penalty in the reward, which is
        computed before training, and for an adaptive KL controller."""
        c = self.cfg
        if c.recompute_old_logprobs or c.policy_train_batch_size is None or c.policy_max_epochs != 1:
            return True
        if self.state.step < c.freezing_actor_steps or self.kl_ctl.adaptive:
            return True
        if self.ref is not None and not c.use_kl_loss:
            return True
        rows = self.dist.all_reduce_dp(torch.tensor(float(batch.batch_size), dtype=torch.float64))
        return float(rows) > c.policy_train_batch_size

    def _has_signal(self, batch) -> bool:
        """False when every advantage is 0 and no KL / entropy term could move the policy."""
        if not self.cfg.skip_zero_advantage_steps or self.cfg.use_kl_loss:
            return True
        mag = float((batch.advantages.abs() * batch.loss_mask).sum())
        return float(self.dist.all_reduce_world(torch.tensor(mag, dtype=torch.float64))) > 0

    def _rollout_metrics(self, trajs, raw_reward, resp_len, truncated, shaped=None) -> dict[str, float]:
        """Global means over ranks of the rollout statistics; with n > 1 samples per prompt also
        `equal_reward_groups`, the share of complete groups whose rewards (`shaped`: after length
        penalties, what the advantage estimator sees) are all equal."""
        n = float(len(trajs))
        equal, groups = self._equal_groups(trajs, raw_reward if shaped is None else shaped)
        sums = torch.tensor([n, float(raw_reward.sum()), float((raw_reward ** 2).sum()), float(resp_len.sum()),
                             float(truncated.sum()), equal, groups], dtype=torch.float64)
        extra_keys = sorted({k for tr in trajs for k in tr.extra_logs})
        extra = torch.tensor([sum(float(tr.extra_logs.get(k, 0.0)) for tr in trajs) for k in extra_keys],
                             dtype=torch.float64)
        tot = self.dist.all_reduce_dp(torch.cat([sums, extra]))
        cnt = max(float(tot[0]), 1.0)
        mean = float(tot[1]) / cnt
        out = {"reward": mean, "reward_std": math.sqrt(max(float(tot[2]) / cnt - mean * mean, 0.0)),
               "response_length": float(tot[3]) / cnt, "truncated_rate": float(tot[4]) / cnt}
        if self.cfg.n_samples_per_prompt > 1 and float(tot[6]) > 0:
            out["equal_reward_groups"] = float(tot[5]) / float(tot[6])
        out.update({k: float(v) / cnt for k, v in zip(extra_keys, tot[7:].tolist())})
        return out

    def _equal_groups(self, trajs: Sequence[Trajectory], rewards: torch.Tensor) -> tuple[float, float]:
        """(groups whose n rewards are equal, complete groups) among this rank's trajectories."""
        n = self.cfg.n_samples_per_prompt
        if n <= 1 or not len(trajs):
            return 0.0, 0.0
        rows: list[list[int]] = []
        for _, g in itertools.groupby(range(len(trajs)), key=lambda i: trajs[i].group_index):
            idx = list(g)
            if len(idx) == n:
                rows.append(idx)
        if not rows:
            return 0.0, 0.0
        table = rewards.detach().double().cpu()[torch.tensor(rows)]
        return float(equal_groups(table).sum()), float(len(rows))

    def _note_no_signal(self, m: dict[str, float]) -> None:
        """One hint per run (rank 0) at the first step where no group had different rewards: a group
        estimator then has all-zero advantages, so the reward taught the policy nothing (policy_loss=0)."""
        if (self._no_signal_noted or not self.group_estimator or m.get("equal_reward_groups") != 1.0
                or self.dist.rank != 0):
            return
        self._no_signal_noted = True
        c = self.cfg
        same = (f"; every sample got reward {m['reward']:.4g}" if m.get("reward_std") == 0.0 and "reward" in m
                else "")
        log.warning(
            f"hint: step {self.state.step}: in every group the {c.n_samples_per_prompt} samples of a prompt got the "
            f"same reward{same}, so the advantages ({self.adv_cfg.advantage_estimator}) are all 0: no learning "
            "signal from the reward this step (policy_loss=0). If it goes on: check the reward on a few completions "
            "(completions.jsonl; a reward that is always the same value teaches nothing), raise "
            "--n_samples_per_prompt, or make the task easier for this model. Shown once; equal_reward_groups on "
            "the step lines is the share of such groups.")

    # ------------------------------------------------------------------ evaluation

    def evaluate(self) -> dict[str, float]:
        if not self.eval_prompts or self.eval_executor is None:
            return {}
        n = self.cfg.eval_n_samples_per_prompt
        share = self.eval_prompts[self.dist.dp_rank::self.dist.dp_size]
        out = self._generate(self.eval_executor, share, n, 99_991, self.dist.dp_rank * n)
        groups = complete_groups(out.trajectories, n)
        scores = torch.tensor([t.score for g in groups for t in g], dtype=torch.float32)
        rewards = torch.tensor([t.reward for g in groups for t in g], dtype=torch.float32)
        p1 = pass_at_k_from_scores(scores, n, 1) * len(groups) if groups else 0.0
        pk = pass_at_k_from_scores(scores, n, n) * len(groups) if groups else 0.0
        tot = self.dist.all_reduce_dp(torch.tensor([float(len(groups)), float(rewards.sum()), float(rewards.numel()),
                                                    p1, pk], dtype=torch.float64))
        g = max(float(tot[0]), 1.0)
        return {"eval/reward": float(tot[1]) / max(float(tot[2]), 1.0), "eval/pass1": float(tot[3]) / g,
                f"eval/pass{n}": float(tot[4]) / g}

    # ------------------------------------------------------------------ the loop

    def fit(self) -> RLState:
        c, s, ckpt = self.cfg, self.state, self.checkpointer
        if c.load_checkpoint and ckpt is not None:
            client = ckpt.load(c.ckpt_path)
            if client is not None:
                check_same_run(client.get("run_settings"), c.run_settings, c.allowed_changes,
                               f"the checkpoint in --ckpt_path {c.ckpt_path}")
                s.step = client["step"]
                s.cursor = (client["episode"], client["batch_in_episode"], client.get("skipped_in_episode", 0))
                self.kl_ctl.load_state_dict(client["kl_ctl"])
                self.weight_sync.sync()
                if self.dist.rank == 0:
                    log.info(f"resumed from {c.ckpt_path} at step {s.step}")
            self.logger.truncate(s.step if client is not None else -1)  # no step logged twice
        total = self.total_steps()
        bar = progress_bar(total, s.step, "rl", c.show_progress and self.dist.rank == 0)
        self._total = total
        self.logger.start(s.step)
        if s.step == 0 and c.eval_steps > 0:
            self._log(0, self.evaluate())
        signals = stop_signals()  # SIGINT / SIGTERM: a checkpoint after this step, then RunStopped (trainers/stop.py)
        signals.start_training()
        while s.step < total:
            cursor = s.cursor
            try:
                with signals.step():
                    m = self.train_step()
            except StepAbandoned:
                s.cursor = cursor  # the abandoned step's prompts are drawn again on resume
                raise signals.stop(s.step, self.save_checkpoint, abandoned=True) from None
            s.step += 1
            self._count_failed_step(m)
            self._note_no_signal(m)
            bar.update(1)
            if "reward" in m:
                bar.set_postfix(reward=f"{m['reward']:.3f}")
            if c.eval_steps > 0 and (s.step % c.eval_steps == 0 or s.step == total):
                m.update(self.evaluate())
                if ckpt is not None:  # --best_metric_key
                    warn_if_no_space(lambda: ckpt.keep_best(c.ckpt_path, s.step, m, self._client_state()), s.step)
            if s.step % max(c.logging_steps, 1) == 0 or s.step == total:
                self._log(s.step, m)
            if c.log_completions_steps and (s.step == 1 or s.step % c.log_completions_steps == 0):
                self.logger.log_completions(s.step, sample_rows(self._samples, c.n_samples_per_prompt,
                                                                c.log_completions_rows))
            if c.save_steps > 0 and s.step % c.save_steps == 0 and ckpt is not None:
                warn_if_no_space(lambda: ckpt.save(c.ckpt_path, f"global_step{s.step}",
                                                                self._client_state(), c.max_ckpt_num), s.step)
            if s.step < total and signals.requested(self.dist.agree if self.dist.world_size > 1 else None):
                raise signals.stop(s.step, self.save_checkpoint, abandoned=False)
        signals.end_training()
        bar.close()
        return s

    def save_checkpoint(self) -> str:
        """A resumable checkpoint of the current step under --ckpt_path (all ranks call; one of this step
        already there is kept); its path."""
        c = self.cfg
        existing = os.path.join(c.ckpt_path, "actor", f"global_step{self.state.step}")
        if os.path.isdir(existing) and checkpoint_gap(existing) is None:
            return existing
        if self.checkpointer is None:
            raise RuntimeError("this RL loop was built without a checkpointer: nothing can be saved")
        return self.checkpointer.save_resumable(c.ckpt_path, f"global_step{self.state.step}", self._client_state(),
                                                c.max_ckpt_num)

    def _client_state(self) -> dict:
        s = self.state
        return {"step": s.step, "episode": s.episode, "batch_in_episode": s.batch_in_episode,
                "skipped_in_episode": s.skipped_in_episode, "kl_ctl": self.kl_ctl.state_dict(),
                "run_settings": self.cfg.run_settings}

    def _count_failed_step(self, m: dict[str, float]) -> None:
        """Count a skipped step (one line on stderr); the --max_failed_steps-th in a row ends the run.
        Every rank takes the same decision: `skipped_steps` comes from an all-reduce."""
        if not m.get("skipped_steps"):
            self.failed_in_row = 0
            return
        self.num_skipped += 1
        self.failed_in_row += 1
        limit = self.cfg.max_failed_steps
        if self.failed_in_row >= limit:
            raise FailedStepsError(f"{self.failed_in_row} steps in a row (--max_failed_steps {limit}) left no "
                                   f"trajectory to train on; last one (step {self.state.step}): {self._skip_cause}")
        if self.dist.rank == 0:
            log.warning(f"step {self.state.step}: skipped, no trajectory to train on: {self._skip_cause} "
                        f"({self.failed_in_row} in a row; the run stops at --max_failed_steps {limit})")

    def _log(self, step: int, m: dict[str, float]) -> None:
        if not m:
            return
        self.state.history.append(metrics_record(step, m))
        self.logger.log(step, m, total=self._total)  # its line above the bar, if any
