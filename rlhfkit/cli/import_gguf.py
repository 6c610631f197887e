"""Import a GGUF model file into a Hugging Face model folder, offline (no hub needed).

    python -m rlhfkit.cli.import_gguf --gguf SmolLM2-135M-Instruct.Q4_1.gguf --save_path ./smollm2 \\
        [--param_dtype bf16]

The weights are dequantized and saved in `--param_dtype` with the file's tokenizer and chat template;
where the chat template ends a turn with another token than the tokenizer's eos (or there is no pad
token), eos and pad are set to the end of turn in the tokenizer, config and generation_config, and
each change is printed (rlhfkit.models.gguf_import). The folder then works as `--pretrain` of every
command. Needs the `gguf` package: pip install 'rlhfkit[gguf]'. Errors (a missing file, a file
transformers cannot read) are one line, exit 1.
"""

from __future__ import annotations

import argparse
import logging
from typing import Sequence

from rlhfkit.config.configs import ModelFlags
from rlhfkit.config.declare import add_fields
from rlhfkit.config.flags import FlagParser, add_save_path_flag

log = logging.getLogger(__spec__.name if __spec__ else __name__)  # also when run as __main__


def build_parser() -> FlagParser:
    p = FlagParser("import_gguf", __doc__ or "")
    with p.group("models"):
        p.flag("--gguf", type=str, required=True, help="the .gguf file to import (llama.cpp's format)")
        add_save_path_flag(p, "where the Hugging Face model folder is written", required=True)
        add_fields(p, ModelFlags, ["param_dtype"],
                   help={"param_dtype": "dtype of the saved weights (the file's are dequantized)"})
    return p


def run(args: argparse.Namespace):  # -> GgufImport (its module imports torch lazily)
    from rlhfkit.models.gguf_import import import_gguf

    result = import_gguf(args.gguf, args.save_path, param_dtype=args.param_dtype)
    for line in result.repairs:
        log.info(f"import_gguf: {line}")
    log.info(f"import_gguf: {result.model_type} model, {result.num_parameters / 1e6:.1f}M parameters in "
             f"{result.param_dtype}, eos {result.eos_token!r}, pad {result.pad_token!r} -> {result.save_path}")
    return result


def main(argv: Sequence[str] | None = None):
    from rlhfkit.cli.common import cli_main

    args = build_parser().parse(argv)
    return cli_main("import_gguf", lambda: run(args))


if __name__ == "__main__":
    from rlhfkit.parallel.rendezvous import run_main

    run_main(main)
