"""Knowledge distillation: `python -m rlhfkit.cli.train_kd` (OpenRLHF <= 0.9.5's train_kd flags).

    python -m rlhfkit.cli.train_kd --pretrain STUDENT --teacher_model TEACHER --dataset sft.jsonl \
        --input_key question --output_key response --kd_coef 0.4 --train_batch_size 128 \
        --micro_train_batch_size 2 --learning_rate 5e-6 --save_path ./ckpt/kd

Loss on response tokens (all tokens with `--pretrain_mode`): (1 - kd_coef) NLL + kd_coef
KL(teacher || student) (rlhfkit.losses.distill). The teacher is frozen and must share the
student's vocabulary; `--teacher_offload` keeps it in CPU memory between its forwards. Data is
read as for train_sft (`--input_key`, `--output_key`, `--input_template`,
`--apply_chat_template`). Logged: loss, kd_loss, nll_loss (eval_* on `--eval_dataset`).
"""

from __future__ import annotations

from rlhfkit.cli.common import UsageError, cli_main
from rlhfkit.cli.offline_common import (
    OfflineRun,
    add_offline_flags,
    frozen_model,
    load_split_items,
    require,
    setup,
    train_policy,
)
from rlhfkit.cli.run_dir import training_run
from rlhfkit.config.configs import from_args
from rlhfkit.config.declare import add_fields
from rlhfkit.config.offline_flags import KDFlags
from rlhfkit.config.flags import FlagParser, add_pretrain_mode_flag
from rlhfkit.data.sft import SFTDataConfig, SFTDataset
from rlhfkit.trainers.kd_task import KDTask

KD_PLOT_KEYS = ("loss", "kd", "grad_norm", "lr")  # rlhfkit.trainers.plot.PANELS


def build_parser() -> FlagParser:
    p = FlagParser("train_kd", __doc__ or "")
    add_offline_flags(p, max_len=2048, train_batch_size=128, micro_train_batch_size=8, max_epochs=2,
                      learning_rate=5e-6, wandb_project="rlhfkit_train_kd")
    add_fields(p, KDFlags, here=True)
    add_pretrain_mode_flag(p)
    return p


@training_run
def run(args) -> OfflineRun:
    require(args, "teacher_model")
    if not 0.0 <= args.kd_coef <= 1.0:
        raise UsageError(f"--kd_coef must be in [0, 1], got {args.kd_coef}")
    dist, tokenizer = setup(args)
    data_cfg = from_args(SFTDataConfig, args)
    train_items, eval_items = load_split_items(args, lambda rows: SFTDataset(rows, tokenizer, data_cfg))
    teacher = frozen_model(args.teacher_model, args, dist, "--teacher_model", args.teacher_offload)
    task = KDTask(pad_token_id=tokenizer.pad_token_id, teacher=teacher, kd_coef=args.kd_coef,
                  packing=args.packing_samples, device=dist.device, dist=dist)
    return train_policy(args, dist, tokenizer, task, train_items, eval_items, plot_keys=KD_PLOT_KEYS)


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the command line `argv`; returns the metrics history (as written to metrics.jsonl)."""
    args = build_parser().parse(argv)
    return cli_main("train_kd", lambda: run(args)).state.history


if __name__ == "__main__":
    from rlhfkit.parallel.rendezvous import run_main

    run_main(main)
