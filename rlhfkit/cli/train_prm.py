"""Process reward model training: `python -m rlhfkit.cli.train_prm` (OpenRLHF <= 0.9.5's train_prm flags).

    python -m rlhfkit.cli.train_prm --pretrain PATH --dataset math_shepherd.jsonl \
        --input_key input --label_key value --placeholder_token "ки" --reward_tokens "+" "-" \
        --train_batch_size 256 --micro_train_batch_size 8 --learning_rate 1e-6 --save_path ./ckpt/prm

A causal LM is trained so that its logits at each `--placeholder_token` (the end of a reasoning
step), restricted to `--reward_tokens`, predict the step's label (Math-Shepherd style): hard
labels are reward tokens, soft labels are the probability of the first of exactly
two reward tokens (rlhfkit.data.prm, rlhfkit.losses.prm). Logged: loss, acc (eval_* on
`--eval_dataset`). The result is saved as a causal LM.
"""

from __future__ import annotations

from rlhfkit.cli.common import UsageError, cli_main
from rlhfkit.cli.offline_common import (
    OFFLINE_PLOT_KEYS,
    OfflineRun,
    add_offline_flags,
    load_split_items,
    setup,
    train_policy,
)
from rlhfkit.cli.run_dir import training_run
from rlhfkit.config.configs import from_args
from rlhfkit.config.declare import add_fields
from rlhfkit.config.offline_flags import PRMFlags
from rlhfkit.config.flags import FlagParser, add_label_key_flag
from rlhfkit.data.prm import PRM_LABEL_KEY, PRMDataConfig, PRMDataset
from rlhfkit.data.templates import token_id
from rlhfkit.trainers.prm_task import PRMTask


def build_parser() -> FlagParser:
    p = FlagParser("train_prm", __doc__ or "")
    add_offline_flags(p, max_len=2048, train_batch_size=128, micro_train_batch_size=1, max_epochs=1,
                      learning_rate=1e-6, wandb_project="rlhfkit_train_prm")
    add_label_key_flag(p, "column with one label per step (reward tokens, or numbers for soft labels)")
    p.set_defaults(label_key=PRM_LABEL_KEY)
    add_fields(p, PRMFlags, here=True)
    for dest in ("output_key", "input_template", "apply_chat_template"):
        p.mark_inert(dest, "PRM rows are the raw text of --input_key with one --label_key label per step")
    return p


@training_run
def run(args) -> OfflineRun:
    if not args.placeholder_token:
        raise UsageError("--placeholder_token is required (the token that ends each step)")
    dist, tokenizer = setup(args)
    data_cfg = from_args(PRMDataConfig, args)
    train_items, eval_items = load_split_items(args, lambda rows: PRMDataset(rows, tokenizer, data_cfg))
    reward_ids = [token_id(tokenizer, t, "--reward_tokens") for t in args.reward_tokens] if args.reward_tokens else None
    if any(it.soft for it in train_items + (eval_items or [])) and (reward_ids is None or len(reward_ids) != 2):
        raise UsageError("soft (numeric) PRM labels need exactly two --reward_tokens (the first is 'correct')")
    task = PRMTask(pad_token_id=tokenizer.pad_token_id,
                   placeholder_token_id=token_id(tokenizer, args.placeholder_token, "--placeholder_token"),
                   reward_token_ids=reward_ids, packing=args.packing_samples, device=dist.device, dist=dist)
    return train_policy(args, dist, tokenizer, task, train_items, eval_items, plot_keys=OFFLINE_PLOT_KEYS)


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the command line `argv`; returns the metrics history (as written to metrics.jsonl)."""
    args = build_parser().parse(argv)
    return cli_main("train_prm", lambda: run(args)).state.history


if __name__ == "__main__":
    from rlhfkit.parallel.rendezvous import run_main

    run_main(main)
