"""The composition root of the RL commands: the one place that turns the flags into a running loop,
whatever the placement (train_ppo: roles in this process, one process or torchrun ranks;
train_ppo_ray: Ray role groups and engine actors).

    run(args, parser, layout), one sequence for every layout (`Layout`: LocalLayout here, train_ppo_ray's
    RayLayout):
    flags -> resolve_flags, the layout's checks, the memory plan (before any model loads)
          -> load_data                 tokenizer (once per process), --prompt_data prompts, --eval_dataset prompts
          -> layout.place              a Placement: local_placement (here) or train_ppo_ray's Ray launch;
                                       role groups, the engine, the weight-sync object, the backends
                                       checkpoints and exports use; and the trainer (build_trainer:
                                       executors, evaluation check, checkpointer, loop configs)
          -> trainer.fit()
          -> save_final                policy (+ --save_value_network critic) in Hugging Face format
          -> RLRun                     what `train_ppo.run` returns (the Python API reads it)

Everything a command reads from the flags for the loop itself goes through `ppo_setup` from here;
train_ppo_ray adds only what placing actors needs (shapes, Ray options, async mode).
"""

from __future__ import annotations

import functools
import logging
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

from rlhfkit.backend.base import CheckpointingBackend
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.cli import ppo_setup as S
from rlhfkit.cli import vlm_setup as V
from rlhfkit.cli.common import UsageError, make_logger, parallel_dims, report_dropped, save_or_fall_back
from rlhfkit.data.io import load_mixture
from rlhfkit.data.prompts import PromptDataConfig, PromptDataset
from rlhfkit.models.given import NONE, GivenModels
from rlhfkit.trainers.plot import RL_PANELS
from rlhfkit.roles.group import LocalGroup
from rlhfkit.roles.handles import (CriticCalls, CriticHandle, PolicyCalls, PolicyHandle, ReferenceCalls,
                                   ReferenceHandle, RewardCalls, RewardHandle)
from rlhfkit.rollout.base import RolloutEngine
from rlhfkit.rollout.engine_utils import EngineSleep
from rlhfkit.trainers.rl import RLState, RLTrainer
from rlhfkit.trainers.rl_contracts import EngineMemory
from rlhfkit.weightsync.sync import LocalWeightSync, WeightSync

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlhfkit.distributed.group import RayGroup

log = logging.getLogger(__name__)

PLOT_KEYS = RL_PANELS  # the plot's panels (rlhfkit.trainers.plot.PANELS)


@dataclass
class RLData:
    tokenizer: PreTrainedTokenizerBase
    prompts: list
    eval_prompts: list
    vision: Any = None  # rlhfkit.models.vlm.VisionContext under --max_images_per_prompt > 0
    dropped_image_rows: int = 0  # rows left out for a bad picture (--image_failure drop)


@dataclass
class Placement:
    """Where the roles and the engine live, as the loop sees them (typed role handles, `engine`,
    `weight_sync.sync()`), plus the backends that save and export. `save_critic(path, tokenizer)`
    writes the value network on every critic rank (rank 0 writes)."""

    dist: DistInfo
    policy: PolicyCalls
    engine: RolloutEngine
    policy_backend: CheckpointingBackend
    weight_sync: WeightSync
    ref: ReferenceCalls | None = None
    critic: CriticCalls | None = None
    reward: RewardCalls | None = None
    critic_backend: CheckpointingBackend | None = None
    save_critic: Callable[[str, PreTrainedTokenizerBase], None] | None = None
    engine_memory: EngineMemory | None = None  # train_ppo --vllm_enable_sleep: the engine sleeps while models train


@dataclass
class RLRun:
    """A finished run: the loop state (`state.history`: the logged metrics), where the roles live,
    and the tokenizer (for saving the policy again)."""

    state: RLState
    placement: Placement
    tokenizer: PreTrainedTokenizerBase


def load_prompt_dataset(args, tokenizer, spec: str, split: str, probs: str | None, max_samples: int,
                        vision: Any = None, flag: str = "--prompt_data") -> PromptDataset:
    """The prompts of `spec`; with `vision` (a VLM) each row's pictures are read and placed. Those left out
    (longer than --prompt_max_len) are counted and named once, and a training set left with fewer than half
    its rows is an error (common.report_dropped)."""
    rows = load_mixture(spec, probs, split=split, max_samples=max_samples, seed=args.seed,
                        max_row_bytes=args.max_row_bytes)
    cfg = PromptDataConfig(input_key=args.input_key, label_key=args.label_key, input_template=args.input_template,
                           apply_chat_template=args.apply_chat_template,
                           tokenizer_chat_template=args.tokenizer_chat_template, max_prompt_len=args.prompt_max_len)
    ds = PromptDataset(rows, tokenizer, cfg, V.row_images(args, vision))
    if ds.num_bad_images:
        log.info(f"{ds.num_bad_images} of {len(rows)} rows of {spec} dropped for a bad picture (--image_failure drop)")
    report_dropped(ds, len(rows), f"{flag} {spec}", training=flag == "--prompt_data")
    return ds


def load_prompts(args, tokenizer, spec: str, split: str, probs: str | None, max_samples: int,
                 flag: str = "--prompt_data") -> list:
    return load_prompt_dataset(args, tokenizer, spec, split, probs, max_samples, flag=flag).samples


def load_data(args, given: GivenModels = NONE) -> RLData:
    """The run's tokenizer (given, else loaded from --pretrain: once per process) and its prompts."""
    tokenizer = given.load_tokenizer(args.pretrain, chat_template=args.tokenizer_chat_template,
                                     use_fast=not args.disable_fast_tokenizer)
    vision = V.vision_context(args, tokenizer)
    train = load_prompt_dataset(args, tokenizer, args.prompt_data, args.prompt_split, args.prompt_data_probs,
                                args.max_samples, vision)
    evals = (load_prompt_dataset(args, tokenizer, args.eval_dataset, args.eval_split, None,
                                 args.eval_max_samples or args.max_samples, vision, "--eval_dataset")
             if args.eval_dataset else None)
    dropped = train.num_bad_images + (evals.num_bad_images if evals is not None else 0)
    return RLData(tokenizer, train.samples, evals.samples if evals is not None else [], vision, dropped)


def save_critic(path: str, tokenizer: Any, role: Any, backend: Any, dist: DistInfo) -> None:
    """Runs on every critic rank (every rank gathers; rank 0 writes the value network)."""
    from rlhfkit.models.value import save_value_model

    sd = backend.full_state_dict()
    save_value_model(backend.unwrap(), path, tokenizer, state_dict=sd, is_main_process=dist.rank == 0)


def local_placement(args, dist: DistInfo, tokenizer: Any, num_steps: int, given: GivenModels = NONE) -> Placement:
    """The roles in this process (one of N torchrun ranks): one mesh description for every model. A policy
    `given` in memory is trained itself; the copies a reference or a critic start from are taken first."""
    dims = parallel_dims(args, dist)
    ref_module, critic_base = S.given_reference(args, given), S.given_critic_base(args, given)
    policy, policy_backend = S.build_policy(args, dist, num_steps, dims, tokenizer,  # this order: the models'
                                            module=given.policy)                     # random inits (value
    ref = S.build_ref(args, dist, dims, policy_backend, ref_module, given)  # heads) draw from one seeded generator
    critic, critic_backend = S.build_critic(args, dist, num_steps, dims, critic_base)
    reward = S.build_reward_model(args, dist)
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


def build_trainer(args, placement: Placement, data: RLData, trainer_cls: type = RLTrainer, **extra: Any) -> Any:
    """The loop over `placement` (extra: the trainer class's own keywords)."""
    p, tok = placement, data.tokenizer
    executor = S.build_executor(args, p.engine, tok, args.temperature, data.vision)
    eval_executor = S.build_executor(args, p.engine, tok, args.eval_temperature, data.vision) \
        if data.eval_prompts else None
    if data.eval_prompts and p.reward is not None:
        raise UsageError("--eval_dataset scores with --remote_rm_url or --agent_func_path; "
                         "evaluation with a reward model is not supported")
    ckpt = S.checkpointer(args, p.policy_backend, p.critic_backend, tok, p.dist)
    loop = S.loop_config(args, data.vision, data.dropped_image_rows)
    return trainer_cls(loop, S.advantage_config(args), S.shaping_config(args), policy=p.policy,
                       executor=executor, prompts=data.prompts, dist=p.dist,
                       logger=make_logger(args, p.dist.rank, PLOT_KEYS), pad_token_id=tok.pad_token_id,
                       kl_ctl=S.kl_controller(args), ref=p.ref, critic=p.critic, reward_model=p.reward,
                       eval_executor=eval_executor, eval_prompts=data.eval_prompts, checkpointer=ckpt,
                       weight_sync=p.weight_sync, engine_memory=p.engine_memory, **extra)


class Layout(Protocol):
    """Where an RL run's roles live: train_ppo's `LocalLayout` (this process, or one of N torchrun ranks) or
    train_ppo_ray's Ray actors. `run` calls them in this order."""

    def world(self, args) -> int:
        """The policy's ranks (what --rollout_batch_size and the engines' batch are checked against)."""
        ...

    def check(self, args, parser) -> None:
        """The layout's own checks and one-line notes, on the resolved flags."""
        ...

    def memory_slots(self, args) -> tuple[dict[str, int], bool] | None:
        """(ranks of each role, local layout) for the memory plan, or None where no plan applies."""
        ...

    def place(self, args, data: RLData, num_steps: int, given: GivenModels
              ) -> AbstractContextManager[tuple[Placement, Any]]:
        """(placement, trainer) for the run's length; afterwards every engine, thread and actor is let go,
        whether the run ended or failed. `given`: the models handed to the run in memory."""
        ...


def run(args, parser, layout: Layout, given: GivenModels = NONE) -> RLRun:
    """The RL commands' one run sequence: flags -> checks -> memory plan -> data -> placement -> loop -> saved
    policy, the same for every layout. `given`: models and tokenizer handed over in memory (the Python API)
    in place of loading --pretrain / --ref_pretrain."""
    from rlhfkit.cli.common import disable_hf_progress_bars, set_seed
    from rlhfkit.cli.memory_check import check_memory
    from rlhfkit.roles.memory import RoleOutOfMemory

    S.resolve_flags(args, layout.world(args), given)
    layout.check(args, parser)
    slots = layout.memory_slots(args)
    if slots is not None and given.empty:  # before any model loads (given ones are loaded already)
        check_memory(args, slots[0], local=slots[1])
    set_seed(args.seed, args.full_determinism)
    if args.disable_progress:
        disable_hf_progress_bars()
    data = load_data(args, given)
    with layout.place(args, data, S.optimizer_steps(args, len(data.prompts)), given) as (placement, trainer):
        try:
            trainer.fit()
        except RoleOutOfMemory as e:
            raise S.explain_oom(args, e) from None
        finally:
            trainer.logger.close()
        save_final(args, placement, data.tokenizer, fallback=trainer.save_checkpoint)
    return RLRun(trainer.state, placement, data.tokenizer)


class LocalLayout:
    """train_ppo: the roles and an engine in this process (one of N torchrun ranks)."""

    def __init__(self) -> None:
        self.dist: DistInfo | None = None

    def world(self, args) -> int:
        from rlhfkit.cli.common import note_cpu_dtype
        from rlhfkit.parallel.dist import init_distributed

        self.dist = init_distributed(args.device)
        note_cpu_dtype(args, self.dist.device)
        return self.dist.world_size

    def check(self, args, parser) -> None:
        from rlhfkit.parallel.mesh import attach_mesh

        assert self.dist is not None
        # resolve_flags refused tp / cp > 1, so the world is data parallel; its process groups, built once
        self.dist = attach_mesh(self.dist, parallel_dims(args, self.dist))
        S.note_ray_only_flags(args, parser, "train_ppo")

    def memory_slots(self, args) -> tuple[dict[str, int], bool] | None:
        assert self.dist is not None
        if not self.dist.device.startswith("cuda"):  # a CPU run has no device memory to plan
            return None
        return {r: self.dist.world_size for r in S.roles_in_run(args, local=True)}, True

    @contextmanager
    def place(self, args, data: RLData, num_steps: int, given: GivenModels) -> Iterator[tuple[Placement, Any]]:
        from rlhfkit.rewards.process_pool import close_pools

        assert self.dist is not None
        placement = local_placement(args, self.dist, data.tokenizer, num_steps, given)
        try:
            yield placement, build_trainer(args, placement, data)
        finally:  # also when the run fails: no thread may be inside torch or user code at exit
            S.close_rollout(placement.engine)
            close_pools()


def save_final(args, placement: Placement, tokenizer: Any, fallback: Callable[[], str] | None = None) -> None:
    """The policy (and with --save_value_network the critic) in Hugging Face format, each with a
    model card (README.md) written by rank 0 / the driver from the run's files. Too little space in
    --save_path: `fallback()` (the trainer's resumable checkpoint) instead (common.save_or_fall_back)."""
    from rlhfkit.config.flags import run_dir_of
    from rlhfkit.trainers.model_card import write_model_card

    save_or_fall_back(lambda: placement.policy_backend.save_hf(args.save_path, tokenizer), fallback)
    if placement.dist.rank == 0:
        write_model_card(args.save_path, run_dir=run_dir_of(args), trainer="rl")
    if args.save_value_network and placement.save_critic is not None:
        critic_dir = args.save_path.rstrip("/") + "_critic"
        placement.save_critic(critic_dir, tokenizer)
        if placement.dist.rank == 0:
            write_model_card(critic_dir, run_dir=run_dir_of(args), trainer="critic",
                             base_model=args.critic_pretrain or args.pretrain)
    if placement.dist.rank == 0:
        log.info(f"policy saved to {args.save_path}")


def critic_saver_on_group(group: RayGroup) -> Callable[[str, PreTrainedTokenizerBase], None]:
    """`Placement.save_critic` for a Ray role group: every rank runs `save_critic` in its actor."""
    from rlhfkit.distributed.workers import RoleWorker

    return lambda path, tok: group.run_all(RoleWorker.apply, functools.partial(save_critic, path, tok))
