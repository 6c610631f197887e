"""Merge a LoRA adapter into its base model and save a plain Hugging Face model directory.

    python -m rlhfkit.cli.lora_combiner --model_path BASE --lora_path ADAPTER --output_path OUT \\
        [--is_rm] [--param_dtype bf16]

The merged model is saved in the base model's dtype (its config.json, else its weights) unless
`--param_dtype` says otherwise.

With `--is_rm` the base is loaded as a reward model (backbone + `score` head; the trained head comes
from the adapter) and the output loads with `AutoModelForSequenceClassification(num_labels=1)`,
keeping `value_head_prefix`, `normalize_reward`, `mean` and `std` in its config.json.
The tokenizer is taken from the adapter directory when it has one, else from the base.
`train_sft --lora_rank` output (an adapter directory with the tokenizer) merges directly. Either path
may be a Hugging Face hub id. Errors (a missing directory, no adapter, no peft) are one line, exit 1.
"""

from __future__ import annotations

import argparse
import logging
from typing import Sequence

from rlhfkit.config.configs import ModelFlags
from rlhfkit.config.declare import add_fields
from rlhfkit.config.flags import FlagParser, add_output_path_flag

log = logging.getLogger(__spec__.name if __spec__ else __name__)  # also when run as __main__


def build_parser() -> FlagParser:
    p = FlagParser("lora_combiner", "Merge a LoRA adapter into its base model.")
    with p.group("models"):
        p.flag("--model_path", type=str, required=True, help="base model directory or hub id")
        p.flag("--lora_path", type=str, required=True, help="peft adapter directory or hub id")
        add_output_path_flag(p, "where the merged model is written", required=True)
        p.flag("--is_rm", action="store_true", help="the base is a reward model (sequence classification)")
        add_fields(p, ModelFlags, ["param_dtype"], help={
            "param_dtype": "dtype of the merged model's saved weights (default: the base model's, from its "
                           "config.json or weights)"})
    p.set_defaults(param_dtype=None)
    return p


def run(args: argparse.Namespace) -> str:
    from rlhfkit.models.lora_merge import merge_lora

    out = merge_lora(args.model_path, args.lora_path, args.output_path, is_rm=args.is_rm,
                     param_dtype=args.param_dtype)
    from rlhfkit.trainers.model_card import write_model_card

    write_model_card(out, trainer="lora_combiner", base_model=args.model_path,
                     settings={"lora_path": args.lora_path, "is_rm": args.is_rm, "param_dtype": args.param_dtype or "the base model's"})
    log.info(f"lora_combiner: merged {args.lora_path} into {args.model_path} -> {out}")
    return out


def main(argv: Sequence[str] | None = None) -> str:
    from rlhfkit.cli.common import cli_main

    args = build_parser().parse(argv)
    done: list[str] = []
    cli_main("lora_combiner", lambda: done.append(run(args)))
    return done[0]


if __name__ == "__main__":
    from rlhfkit.parallel.rendezvous import run_main

    run_main(main)
