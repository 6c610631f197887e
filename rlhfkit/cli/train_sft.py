"""Supervised fine-tuning: `python -m rlhfkit.cli.train_sft` (OpenRLHF's train_sft flags).

    torchrun --nproc_per_node 8 -m rlhfkit.cli.train_sft --pretrain PATH --dataset data.jsonl \
        --input_key question --output_key response --train_batch_size 256 --micro_train_batch_size 2 \
        --max_len 4096 --zero_stage 2 --param_dtype bf16 --learning_rate 5e-6 --save_path ./ckpt/sft

Loss on response tokens only (`--pretrain_mode`: all tokens; `--multiturn`: every assistant turn).
Vision-language models: `--max_images_per_prompt N --image_key images` reads each row's pictures
(docs/vlm.md); `--freeze_visual_encoder` trains the language model only.
"""

from __future__ import annotations

from rlhfkit.cli import offline_common as C
from rlhfkit.cli import vlm_setup as V
from rlhfkit.cli.common import cli_main
from rlhfkit.cli.run_dir import training_run
from rlhfkit.config.configs import from_args
from rlhfkit.config.declare import add_fields
from rlhfkit.config.offline_flags import SFTFlags
from rlhfkit.config.flags import FlagParser, add_image_flags, add_pretrain_mode_flag
from rlhfkit.data.sft import SFTDataConfig, SFTDataset
from rlhfkit.models.given import NONE, GivenModels
from rlhfkit.trainers.sft_task import SFTTask


def build_parser() -> FlagParser:
    p = FlagParser("train_sft", __doc__ or "")
    C.add_offline_flags(p, max_len=2048, train_batch_size=128, micro_train_batch_size=8, max_epochs=2,
                        learning_rate=5e-6, wandb_project="rlhfkit_train_sft")
    add_fields(p, SFTFlags, here=True)
    add_pretrain_mode_flag(p, "loss on every token of the raw text (no template; continued pretraining)")
    add_image_flags(p)
    return p


@training_run
def run(args, on_step_end=None, given: GivenModels = NONE) -> C.OfflineRun:
    """Train; `on_step_end(state, metrics, backend)` runs after each step (True stops early); `given`: the
    model and tokenizer handed over in memory (the Python API) instead of loaded from --pretrain."""
    V.check_vlm_offline_flags(args)
    dist, tokenizer = C.setup(args, given)
    data_cfg = from_args(SFTDataConfig, args)
    vision = V.vision_context(args, tokenizer)
    train_items, eval_items = C.load_split_items(
        args, lambda rows: SFTDataset(rows, tokenizer, data_cfg, V.row_images(args, vision)))
    task = SFTTask(pad_token_id=tokenizer.pad_token_id, packing=args.packing_samples, device=dist.device, dist=dist,
                   vision=vision)
    return C.train_policy(args, dist, tokenizer, task, train_items, eval_items, on_step_end=on_step_end,
                          given=given)


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the command line `argv`; returns the metrics history (as written to metrics.jsonl)."""
    args = build_parser().parse(argv)
    return cli_main("train_sft", lambda: run(args)).state.history


if __name__ == "__main__":
    from rlhfkit.parallel.rendezvous import run_main

    run_main(main)
