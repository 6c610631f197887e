"""KTO on unpaired data: `python -m rlhfkit.cli.train_kto` (OpenRLHF <= 0.9.5's train_kto flags).

    python -m rlhfkit.cli.train_kto --pretrain SFT_PATH --dataset feedback.jsonl \
        --input_key prompt --output_key response --label_key label --beta 0.01 \
        --desirable_loss_weight 1.0 --undesirable_loss_weight 1.0 --save_path ./ckpt/kto

Each row holds a prompt (`--input_key`), an answer (`--output_key`) and a boolean label
(`--label_key`: true = desirable). KTO (Kahneman-Tversky Optimization) against a frozen reference
(`--ref_pretrain`, default `--pretrain`; `--ref_offload`), with the KL reference point estimated
from mismatched (prompt, other answer) pairs of each micro-batch, so `--micro_train_batch_size`
must be at least 2 (rlhfkit.trainers.kto_task). To balance classes, set
the weights so that w_d * n_desirable / (w_u * n_undesirable) lies in [1, 4/3].
"""

from __future__ import annotations

import logging
from rlhfkit.cli.common import UsageError, cli_main
from rlhfkit.cli.offline_common import (
    OfflineRun,
    add_offline_flags,
    add_ref_flags,
    load_split_items,
    reference,
    setup,
    train_policy,
)
from rlhfkit.cli.run_dir import training_run
from rlhfkit.config.configs import from_args
from rlhfkit.config.declare import add_fields
from rlhfkit.config.offline_flags import KTOFlags
from rlhfkit.config.flags import FlagParser, add_beta_flag, add_label_key_flag
from rlhfkit.data.preference import UNPAIRED_LABEL_KEY, UNPAIRED_OUTPUT_KEY, UnpairedDataConfig, UnpairedDataset
from rlhfkit.models.given import NONE, GivenModels
from rlhfkit.trainers.kto_task import KTO_BETA, KTOTask

log = logging.getLogger(__spec__.name if __spec__ else __name__)  # also when run as __main__

KTO_PLOT_KEYS = ("loss", "kl", "signed_reward", "rewards", "grad_norm", "lr")  # rlhfkit.trainers.plot.PANELS


def build_parser() -> FlagParser:
    p = FlagParser("train_kto", __doc__ or "")
    add_offline_flags(p, max_len=2048, train_batch_size=128, micro_train_batch_size=8, max_epochs=1,
                      learning_rate=1e-5, wandb_project="rlhfkit_train_kto")
    p.set_defaults(output_key=UNPAIRED_OUTPUT_KEY)
    add_ref_flags(p)
    add_beta_flag(p, "KTO beta")
    add_fields(p, KTOFlags, here=True)
    add_label_key_flag(p, "boolean column: true for a desirable answer")
    p.set_defaults(beta=KTO_BETA, label_key=UNPAIRED_LABEL_KEY)
    return p


def check_settings(args) -> None:
    if args.micro_train_batch_size < 2:
        raise UsageError("--micro_train_batch_size must be at least 2 for KTO: the KL reference point pairs "
                         "each prompt with another answer of the same micro-batch")
    if args.beta <= 0:
        raise UsageError(f"--beta must be > 0, got {args.beta}")
    if args.desirable_loss_weight < 0 or args.undesirable_loss_weight < 0:
        raise UsageError("--desirable_loss_weight and --undesirable_loss_weight must be >= 0")


@training_run
def run(args, given: GivenModels = NONE) -> OfflineRun:
    """Train; `given`: models and tokenizer handed over in memory (the Python API) instead of loaded from
    --pretrain / --ref_pretrain."""
    check_settings(args)
    dist, tokenizer = setup(args, given)
    data_cfg = from_args(UnpairedDataConfig, args)
    train_items, eval_items = load_split_items(args, lambda rows: UnpairedDataset(rows, tokenizer, data_cfg))
    good = sum(1 for it in train_items if it.label)
    if dist.rank == 0:
        log.info(f"KTO data: {good} desirable, {len(train_items) - good} undesirable answers")
    ref = reference(args, given, dist)
    task = KTOTask(pad_token_id=tokenizer.pad_token_id, ref=ref, max_len=args.max_len, beta=args.beta,
                   desirable_weight=args.desirable_loss_weight, undesirable_weight=args.undesirable_loss_weight,
                   packing=args.packing_samples, device=dist.device, dist=dist)
    return train_policy(args, dist, tokenizer, task, train_items, eval_items, plot_keys=KTO_PLOT_KEYS, given=given)


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the command line `argv`; returns the metrics history (as written to metrics.jsonl)."""
    args = build_parser().parse(argv)
    return cli_main("train_kto", lambda: run(args)).state.history


if __name__ == "__main__":
    from rlhfkit.parallel.rendezvous import run_main

    run_main(main)
