"""The role-group contract (rlhfkit/roles/handles.py), one suite for both sides: `LocalGroup` (the role in
this process) and `RayGroup` (N actors; here in-process fakes with Ray's `.remote` call shape, 2 data-parallel
ranks). A row-wise role gives the same answer through either group as called directly on the whole batch,
the handles reach the method they name, and `on_every_rank` runs on every rank and returns rank 0's answer.

Also `AsyncRLTrainer` over fakes (no Ray): with a producer one batch ahead it trains on the prompts, in the
order and with the sampling seeds, of the synchronous loop; its batches are at most one version stale, and
the router's and the phases' metrics join each step's."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
import torch

from rlhfkit.agents.contracts import EpisodeBatch
from rlhfkit.algo.advantages import AdvantageConfig
from rlhfkit.algo.experience import RewardShapingConfig
from rlhfkit.algo.kl import FixedKLController
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.roles.group import LocalGroup
from rlhfkit.roles.handles import CriticHandle, PolicyHandle, RewardHandle
from rlhfkit.trainers.async_rl import AsyncRLTrainer
from rlhfkit.trainers.rl import RLLoopConfig
from rlhfkit.types import ExperienceBatch, PromptSample, Trajectory


class RowRole:
    """A role whose answers are row-wise functions of the batch; rank `rank` of the group."""

    def __init__(self, rank: int = 0) -> None:
        self.rank, self.calls = rank, []
        self.dist = DistInfo(rank=rank)

    def forward_logprobs(self, batch, temperature=1.0):
        self.calls.append("forward_logprobs")
        return -batch.input_ids.float() / temperature

    def forward_values(self, batch):
        self.calls.append("forward_values")
        return batch.input_ids.float() * 2

    def forward_rewards(self, batch):
        self.calls.append("forward_rewards")
        return batch.input_ids.float().sum(-1)

    def train_on(self, batch, kl_coef=0.0):
        self.calls.append("train_on")
        return {"loss": float(batch.input_ids.float().mean()), "kl_coef": kl_coef}  # reduced over ranks: the same

    def which(self):
        self.calls.append("which")
        return self.rank


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class FakeActor:
    """A `RoleWorker` as RayGroup reaches it: `actor.<method>.remote(...)`."""

    def __init__(self, role: RowRole) -> None:
        self.role = role
        self.call = _Remote(lambda method, *a, **k: getattr(role, method)(*a, **k))


def _ray_group(monkeypatch, ranks: int):
    pytest.importorskip("ray")
    from rlhfkit.distributed import group as G

    monkeypatch.setattr(G, "wait_all", lambda refs, labels, monitor=None: list(refs))
    roles = [RowRole(r) for r in range(ranks)]
    return G.RayGroup("policy", [FakeActor(r) for r in roles], [None] * ranks, unit=2), roles


@pytest.fixture(params=["local", "ray"])
def group(request, monkeypatch):
    if request.param == "local":
        role = RowRole()
        return LocalGroup(role, "policy"), [role]
    return _ray_group(monkeypatch, 2)


def batch(rows: int = 4) -> ExperienceBatch:
    ids = torch.arange(rows * 3).view(rows, 3) + 1
    return ExperienceBatch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.ones_like(ids))


def test_handles_give_the_role_answer_on_the_whole_batch(group):
    g, roles = group
    b, ref = batch(), RowRole()
    torch.testing.assert_close(PolicyHandle(g).forward_logprobs(b, 2.0), ref.forward_logprobs(b, 2.0))
    torch.testing.assert_close(CriticHandle(g).forward_values(b), ref.forward_values(b))
    torch.testing.assert_close(RewardHandle(g).forward_rewards(b), ref.forward_rewards(b))
    assert PolicyHandle(g).train_on(b, 0.5)["kl_coef"] == 0.5
    assert all(r.calls == ["forward_logprobs", "forward_values", "forward_rewards", "train_on"] for r in roles)
    assert PolicyHandle(g).name == "policy"


def test_on_every_rank_runs_everywhere_and_returns_rank_zero(group):
    g, roles = group
    assert g.on_every_rank(RowRole.which) == 0
    assert all(r.calls == ["which"] for r in roles)
    with g.states_on_device():
        pass


def test_ray_group_splits_rows_and_averages_metrics(monkeypatch):
    g, roles = _ray_group(monkeypatch, 2)
    b = batch(4)
    m = CriticHandle(g).train_on(b)
    halves = [float(b.input_ids[:2].float().mean()), float(b.input_ids[2:].float().mean())]
    assert m["loss"] == pytest.approx(sum(halves) / 2)


# ----------------------------------------------------------------------------- AsyncRLTrainer over fakes


@dataclass
class Executor:
    """One trajectory per prompt; its reward is the prompt's index (so a batch names its prompts)."""
    seeds: list = field(default_factory=list)

    def reseed(self, seed):
        self.seeds.append(seed)

    async def run_episodes(self, samples, n_per_prompt=1):
        return EpisodeBatch([Trajectory(token_ids=[1, 2, 3, 4], action_mask=[0, 0, 1, 1], rollout_logprobs=[0.0] * 4,
                                        prompt_len=2, reward=float(s.index), score=float(s.index), group_index=i)
                             for i, s in enumerate(samples)])


@dataclass
class Policy:
    name: str = "policy"
    trained: list = field(default_factory=list)

    def forward_logprobs(self, batch, temperature):
        return torch.zeros(batch.input_ids.shape)

    def train_on(self, batch, kl_coef):
        self.trained.append(sorted(batch.rewards.tolist()))
        return {"policy_loss": 0.0}


class Router:
    def __init__(self) -> None:
        self.version, self.partial_rollout = 0, False
        self._lock = threading.Lock()

    @contextmanager
    def hold_weights(self):
        with self._lock:
            yield self.version

    def set_version(self, version):
        self.version = version

    def take_metrics(self):
        return {"engine/fake": 1.0}


@dataclass
class Sync:
    router: Router

    def sync(self):
        with self.router._lock:
            self.router.version += 1
        return {"time/weight_push": 0.0}


class Phases:
    def take_metrics(self):
        return {"time/fake_phase": 2.0, "time/rollout_transitions": 0.25}


class Monitor:
    checks = 0

    def check(self):
        Monitor.checks += 1


class Logger:
    def __init__(self):
        self.logged = []

    def start(self, step):
        pass

    def log(self, step, metrics, console=True, total=None):
        self.logged.append(dict(metrics))

    def log_completions(self, step, rows):
        pass

    def truncate(self, keep_through):
        pass


def run_async(queue: int, steps: int = 4):
    router, policy, ex, logger = Router(), Policy(), Executor(), Logger()
    cfg = RLLoopConfig(rollout_batch_size=2, n_samples_per_prompt=1, max_steps=steps, show_progress=False,
                       skip_zero_advantage_steps=False)
    trainer = AsyncRLTrainer(cfg, AdvantageConfig(advantage_estimator="reinforce"), RewardShapingConfig(),
                             policy=policy, weight_sync=Sync(router), executor=ex,
                             prompts=[PromptSample(prompt=f"p{i}", index=i) for i in range(6)], dist=DistInfo(),
                             logger=logger, pad_token_id=0, kl_ctl=FixedKLController(0.0), router=router,
                             phases=Phases(), monitor=Monitor(), async_queue_size=queue)
    trainer.fit()
    return policy.trained, ex.seeds, logger.logged, router


def test_async_trainer_trains_on_the_synchronous_batches():
    sync_batches, sync_seeds, sync_logged, _ = run_async(0)
    async_batches, async_seeds, logged, router = run_async(1)
    assert len(sync_batches) == 4 and async_batches == sync_batches  # same prompts, same order (3 per episode)
    assert async_seeds == sync_seeds
    assert all(m["engine/fake"] == 1.0 and m["time/fake_phase"] == 2.0 for m in logged + sync_logged)
    assert all(0 <= m["staleness_max"] <= 1 for m in logged)  # the producer runs one batch ahead at most
    assert router.version == 4 and Monitor.checks > 0
    # synchronous: the rollout's wait for the sleep transitions is taken out of generation proper
    assert all(m["time/generate_engines"] == pytest.approx(m["time/generate"] - 0.25) for m in sync_logged)
    assert all("time/generate_engines" not in m for m in logged)  # async: generation is the producer's
