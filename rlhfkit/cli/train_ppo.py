"""RL training in one process or under torchrun: `python -m rlhfkit.cli.train_ppo`.

Accepts the flags of OpenRLHF's train_ppo_ray (flat names and dotted aliases):

    python -m rlhfkit.cli.train_ppo --pretrain PATH --remote_rm_url examples/reward_func.py \
        --prompt_data data.jsonl --input_key input --label_key label \
        --advantage_estimator group_norm --n_samples_per_prompt 8 --rollout_batch_size 64 \
        --train_batch_size 256 --micro_train_batch_size 8 --init_kl_coef 1e-3 --use_kl_loss \
        --generate_max_len 1024 --actor_learning_rate 1e-6 --save_path ./ckpt/grpo

Placement flags (`--*_num_nodes`, `--vllm_*`, `--colocate_*`) take effect in train_ppo_ray.
"""

from __future__ import annotations

from rlhfkit.backend.dist import init_distributed
from rlhfkit.cli import ppo_setup as S
from rlhfkit.cli.common import cli_main, disable_hf_progress_bars, make_logger, parallel_dims, set_seed
from rlhfkit.config.flags import FlagParser
from rlhfkit.config.rl_flags import add_rl_flags
from rlhfkit.data.io import load_mixture
from rlhfkit.data.prompts import PromptDataConfig, build_prompt_samples
from rlhfkit.models.loader import load_tokenizer
from rlhfkit.trainers.rl import RLTrainer

PLOT_KEYS = ("reward", "eval_pass1", "eval_reward", "policy_loss", "kl", "response_length")


def build_parser() -> FlagParser:
    p = FlagParser("train_ppo", __doc__ or "")
    add_rl_flags(p)
    return p


def load_prompts(args, tokenizer, spec: str, split: str, probs: str | None, max_samples: int):
    rows = load_mixture(spec, probs, split=split, max_samples=max_samples, seed=args.seed,
                        max_row_bytes=args.max_row_bytes)
    cfg = PromptDataConfig(input_key=args.input_key, label_key=args.label_key, input_template=args.input_template,
                           apply_chat_template=args.apply_chat_template,
                           tokenizer_chat_template=args.tokenizer_chat_template, max_prompt_len=args.prompt_max_len)
    return build_prompt_samples(rows, tokenizer, cfg)


def load_tokenizer_and_prompts(args):
    """(tokenizer, train prompts of --prompt_data, eval prompts of --eval_dataset or [])."""
    tokenizer = load_tokenizer(args.pretrain, chat_template=args.tokenizer_chat_template,
                               use_fast=not args.disable_fast_tokenizer)
    prompts = load_prompts(args, tokenizer, args.prompt_data, args.prompt_split, args.prompt_data_probs,
                           args.max_samples)
    eval_prompts = (load_prompts(args, tokenizer, args.eval_dataset, args.eval_split, None,
                                 args.eval_max_samples or args.max_samples) if args.eval_dataset else [])
    return tokenizer, prompts, eval_prompts


def build_trainer(args, dist):
    """Everything the loop needs, from the flags; returns (trainer, policy_backend, critic_backend, tokenizer)."""
    tokenizer, prompts, eval_prompts = load_tokenizer_and_prompts(args)
    num_steps = S.optimizer_steps(args, len(prompts))
    dims = parallel_dims(args, dist)  # one mesh description for every model of this process group
    policy, policy_backend = S.build_policy(args, dist, num_steps, dims)
    ref = S.build_ref(args, dist, dims)
    critic, critic_backend = S.build_critic(args, dist, num_steps, dims)
    reward_model = S.build_reward_model(args, dist)
    engine = S.build_engine_for(args, tokenizer, dist)
    executor = S.build_executor(args, engine, tokenizer, args.temperature)
    eval_executor = S.build_executor(args, engine, tokenizer, args.eval_temperature) if eval_prompts else None
    if eval_prompts and reward_model is not None:
        raise S.UsageError("--eval_dataset scores with --remote_rm_url or --agent_func_path; "
                           "evaluation with a reward model is not supported")
    ckpt = S.checkpointer(args, policy_backend, critic_backend, tokenizer)
    trainer = RLTrainer(S.loop_config(args), S.advantage_config(args), S.shaping_config(args), policy=policy,
                        engine=engine, executor=executor, prompts=prompts, dist=dist,
                        logger=make_logger(args, dist.rank, PLOT_KEYS), pad_token_id=tokenizer.pad_token_id,
                        kl_ctl=S.kl_controller(args), ref=ref, critic=critic, reward_model=reward_model,
                        eval_executor=eval_executor, eval_prompts=eval_prompts, checkpointer=ckpt)
    return trainer, policy_backend, critic_backend, tokenizer


def save_final(args, dist, policy_backend, critic_backend, tokenizer) -> None:
    policy_backend.save_hf(args.save_path, tokenizer)
    if args.save_value_network and critic_backend is not None:
        from rlhfkit.models.value import save_value_model

        sd = critic_backend.full_state_dict()
        save_value_model(critic_backend.unwrap(), args.save_path.rstrip("/") + "_critic", tokenizer,
                         state_dict=sd, is_main_process=dist.rank == 0)
    if dist.rank == 0:
        print(f"policy saved to {args.save_path}")


def run(args, parser) -> None:
    dist = init_distributed(args.device)
    S.resolve_flags(args, dist.world_size)
    S.note_ray_only_flags(args, parser, "train_ppo")
    set_seed(args.seed, args.full_determinism)
    if args.disable_progress:
        disable_hf_progress_bars()
    trainer, policy_backend, critic_backend, tokenizer = build_trainer(args, dist)
    try:
        trainer.fit()
    finally:  # also when the run fails: no thread may be inside torch or user code at exit
        S.close_rollout(trainer.engine)
        trainer.logger.close()
    save_final(args, dist, policy_backend, critic_backend, tokenizer)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse(argv)
    cli_main("train_ppo", lambda: run(args, parser))


if __name__ == "__main__":
    main()
