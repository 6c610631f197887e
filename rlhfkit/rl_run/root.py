"""The composition root of the RL commands: the one place that turns the resolved flags into a running loop,
whatever the placement (train_ppo: roles in this process, one process or torchrun ranks, `rl_run.local`;
train_ppo_ray: Ray role groups and engine actors, `rl_run.ray_layout`).

    plan(args, parser, layout, given) -> RLPlan, once, before any model loads:
          resolve                      a copy of the flags checked, completed and made read-only
                                       (rl_run.resolve); the parsed namespace is left as it was, and
                                       every later step reads the copy
          layout.world / check         the policy's ranks; the layout's own checks and notes
          roles                        which models the run holds and on how many ranks (the memory plan's input)
          check_memory                 the memory plan (CUDA, models loaded from directories)
          load_data                    the tokenizer (once per process; sent to the Ray actors with the
                                       flags), --prompt_data and --eval_dataset prompts, a VLM's pictures
          optimizer_steps              the LR schedule's length
    run(plan, layout) -> RLRun, the same sequence for every layout:
          layout.place(plan)           a Placement (role groups, the engine, the weight-sync object, the
                                       backends checkpoints and exports use) and the trainer (build_trainer:
                                       executors, evaluation check, checkpointer, loop configs); local and Ray
                                       layouts differ only here
          -> trainer.fit()
          -> save_final                policy (+ --save_value_network critic) in Hugging Face format
          -> RLRun                     what `train_ppo.run` returns (the Python API reads it)

Everything a command reads from the flags for the loop itself goes through `rl_run.builders`; the Ray
layout adds only what placing actors needs (shapes, Ray options, async mode). None of them writes into the
flags: a value they need beyond the flags is computed in `rl_run.resolve` or kept in a variable of its own.
"""

from __future__ import annotations

import functools
import logging
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

from rlhfkit.backend.base import CheckpointingBackend
from rlhfkit.cli import vlm_setup as V
from rlhfkit.cli.common import (
    UsageError,
    make_logger,
    report_dropped,
    save_or_fall_back,
)
from rlhfkit.data.io import load_mixture
from rlhfkit.data.prompts import PromptDataConfig, PromptDataset
from rlhfkit.models.given import NONE, GivenModels
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.rl_run import builders as S
from rlhfkit.rl_run.resolve import ResolvedFlags, resolve
from rlhfkit.roles.handles import CriticCalls, PolicyCalls, ReferenceCalls, RewardCalls
from rlhfkit.rollout.base import RolloutEngine
from rlhfkit.trainers.plot import RL_PANELS
from rlhfkit.trainers.rl import RLState, RLTrainer
from rlhfkit.trainers.rl_contracts import EngineMemory
from rlhfkit.weightsync.sync import WeightSync

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


@dataclass(frozen=True)
class RLPlan:
    """What a run is, computed once from the resolved flags before any model loads (`plan`): the flags the
    builders read, the roles and their ranks, the tokenizer and prompts, the LR schedule's length, and the
    models given in memory."""

    args: ResolvedFlags  # the resolved flags (read-only)
    roles: dict[str, int]  # role ("policy", "ref", "critic", "reward") -> its ranks
    data: RLData
    num_steps: int  # the policy's optimizer steps
    given: GivenModels = NONE

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.data.tokenizer


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
    train_ppo_ray's `RayLayout` (Ray actors). `plan` calls world, check and roles in this order; `run` calls
    place."""

    local: bool  # every role and an engine in each rank's process (the memory plan's layout)

    def world(self, args) -> int:
        """The policy's ranks (what --rollout_batch_size and the engines' batch are checked against)."""
        ...

    def check(self, args, parser) -> None:
        """The layout's own checks and one-line notes, on the resolved flags (read-only: what the layout
        derives from them it keeps itself)."""
        ...

    def roles(self, args) -> dict[str, int]:
        """Each role of the run -> its ranks."""
        ...

    def plans_memory(self) -> bool:
        """Whether the memory plan applies (devices with memory to plan)."""
        ...

    def place(self, plan: RLPlan) -> AbstractContextManager[tuple[Placement, Any]]:
        """(placement, trainer) for the run's length; afterwards every engine, thread and actor is let go,
        whether the run ended or failed."""
        ...


def plan(args, parser, layout: Layout, given: GivenModels = NONE) -> RLPlan:
    """The run of the parsed flags `args`, computed once before any model loads (module docstring); `args` is
    left as parsed, the plan holds its resolved copy. `given`: models and tokenizer handed over in memory (the
    Python API) in place of loading --pretrain / --ref_pretrain."""
    from rlhfkit.cli.common import disable_hf_progress_bars, set_seed
    from rlhfkit.rl_run.memory_check import check_memory

    args = resolve(args, layout.world(args), given)
    layout.check(args, parser)
    roles = layout.roles(args)
    if layout.plans_memory() and given.empty:  # before any model loads (given ones are loaded already)
        check_memory(args, roles, local=layout.local)
    set_seed(args.seed, args.full_determinism)
    if args.disable_progress:
        disable_hf_progress_bars()
    data = load_data(args, given)
    return RLPlan(args, roles, data, S.optimizer_steps(args, len(data.prompts)), given)


def run(plan: RLPlan, layout: Layout) -> RLRun:
    """The RL commands' one run sequence, the same for every layout: placement -> loop -> saved policy."""
    from rlhfkit.roles.memory import RoleOutOfMemory

    args = plan.args
    with layout.place(plan) as (placement, trainer):
        try:
            trainer.fit()
        except RoleOutOfMemory as e:
            raise S.explain_oom(args, e) from None
        finally:
            trainer.logger.close()
        save_final(args, placement, plan.tokenizer, fallback=trainer.save_checkpoint)
    return RLRun(trainer.state, placement, plan.tokenizer)


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

    def save(path: str, tokenizer: PreTrainedTokenizerBase) -> None:
        group.run_all(RoleWorker.apply, functools.partial(save_critic, path, tokenizer))

    return save
