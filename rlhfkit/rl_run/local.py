"""train_ppo's placement: the roles and a rollout engine in this process (one process, or one of N torchrun
ranks; `LocalLayout`, a `rlhfkit.rl_run.root.Layout`).

    local_placement(plan, dist): policy (a module given in memory is trained itself; the copies a reference
    or a critic start from are taken first), reference, critic, reward model, each in a `LocalGroup` behind
    its typed handle; the engine beside them (`_engine_beside`: the builtin engine serves the policy's own
    parameters where --engine_weights lets it, else holds a copy); `LocalWeightSync`.
"""

from __future__ import annotations

import functools
import logging
from contextlib import contextmanager
from typing import Any, Iterator

from rlhfkit.cli.common import UsageError, parallel_dims
from rlhfkit.parallel.dist import DistInfo, use_expandable_segments
from rlhfkit.parallel.mesh import ParallelDims
from rlhfkit.rl_run import builders as S
from rlhfkit.rl_run.resolve import ResolvedFlags
from rlhfkit.rl_run.root import Placement, RLPlan, build_trainer, save_critic
from rlhfkit.roles.group import LocalGroup
from rlhfkit.roles.handles import (
    CriticHandle,
    PolicyHandle,
    ReferenceHandle,
    RewardHandle,
)
from rlhfkit.rollout.engine_utils import EngineSleep
from rlhfkit.weightsync.sync import LocalWeightSync

log = logging.getLogger(__name__)


def local_placement(plan: RLPlan, dist: DistInfo, dims: ParallelDims | None = None) -> Placement:
    """The roles in this process (one of N torchrun ranks): one mesh description `dims` for every model (the
    layout's, else made from the flags). A policy given in memory is trained itself; the copies a reference or
    a critic start from are taken first."""
    args, tokenizer, num_steps, given, roles = plan.args, plan.tokenizer, plan.num_steps, plan.given, plan.roles
    if args.rollout_engine != "vllm":  # (vLLM in this process: its sleep pool refuses them)
        use_expandable_segments(dist.device)  # so that the memory plan holds
    dims = dims if dims is not None else parallel_dims(args, dist)
    ref_module = S.given_reference(args, given) if "ref" in roles else None
    critic_base = S.given_critic_base(args, given) if "critic" in roles else None
    policy, policy_backend = S.build_policy(args, dist, num_steps, dims, tokenizer,  # this order: the models'
                                            module=given.policy)                     # random inits (value
    ref = S.build_ref(args, dist, dims, policy_backend, ref_module, given) \
        if "ref" in roles else None                                         # heads) draw from one seeded generator
    critic, critic_backend = S.build_critic(args, dist, num_steps, dims, critic_base) \
        if "critic" in roles else (None, None)
    reward = S.build_reward_model(args, dist) if "reward" in roles else None
    engine, shared, complete = _engine_beside(args, dist, tokenizer, policy_backend, given.policy)
    saver = None
    if critic_backend is not None:
        saver = functools.partial(_save_local_critic, backend=critic_backend, dist=dist)
    handle = PolicyHandle(LocalGroup(policy, "policy"))
    return Placement(dist, handle, engine, policy_backend, LocalWeightSync(handle, engine, shared, complete),
                     ref=ReferenceHandle(LocalGroup(ref, "ref")) if ref is not None else None,
                     critic=CriticHandle(LocalGroup(critic, "critic")) if critic is not None else None,
                     reward=RewardHandle(LocalGroup(reward, "reward")) if reward is not None else None,
                     critic_backend=critic_backend, save_critic=saver,
                     engine_memory=EngineSleep(engine, 1 if shared else 2) if args.vllm_enable_sleep else None)


def _engine_beside(args, dist: DistInfo, tokenizer: Any, policy_backend: Any, given: Any = None
                   ) -> tuple[Any, frozenset[str], bool]:
    """train_ppo's engine, the names of the weights it shares with the policy (--engine_weights) and whether
    it shares them all; `given`: the policy module given in memory (what an engine of its own copies)."""
    why = S.engine_sharing(args, dist, policy_backend)
    if args.engine_weights == "shared" and why is not None:
        raise UsageError(f"--engine_weights shared: {why}; --engine_weights copy (or auto) gives the engine a copy "
                         "of its own")
    if why is not None:
        engine = S.build_engine_for(args, tokenizer, dist, given=given)
        if args.rollout_engine == "builtin" and dist.rank == 0:  # (other engines always load their own)
            log.info(f"rollout engine: its own copy of the policy's weights ({why})")
        return engine, frozenset(), False
    from rlhfkit.rollout.builtin import BuiltinEngine
    from rlhfkit.rollout.builtin.model.shared_weights import weight_name

    module = policy_backend.unwrap()
    engine = S.build_engine_for(args, tokenizer, dist, share_with=module, given=given)
    assert isinstance(engine, BuiltinEngine)  # engine_sharing allows the builtin engine only
    shared = engine.shared_names
    names = {n: weight_name(n) for n, _ in module.named_parameters()}
    nbytes = sum(p.numel() * p.element_size() for n, p in module.named_parameters()
                 if names[n] is None or names[n] in shared)
    adapters = " and LoRA adapters, unmerged" if any(part for lw in engine.model.weights.layers
                                                    for part in lw.lora.values()) else ""
    size = f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
    log.info(f"rollout engine: serves the policy's own weights{adapters} ({size} not copied; "
             "--engine_weights copy gives it a copy)")
    return engine, shared, all(w is None or w in shared for w in names.values())


def _save_local_critic(path: str, tokenizer: Any, *, backend: Any, dist: DistInfo) -> None:
    save_critic(path, tokenizer, None, backend, dist)


def local_trainer(args: ResolvedFlags, dist: DistInfo) -> tuple[Any, Placement]:
    """(trainer, placement) over the roles in this process for flags already resolved (`resolve.resolve`),
    without the run sequence: what the benches time step by step. The caller closes the engine
    (`builders.close_rollout`)."""
    from rlhfkit.rl_run.root import load_data

    data = load_data(args)
    plan = RLPlan(args, {r: dist.world_size for r in S.roles_in_run(args)}, data,
                  S.optimizer_steps(args, len(data.prompts)))
    placement = local_placement(plan, dist)
    return build_trainer(args, placement, data), placement


class LocalLayout:
    """train_ppo: the roles and an engine in this process (one of N torchrun ranks)."""

    local = True

    def __init__(self) -> None:
        self.dist: DistInfo | None = None
        self.dims: ParallelDims | None = None  # the mesh description, made once from the flags (check)

    def world(self, args) -> int:
        from rlhfkit.cli.common import note_cpu_dtype
        from rlhfkit.parallel.dist import init_distributed

        self.dist = init_distributed(args.device)
        note_cpu_dtype(args, self.dist.device)
        return self.dist.world_size

    def check(self, args, parser) -> None:
        from rlhfkit.parallel.mesh import attach_mesh

        assert self.dist is not None
        # the process groups of the mesh the flags ask for, built once
        self.dims = parallel_dims(args, self.dist)
        self.dist = attach_mesh(self.dist, self.dims)
        S.note_ray_only_flags(args, parser, "train_ppo")

    def roles(self, args) -> dict[str, int]:
        assert self.dist is not None
        return {r: self.dist.world_size for r in S.roles_in_run(args)}

    def plans_memory(self) -> bool:
        assert self.dist is not None
        return self.dist.device.startswith("cuda")  # a CPU run has no device memory to plan

    @contextmanager
    def place(self, plan: RLPlan) -> Iterator[tuple[Placement, Any]]:
        from rlhfkit.rewards.process_pool import close_pools

        assert self.dist is not None
        placement = local_placement(plan, self.dist, self.dims)
        try:
            yield placement, build_trainer(plan.args, placement, plan.data)
        finally:  # also when the run fails: no thread may be inside torch or user code at exit
            S.close_rollout(placement.engine)
            close_pools()
