"""Reward-model training: `python -m rlhfkit.cli.train_rm` (OpenRLHF's train_rm flags).

    torchrun --nproc_per_node 8 -m rlhfkit.cli.train_rm --pretrain PATH --dataset prefs.jsonl \
        --apply_chat_template --chosen_key chosen --rejected_key rejected --packing_samples \
        --train_batch_size 256 --micro_train_batch_size 1 --max_len 8192 --learning_rate 9e-6 \
        --save_path ./ckpt/rm

Pairwise Bradley-Terry loss (`--loss sigmoid`, or `logexp`; `--margin_loss` subtracts each row's
`margin` column) on the score at the last token, chosen and rejected in one forward pass
(rlhfkit.trainers.rm_task). The value head is freshly initialised on `--pretrain` and named by
`--value_head_prefix` (default `score`, so that the saved model is an ordinary
`AutoModelForSequenceClassification` checkpoint; alias `--value_prefix_head`).

Evaluation (eval_loss, eval_acc = chosen scored above rejected, eval rewards) runs on
`--eval_dataset` every `--eval_steps` (default: each epoch) and once more at the end.

Reward statistics for `--normalize_reward` (used by PPO and serve_rm): after training, the mean
and std of the scores of every chosen and rejected answer of `--eval_dataset` are written into
the saved config.json (`mean`, `std`). Without `--eval_dataset` they come from the first 1% of
the training pairs (at least 100, or all when fewer), as OpenRLHF does; unlike OpenRLHF we do not
report eval metrics on those pairs, since they were trained on (give `--eval_dataset` for an
honest accuracy).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Sequence

from rlhfkit.parallel.dist import DistInfo
from rlhfkit.cli.common import UsageError, cli_main, make_logger
from rlhfkit.cli.offline_common import (OFFLINE_PLOT_KEYS, OfflineRun, add_offline_flags, add_pair_key_flags,
                                        load_split_items, save_model, setup, train_task, trainable_backend)
from rlhfkit.cli.run_dir import training_run
from rlhfkit.config.configs import ModelConfig, from_args
from rlhfkit.config.declare import add_fields
from rlhfkit.config.flags import FlagParser, add_value_head_flag
from rlhfkit.config.offline_flags import RewardLossFlags
from rlhfkit.data.preference import PAIRED_MAX_LEN, PreferenceDataConfig, PreferenceDataset
from rlhfkit.models.given import NONE, GivenModels
from rlhfkit.models.value import load_value_model, scoring_tokenizer, update_reward_config, value_model_from
from rlhfkit.trainers.metrics import metrics_record
from rlhfkit.trainers.rm_task import RMTask, reward_statistics

log = logging.getLogger(__spec__.name if __spec__ else __name__)  # also when run as __main__

STATS_FRACTION, STATS_MIN_PAIRS = 0.01, 100


def build_parser() -> FlagParser:
    p = FlagParser("train_rm", __doc__ or "")
    add_offline_flags(p, max_len=PAIRED_MAX_LEN, train_batch_size=128, micro_train_batch_size=1, max_epochs=1,
                      learning_rate=9e-6, wandb_project="rlhfkit_train_rm")
    add_pair_key_flags(p)
    add_value_head_flag(p, "name of the value head module (score: loadable by AutoModelForSequenceClassification)")
    add_fields(p, RewardLossFlags, here=True)
    for dest in ("input_key", "output_key"):
        p.mark_inert(dest, "pairs are read from --prompt_key, --chosen_key and --rejected_key")
    return p


def statistics_items(train_items: Sequence[Any], eval_items: Sequence[Any] | None) -> Sequence[Any]:
    """The pairs whose scores give the stored mean/std: the eval set, else the first 1% (>= 100) of train."""
    if eval_items:
        return eval_items
    n = len(train_items)
    return train_items[:min(n, max(math.ceil(STATS_FRACTION * n), STATS_MIN_PAIRS))]


def save_reward_model(args, backend, tokenizer, mean: float, std: float, dist: DistInfo, logger=None,
                      state=None) -> None:
    """Store mean/std (and the head name, pad id) in the config, then save in Hugging Face format.
    `tokenizer` is the scoring tokenizer (plain transformers then scores text as rlhfkit does;
    rlhfkit.models.scoring_tokenizer)."""
    model = backend.unwrap()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if std > 0:
        update_reward_config(base.config, tokenizer, mean=mean, std=std)
    else:
        log.warning(f"warning: all reward scores are equal (std 0); no mean/std stored in {args.save_path}")
        update_reward_config(base.config, tokenizer)
    if base is not model and dist.rank == 0:  # LoRA: the adapter plus the reward config (lora_combiner --is_rm)
        base.config.save_pretrained(args.save_path)
    save_model(args, backend, tokenizer, dist, logger, trainer="rm", state=state)


@training_run
def run(args, given: GivenModels = NONE) -> OfflineRun:
    """Train; `given`: the model and tokenizer handed over in memory (the Python API): the value model takes
    the given module's backbone tensors (no copy) instead of loading --pretrain."""
    if args.micro_train_batch_size < 1:
        raise UsageError("--micro_train_batch_size must be >= 1")
    dist, tokenizer = setup(args, given)
    data_cfg = from_args(PreferenceDataConfig, args)
    train_items, eval_items = load_split_items(args, lambda rows: PreferenceDataset(rows, tokenizer, data_cfg))
    task = RMTask(pad_token_id=tokenizer.pad_token_id, loss_type=args.loss, margin_loss=args.margin_loss,
                  packing=args.packing_samples, device=dist.device, dist=dist)
    if given.policy is not None:
        model = value_model_from(given.policy, args.value_head_prefix, from_args(ModelConfig, args))
    else:
        model = load_value_model(args.pretrain, value_head_prefix=args.value_head_prefix, init_value_head=True,
                                 dtype="fp32", cfg=from_args(ModelConfig, args), flag="--pretrain")
    backend = trainable_backend(model, args, dist, len(train_items))
    logger = make_logger(args, dist.rank, plot_keys=OFFLINE_PLOT_KEYS)
    # goes with every saved model, checkpoints' HF copies too; with --apply_chat_template its chat template
    # renders a conversation as training scored it (rlhfkit.models.scoring_tokenizer)
    save_tokenizer = scoring_tokenizer(tokenizer, chat=data_cfg.apply_chat_template)
    state = train_task(task, backend, train_items, eval_items, args, dist, logger, tokenizer=save_tokenizer)
    mean, std, n = reward_statistics(backend.model, task, statistics_items(train_items, eval_items),
                                     args.micro_train_batch_size, dist)
    stats = {"reward_mean": mean, "reward_std": std, "reward_stats_count": n}
    state.history.append(metrics_record(state.step, stats))
    logger.log(state.step, stats, console=True)
    save_reward_model(args, backend, save_tokenizer, mean, std, dist, logger, state=state)
    logger.close()
    return OfflineRun(state, backend, task, tokenizer, train_items, eval_items, {"mean": mean, "std": std})


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the command line `argv`; returns the metrics history (as written to metrics.jsonl)."""
    args = build_parser().parse(argv)
    return cli_main("train_rm", lambda: run(args)).state.history


if __name__ == "__main__":
    from rlhfkit.parallel.rendezvous import run_main

    run_main(main)
