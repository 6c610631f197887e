"""Direct preference optimisation: `python -m rlhfkit.cli.train_dpo` (OpenRLHF's train_dpo flags).

    torchrun --nproc_per_node 8 -m rlhfkit.cli.train_dpo --pretrain SFT_PATH --dataset prefs.jsonl \
        --apply_chat_template --chosen_key chosen --rejected_key rejected --beta 0.1 \
        --train_batch_size 256 --micro_train_batch_size 1 --max_len 8192 --learning_rate 5e-7 \
        --save_path ./ckpt/dpo

Losses (rlhfkit.losses.preference): DPO (default), cDPO with `--label_smoothing`, IPO with
`--ipo`, plus `--nll_loss_coef` times the chosen answers' NLL. The reference model is
`--ref_pretrain` (default: `--pretrain`), frozen; its log-probs are computed per micro-batch
(rlhfkit.trainers.dpo_task says why); `--ref_offload` keeps it in CPU memory between uses.
Logged: loss, chosen_reward, rejected_reward, acc, margin (and eval_* on `--eval_dataset`).
Vision-language models: `--max_images_per_prompt N --image_key images`; both sides of a pair
show the row's pictures (docs/vlm.md).
"""

from __future__ import annotations

from rlhfkit.cli import vlm_setup as V
from rlhfkit.cli.common import cli_main
from rlhfkit.cli.offline_common import (
    OFFLINE_PLOT_KEYS,
    OfflineRun,
    add_offline_flags,
    add_pair_key_flags,
    add_ref_flags,
    load_split_items,
    reference,
    setup,
    train_policy,
)
from rlhfkit.cli.run_dir import training_run
from rlhfkit.config.configs import from_args
from rlhfkit.config.declare import add_fields
from rlhfkit.config.offline_flags import DPOFlags
from rlhfkit.config.flags import FlagParser, add_beta_flag, add_image_flags
from rlhfkit.data.preference import PAIRED_MAX_LEN, PreferenceDataConfig, PreferenceDataset
from rlhfkit.models.given import NONE, GivenModels
from rlhfkit.trainers.dpo_task import DPOTask, check_dpo_settings


def build_parser() -> FlagParser:
    p = FlagParser("train_dpo", __doc__ or "")
    add_offline_flags(p, max_len=PAIRED_MAX_LEN, train_batch_size=128, micro_train_batch_size=8, max_epochs=1,
                      learning_rate=1e-5, wandb_project="rlhfkit_train_dpo")
    p.set_defaults(eval_split="test")
    add_pair_key_flags(p)
    add_ref_flags(p)
    add_beta_flag(p, "DPO temperature beta")
    add_fields(p, DPOFlags, here=True)
    for dest in ("input_key", "output_key"):
        p.mark_inert(dest, "pairs are read from --prompt_key, --chosen_key and --rejected_key")
    add_image_flags(p)
    return p


@training_run
def run(args, given: GivenModels = NONE) -> OfflineRun:
    """Train; `given`: models and tokenizer handed over in memory (the Python API) instead of loaded from
    --pretrain / --ref_pretrain."""
    check_dpo_settings(args.beta, args.label_smoothing, args.ipo, args.nll_loss_coef)
    V.check_vlm_offline_flags(args)
    dist, tokenizer = setup(args, given)
    data_cfg = from_args(PreferenceDataConfig, args)
    vision = V.vision_context(args, tokenizer)
    train_items, eval_items = load_split_items(
        args, lambda rows: PreferenceDataset(rows, tokenizer, data_cfg, V.row_images(args, vision)))
    ref = reference(args, given, dist)
    task = DPOTask(pad_token_id=tokenizer.pad_token_id, ref=ref, beta=args.beta, label_smoothing=args.label_smoothing,
                   ipo=args.ipo, nll_loss_coef=args.nll_loss_coef, packing=args.packing_samples,
                   device=dist.device, dist=dist, vision=vision)
    return train_policy(args, dist, tokenizer, task, train_items, eval_items, plot_keys=OFFLINE_PLOT_KEYS,
                        given=given)


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the command line `argv`; returns the metrics history (as written to metrics.jsonl)."""
    args = build_parser().parse(argv)
    return cli_main("train_dpo", lambda: run(args)).state.history


if __name__ == "__main__":
    from rlhfkit.parallel.rendezvous import run_main

    run_main(main)
