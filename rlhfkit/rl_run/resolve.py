"""The RL commands' flags resolved (train_ppo, train_ppo_ray; `rl_run.root.plan` calls it first):

    resolve(args, world_size, given) -> ResolvedFlags
      a copy of the parsed flags (rlhfkit.config.flag_parser.derive: run_config.json's `_as_parsed` and
      `set_explicitly` answer for it as for the parsed namespace), checked (each inconsistent setting is one
      UsageError naming its flags) and completed: derived defaults (--max_len, --generate_max_len, the
      critic's optimizer flags, --ema_beta, --ptx_coef, ...), model flags as local directories, the rollout
      engine that runs, packing off for a model that cannot pack; then made read-only.

The parsed namespace is left as it was. Everything after resolution reads the `ResolvedFlags`; a value a
later step needs is computed here or kept in that step's own variables, never written into the flags.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any, NoReturn

from rlhfkit.algo.advantages import get_advantage_estimator
from rlhfkit.cli.common import (UsageError, check_backend_flags, check_packages, check_packing, check_positions,
                                resolve_model_paths, resolve_rollout_engine)
from rlhfkit.cli.vlm_setup import check_vlm_rl_flags, vlm_mode
from rlhfkit.config.flag_parser import derive
from rlhfkit.config.notes import note_once
from rlhfkit.config.rl_flags import CRITIC_OPTIM, EMA_BETA, PTX_COEF
from rlhfkit.models.given import NONE, GivenModels
from rlhfkit.rl_run.builders import critic_path, flags_block_sharing, reward_server_urls

log = logging.getLogger(__name__)


class ResolvedFlags(argparse.Namespace):
    """The flags of one RL run as `resolve` completed them, read-only: setting or deleting an attribute raises
    AttributeError naming it. A pickled copy (the flags Ray sends to each actor) and `copy.copy` are
    read-only too; `vars()` gives the flags alone."""

    __slots__ = ("_frozen",)  # outside __dict__: not a flag, not in vars() or run_config.json

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False):
            _refuse("set", name)
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if getattr(self, "_frozen", False):
            _refuse("delete", name)
        super().__delattr__(name)

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        return _frozen_flags, (dict(vars(self)),)


def _refuse(what: str, name: str) -> NoReturn:
    raise AttributeError(f"resolved flags are read-only: cannot {what} {name!r} (rlhfkit.rl_run.resolve computes "
                         "every derived value; keep a later value in a variable of its own)")


def _freeze(flags: ResolvedFlags) -> ResolvedFlags:
    object.__setattr__(flags, "_frozen", True)
    return flags


def _frozen_flags(values: dict[str, Any]) -> ResolvedFlags:
    """A read-only ResolvedFlags of `values` (unpickling, copy.copy)."""
    return _freeze(ResolvedFlags(**values))


def resolve(args: argparse.Namespace, world_size: int, given: GivenModels = NONE) -> ResolvedFlags:
    """The parsed flags `args` checked and completed, as a new read-only namespace; `args` is left as it was.
    `world_size`: the policy's ranks; `given`: the models handed to the run as objects (their configs are read
    instead of --pretrain / --ref_pretrain's)."""
    flags = derive(args, ResolvedFlags)
    _complete(flags, world_size, given)
    return _freeze(flags)


def _check_qlora(args: argparse.Namespace) -> None:
    """QLoRA RL (--load_in_4bit): LoRA adapters over a 4-bit base computing in bf16."""
    if args.lora_rank <= 0:
        raise UsageError("--load_in_4bit keeps the frozen base in 4 bits under LoRA adapters: it needs --lora_rank")
    if args.param_dtype != "bf16":
        raise UsageError(f"--load_in_4bit computes in bf16: it needs --param_dtype bf16, got {args.param_dtype}")


def _check_qlora_engine(args: argparse.Namespace, world_size: int) -> None:
    """QLoRA RL's engine (after --rollout_engine is resolved): only the builtin engine serving the policy's own
    weights generates from a 4-bit base (model/quantized.py)."""
    why = flags_block_sharing(args, world_size)
    if why is not None:
        raise UsageError(f"--load_in_4bit: the rollout engine generates from a 4-bit base only by serving the "
                         f"policy's own weights (train_ppo, one process, --rollout_engine builtin, --engine_weights "
                         f"auto or shared); here {why}")


def _complete(args: argparse.Namespace, world_size: int, given: GivenModels) -> None:
    """Fill derived defaults into `args` (resolve's copy) and reject inconsistent settings with the flags'
    names."""
    if not args.pretrain:
        raise UsageError("--pretrain is required (the policy: a model directory or hub id)")
    if not args.prompt_data:
        raise UsageError("--prompt_data is required")
    if args.load_in_4bit:  # before the package check: installing bitsandbytes would not make it run
        _check_qlora(args)
    check_backend_flags(args)
    check_packages(args)
    check_vlm_rl_flags(args)
    resolve_optional_terms(args)
    if args.clip_eps_low is not None or args.clip_eps_high is not None:
        lo = args.clip_eps_low if args.clip_eps_low is not None else args.eps_clip
        hi = args.clip_eps_high if args.clip_eps_high is not None else args.eps_clip
        args.eps_clip_low_high = [lo, hi]
    if args.use_icepop:
        args.enable_vllm_is_correction, args.vllm_is_correction_type = True, "icepop"
    if args.ref_reward_offload:
        args.ref_offload = args.reward_offload = True
    dynamic_new_tokens = args.generate_max_len is None and args.max_len is not None
    if args.generate_max_len is None:  # OpenRLHF: 1024 (flat era); max_len - prompt (--rollout.max_new_tokens unset)
        args.generate_max_len = args.max_len if dynamic_new_tokens else 1024
    max_len_given = args.max_len is not None
    if not max_len_given:
        args.max_len = args.prompt_max_len + args.generate_max_len
    if args.agent_func_path and args.remote_rm_url:
        raise UsageError("--agent_func_path and --remote_rm_url are exclusive: the agent's step() gives the reward")
    has_reward = bool(args.remote_rm_url or args.agent_func_path or args.reward_pretrain)
    if not has_reward:
        raise UsageError("no reward: pass --reward_pretrain, --remote_rm_url (URL or reward_func .py) "
                         "or --agent_func_path")
    check_reward_file(args)
    probe_reward_servers(args)
    spec = get_advantage_estimator(args.advantage_estimator)
    if spec.group and args.n_samples_per_prompt <= 1:
        raise UsageError(f"--advantage_estimator {args.advantage_estimator} needs --n_samples_per_prompt > 1")
    if args.dynamic_filtering:
        if args.n_samples_per_prompt <= 1:
            raise UsageError("--dynamic_filtering needs --n_samples_per_prompt > 1")
        if not (args.remote_rm_url or args.agent_func_path):
            raise UsageError("--dynamic_filtering needs --remote_rm_url or --agent_func_path (0-1 scores)")
    if args.critic_pretrain and args.advantage_estimator != "gae":
        log.info(f"note: --critic_pretrain is unused with --advantage_estimator {args.advantage_estimator} (no critic)")
    per = args.micro_train_batch_size * world_size
    if args.train_batch_size % per:
        raise UsageError(f"--train_batch_size ({args.train_batch_size}) must be a multiple of "
                         f"--micro_train_batch_size ({args.micro_train_batch_size}) x world size ({world_size})")
    total = args.rollout_batch_size * args.n_samples_per_prompt
    if total % args.train_batch_size and not args.dynamic_filtering:
        raise UsageError(f"--rollout_batch_size x --n_samples_per_prompt ({total}) must be a multiple of "
                         f"--train_batch_size ({args.train_batch_size})")
    if args.rollout_batch_size % world_size:
        raise UsageError(f"--rollout_batch_size ({args.rollout_batch_size}) must be a multiple of the world size "
                         f"({world_size})")
    if args.max_failed_steps < 1:
        raise UsageError(f"--max_failed_steps must be >= 1, got {args.max_failed_steps}")
    if args.max_filter_rounds < 1:
        raise UsageError(f"--max_filter_rounds must be >= 1, got {args.max_filter_rounds}")
    if args.generate_max_len >= args.max_len and not dynamic_new_tokens:
        raise UsageError(f"--generate_max_len ({args.generate_max_len}) must be below --max_len ({args.max_len})")
    if given.policy is not None and vlm_mode(args):
        raise UsageError("--max_images_per_prompt: a vision-language policy is read with its processor from a "
                         "directory; pass the model's directory, not the loaded model")
    # last: the flags are consistent before any model is fetched
    resolve_model_paths(args, skip=given_flags(given))
    policy = given.policy_or_path(args.pretrain)
    if max_len_given:
        check_positions(policy, args.max_len, f"--max_len {args.max_len}")
    else:
        check_positions(policy, args.max_len, f"--prompt_max_len {args.prompt_max_len} + --generate_max_len "
                        f"{args.generate_max_len} = {args.max_len} (the default --max_len)")
    resolve_rollout_engine(args, args.max_len, pictures=vlm_mode(args), model=given.policy)
    if args.load_in_4bit:
        _check_qlora_engine(args, world_size)
    if given.policy is not None and args.rollout_engine == "vllm":
        raise UsageError("--rollout_engine vllm loads the policy's weights from a directory; a model given in "
                         "memory generates with the builtin or hf engine")
    critic = (("the critic", critic_path(args, given)),) if args.advantage_estimator == "gae" else ()
    ref = given.ref if given.ref is not None else args.ref_pretrain
    check_packing(args, ("--pretrain", policy), ("--ref_pretrain", ref), *critic)


def given_flags(given: GivenModels) -> tuple[str, ...]:
    """The model flags whose model the run was given as an object (they name where it came from)."""
    return (("pretrain",) if given.policy is not None else ()) + (("ref_pretrain",) if given.ref is not None else ())


def check_reward_file(args: argparse.Namespace) -> None:
    """A --remote_rm_url reward file (or Python callable) whose function fits neither reward shape
    (rlhfkit.rewards.shapes), or that lacks the function, stops the run here, before any model loads."""
    from rlhfkit.rewards.shapes import reward_shape
    from rlhfkit.rewards.reward_file import is_reward_file, load_reward_func

    url = args.remote_rm_url
    try:
        if isinstance(url, str) and is_reward_file(url.strip()):
            load_reward_func(url.strip())
        elif callable(url):
            reward_shape(url, "reward_funcs")
    except (TypeError, AttributeError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None


def probe_reward_servers(args: argparse.Namespace) -> None:
    """A reward server (--remote_rm_url http://...) that does not accept connections stops the run here,
    before any model is loaded, instead of failing every sample of the first steps."""
    from rlhfkit.rewards.http_client import PROBE_WINDOW_S, probe_reward_server

    window = min(PROBE_WINDOW_S, args.reward_timeout) if args.reward_timeout else PROBE_WINDOW_S
    for url in reward_server_urls(args):
        why = probe_reward_server(url, window)
        if why is not None:
            raise UsageError(f"--remote_rm_url: {why}; start the server first (serve_rm listens before it loads "
                             "its model)")


def resolve_optional_terms(args: argparse.Namespace) -> None:
    """The critic's optimizer flags (unset: the actor's), EMA, PPO-ptx, offloading and checkpoint
    settings, filled into `args` (resolve's copy); a note for each one set where it has no effect."""
    for dest in CRITIC_OPTIM:
        if getattr(args, f"critic_{dest}") is None:
            setattr(args, f"critic_{dest}", getattr(args, dest))
    if args.ema_beta is not None and not args.enable_ema:
        note_once(f"note: --ema_beta {args.ema_beta} has no effect without --enable_ema")
    args.ema_beta = EMA_BETA if args.ema_beta is None else args.ema_beta
    if args.enable_ema and not 0.0 <= args.ema_beta <= 1.0:
        raise UsageError(f"--ema_beta must be in [0, 1], got {args.ema_beta}")
    if args.ptx_coef is not None and not args.pretrain_data:
        note_once(f"note: --ptx_coef {args.ptx_coef} has no effect without --pretrain_data")
    args.ptx_coef = PTX_COEF if args.ptx_coef is None else args.ptx_coef
    if args.ptx_coef < 0:
        raise UsageError(f"--ptx_coef must be >= 0, got {args.ptx_coef}")
    if args.pretrain_data and args.ptx_coef == 0:
        note_once("note: --pretrain_data has no effect: --ptx_coef is 0")
    if args.ref_offload and args.init_kl_coef <= 0:
        note_once("note: --ref_offload has no effect: there is no reference model (--init_kl_coef 0)")
    if args.disable_ds_ckpt and not args.save_hf_ckpt and args.save_steps > 0:
        note_once("note: --save_steps writes nothing: --disable_ds_ckpt without --save_hf_ckpt")
