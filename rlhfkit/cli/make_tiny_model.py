"""Build a tiny random causal LM and a character-level tokenizer, offline.

    python -m rlhfkit.cli.make_tiny_model --save_path ./tiny [--arch llama|qwen2|gemma3_text|qwen3_moe|gpt_oss|phi3|olmo2|...] [--hidden_size 128]

`--arch qwen2_5_vl` or `qwen3_vl` builds a vision-language model instead: the language model of
these sizes, a two-block vision tower, and an image processor for small pictures (docs/vlm.md).
"""

from __future__ import annotations

import logging
from rlhfkit.config.configs import from_args
from rlhfkit.config.declare import add_fields
from rlhfkit.config.flags import FlagParser, add_save_path_flag, add_seed_flag
from rlhfkit.models.tiny import make_tiny_model
from rlhfkit.models.tiny_spec import TINY_SEED, VLM_ARCHS, TinyModelSpec

log = logging.getLogger(__spec__.name if __spec__ else __name__)  # also when run as __main__


def build_parser() -> FlagParser:
    p = FlagParser("make_tiny_model", __doc__ or "")
    with p.group("output"):
        add_save_path_flag(p, "directory to write the model and tokenizer to (Hugging Face format)", required=True)
        add_seed_flag(p, "seed of the random initial weights")
    p.set_defaults(seed=TINY_SEED)
    with p.group("architecture"):
        add_fields(p, TinyModelSpec, here=True)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse(argv)
    spec = from_args(TinyModelSpec, args)
    path = make_tiny_model(args.save_path, spec)
    what = "model, tokenizer and image processor" if spec.arch in VLM_ARCHS else "model and tokenizer"
    log.info(f"tiny {spec.arch} {what} written to {path}")


if __name__ == "__main__":
    from rlhfkit.parallel.rendezvous import run_main

    run_main(main)
