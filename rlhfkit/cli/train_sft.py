"""Supervised fine-tuning: `python -m rlhfkit.cli.train_sft` (OpenRLHF's train_sft flags).

    torchrun --nproc_per_node 8 -m rlhfkit.cli.train_sft --pretrain PATH --dataset data.jsonl \
        --input_key question --output_key response --train_batch_size 256 --micro_train_batch_size 2 \
        --max_len 4096 --zero_stage 2 --param_dtype bf16 --learning_rate 5e-6 --save_path ./ckpt/sft

Loss on response tokens only (`--pretrain_mode`: all tokens; `--multiturn`: every assistant turn).
"""

from __future__ import annotations

from rlhfkit.backend.dist import init_distributed
from rlhfkit.backend.fsdp2 import FSDP2Backend
from rlhfkit.cli.common import cli_main, make_logger, set_seed
from rlhfkit.config.configs import BackendConfig, ModelConfig, OptimConfig, from_args
from rlhfkit.config.flags import (FlagParser, add_backend_flags, add_ckpt_flags, add_data_flags,
                                  add_logging_flags, add_model_flags, add_train_flags)
from rlhfkit.data.io import load_mixture
from rlhfkit.data.sft import SFTDataConfig, SFTDataset
from rlhfkit.models.loader import load_causal_lm, load_tokenizer
from rlhfkit.trainers.offline import LoopConfig, train_offline
from rlhfkit.trainers.sft_task import SFTTask


def build_parser() -> FlagParser:
    p = FlagParser("train_sft", __doc__ or "")
    add_model_flags(p)
    add_data_flags(p, input_template="User: {}\nAssistant: ")
    add_train_flags(p, train_batch_size=128, micro_train_batch_size=8, max_epochs=2, learning_rate=5e-6)
    add_backend_flags(p)
    add_ckpt_flags(p, ckpt_path="./ckpt/checkpoints_sft")
    add_logging_flags(p, wandb_project="rlhfkit_train_sft")
    p.flag("--multiturn", "--data.multiturn", action="store_true")
    p.flag("--pretrain_mode", "--model.pretrain_mode_enable", action="store_true")
    p.flag("--max_steps", type=int, default=None, help="stop after this many optimizer steps")
    return p


def load_sft_items(args, tokenizer, spec: str, split: str, probs: str | None):
    rows = load_mixture(spec, probs, split=split, max_samples=args.max_samples, seed=args.seed)
    ds = SFTDataset(rows, tokenizer, from_args(SFTDataConfig, args))
    if ds.num_dropped:
        print(f"{ds.num_dropped} of {len(rows)} samples of {spec} dropped: no response token within --max_len")
    return ds.items


def run(args, on_step_end=None) -> None:
    if not args.pretrain:
        raise ValueError("--pretrain is required (a local Hugging Face model directory)")
    if not args.dataset:
        raise ValueError("--dataset is required")
    dist = init_distributed(args.device)
    set_seed(args.seed)
    tokenizer = load_tokenizer(args.pretrain, chat_template=args.tokenizer_chat_template,
                               use_fast=not args.disable_fast_tokenizer)
    train_items = load_sft_items(args, tokenizer, args.dataset, args.dataset_split, args.dataset_probs)
    eval_items = (load_sft_items(args, tokenizer, args.eval_dataset, args.eval_split, None)
                  if args.eval_dataset else None)
    loop = LoopConfig(train_batch_size=args.train_batch_size, micro_train_batch_size=args.micro_train_batch_size,
                      max_epochs=args.max_epochs, seed=args.seed, logging_steps=args.logging_steps,
                      eval_steps=args.eval_steps, save_steps=args.save_steps, ckpt_path=args.ckpt_path,
                      max_ckpt_num=args.max_ckpt_num, load_checkpoint=args.load_checkpoint,
                      show_progress=not args.disable_progress, max_steps=args.max_steps)
    num_steps = (len(train_items) // args.train_batch_size) * args.max_epochs
    if args.max_steps:
        num_steps = min(num_steps, args.max_steps)
    model = load_causal_lm(from_args(ModelConfig, args), master_dtype="fp32")
    backend = FSDP2Backend(model, from_args(BackendConfig, args), from_args(OptimConfig, args),
                           num_training_steps=max(num_steps, 1), dist=dist)
    logger = make_logger(args, dist.rank)
    task = SFTTask(pad_token_id=tokenizer.pad_token_id, packing=args.packing_samples, device=dist.device)
    train_offline(task, backend, train_items, loop, dist, logger, eval_items, on_step_end=on_step_end)
    backend.save_hf(args.save_path, tokenizer)
    logger.close()
    if dist.rank == 0:
        print(f"model saved to {args.save_path}")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse(argv)
    cli_main("train_sft", lambda: run(args))


if __name__ == "__main__":
    main()
