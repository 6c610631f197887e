"""What the RL loop (`RLTrainer`) needs from its collaborators other than the roles (whose contracts
are rlhfkit/roles/handles.py) and the weight sync (rlhfkit/weightsync/sync.py `WeightSync`).

    EpisodeRunner    the agent executor: seeded episodes of a prompt batch (rlhfkit/agents)
    StepLogger       the run's metrics and completions table (trainers/metrics.py MetricsLogger)
    KLControl        the KL coefficient and its controller (algo/kl.py)
    RLCheckpointing  resumable and Hugging Face checkpoints of the roles (trainers/rl_checkpoint.py)
    VersionedEngines, PhaseMetrics, Liveness
                     what `AsyncRLTrainer` adds: engines that count weight versions, the sleep /
                     wake metrics, and the check that every worker is alive
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, Sequence

from rlhfkit.agents.contracts import EpisodeBatch
from rlhfkit.trainers.metrics import SampleRow
from rlhfkit.types import PromptSample


class EpisodeRunner(Protocol):
    def reseed(self, seed: int | None) -> None:
        """The base seed of the next `run_episodes` call."""
        ...

    async def run_episodes(self, samples: Sequence[PromptSample], n_per_prompt: int = 1) -> EpisodeBatch: ...


class StepLogger(Protocol):
    def start(self, step: int) -> None: ...

    def log(self, step: int, metrics: dict[str, Any], console: bool = True, total: int | None = None) -> None: ...

    def log_completions(self, step: int, rows: list[SampleRow]) -> None: ...

    def truncate(self, keep_through: int) -> None:
        """Drop the records of steps after `keep_through` (a resumed run rewrites them)."""
        ...


class KLControl(Protocol):
    value: float
    adaptive: bool  # the coefficient follows the observed KL (`update` reads it before training)

    def update(self, current_kl: float, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, float]: ...

    def load_state_dict(self, state: dict[str, float]) -> None: ...


class EngineMemory(Protocol):
    """An in-process engine's generation memory between rollouts (train_ppo --vllm_enable_sleep)."""

    def release(self) -> None:
        """Free it (the KV cache) while the models train."""
        ...

    def restore(self) -> None:
        """Have it back before the next generation (a no-op when it is there)."""
        ...


class RLCheckpointing(Protocol):
    def save(self, root: str, tag: str, client: dict, max_keep: int) -> None: ...

    def save_resumable(self, root: str, tag: str, client: dict, max_keep: int) -> str: ...

    def keep_best(self, root: str, step: int, metrics: dict[str, float], client: dict) -> bool: ...

    def load(self, root: str) -> dict | None: ...


class VersionedEngines(Protocol):
    """The engines of an asynchronous placement, which count the policy's weight versions
    (distributed.engines.RayEngineRouter)."""

    version: int
    partial_rollout: bool

    def hold_weights(self) -> AbstractContextManager[int]:
        """No weight update inside the block; yields the version the engines hold."""
        ...

    def set_version(self, version: int) -> None: ...

    def take_metrics(self) -> dict[str, float]: ...


class PhaseMetrics(Protocol):
    """Sleep / wake timings of the step (distributed.group.Phases)."""

    def take_metrics(self) -> dict[str, float]: ...


class Liveness(Protocol):
    """Raises when a worker the run needs died (distributed.health.HealthMonitor)."""

    def check(self) -> None: ...
