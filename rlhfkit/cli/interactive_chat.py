"""Chat with a model in the terminal: `python -m rlhfkit.cli.interactive_chat` (OpenRLHF <= v0.9.5).

    python -m rlhfkit.cli.interactive_chat --pretrain PATH --apply_chat_template [--ta_prompt system.txt]
    printf 'hi\\nclear\\nbye\\nexit\\n' | python -m rlhfkit.cli.interactive_chat --pretrain PATH --greedy_sampling

User turns are read from stdin one line each; each reply is printed to stdout followed by a newline
(prompts and notices go to stderr, so piped output holds the replies only). `exit` (or end of input)
ends the session, `clear` forgets the conversation.

Conversation text:

* the chat template: messages [system (--ta_prompt)] + user/assistant turns, rendered by the
  tokenizer's chat template with the generation prompt (rlhfkit.data.templates.render_chat). Used
  whenever the tokenizer has a chat template and no --input_template is given (one line says so;
  OpenRLHF needed --apply_chat_template, which still forces it), as `transformers chat` does.
* otherwise (an --input_template is given, or the tokenizer has no chat template): --ta_prompt text,
  then per turn `"\\n"` (except before the first piece) + --input_template filled with the user line
  (default: the line as typed, as in every command: rlhfkit.config.flags.DEFAULT_INPUT_TEMPLATE)
  + the reply. (OpenRLHF dropped the replies from the history in this mode; they are kept here.)
* `--enable_csft` appends " " + --csft_prompt + " " to the prompt of each turn (the same rule as
  batch_inference, rlhfkit.data.post_processors.csft_prompt_suffix); the history keeps the turn
  without it.

The token ids of the conversation start with the BOS the tokenizer adds, once (the BOS rule of
rlhfkit.data.templates).

`--ta_prompt` is a path to a text file holding the system prompt (OpenRLHF's meaning), or, when no
such file exists, the system prompt itself.

Generation uses Hugging Face `generate` on the model loaded by rlhfkit.models.loader (so
`--load_in_4bit` works on CUDA), with `--repetition_penalty` on by default (1.2, OpenRLHF's default). New tokens are capped so that prompt + reply fit in
`--max_len`; a conversation that no longer fits is reported and its last user turn dropped.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence, TextIO


from rlhfkit.cli.common import UsageError, check_packages, cli_main, resolve_model_paths, set_seed
from rlhfkit.config.flags import (MODEL, FlagParser, add_csft_flags, add_device_flag, add_max_len_flag,
                                  add_model_flags, add_model_name_alias_flag, add_sampling_flags, add_seed_flag,
                                  add_template_flags, mark_training_only)
from rlhfkit.data.templates import check_input_template, has_chat_template
from rlhfkit.inference.chat import (CHAT_MAX_LEN, CHAT_REPETITION_PENALTY, CHAT_TEMPERATURE, CHAT_TOP_P, PROG,
                                   ChatSession, ReplyConfig, chat_loop, read_system_prompt)


def build_parser() -> FlagParser:
    p = FlagParser(PROG, __doc__ or "")
    add_model_flags(p)
    with p.group(MODEL):
        add_model_name_alias_flag(p)
        add_device_flag(p)
    with p.group("generation"):
        add_max_len_flag(p, "prompt + reply tokens; a conversation that no longer fits is reported and its last turn "
                            "dropped")
        add_sampling_flags(p, "reply")
        add_seed_flag(p, "sampling seed")
    with p.group("prompt format"):
        add_template_flags(p, input_help="format of each user turn with one {} for the text, instead of the chat "
                           "template (default: the chat template when the tokenizer has one, else the line as typed)",
                           chat_help="render the conversation with the tokenizer's chat template (the default when "
                           "it has one and no --input_template is given)")
        p.flag("--ta_prompt", type=str, default=None, help="system prompt: a text file, or the text itself")
        add_csft_flags(p)
    p.set_defaults(max_len=CHAT_MAX_LEN, top_p=CHAT_TOP_P, temperature=CHAT_TEMPERATURE,
                   repetition_penalty=CHAT_REPETITION_PENALTY)
    mark_training_only(p)
    return p


def load(args: argparse.Namespace) -> tuple[Any, Any]:
    """(model, tokenizer) of --pretrain through rlhfkit's loader."""
    from rlhfkit.parallel.dist import resolve_device
    from rlhfkit.config.configs import ModelConfig, from_args
    from rlhfkit.models.loader import load_causal_lm, load_tokenizer

    if args.lora_rank > 0:
        raise UsageError("--lora_rank: interactive_chat loads full models; merge an adapter with lora_combiner")
    device = resolve_device(args.device)
    dtype = args.param_dtype if device.startswith("cuda") else "fp32"
    tokenizer = load_tokenizer(args.pretrain, padding_side="left", chat_template=args.tokenizer_chat_template,
                               use_fast=not args.disable_fast_tokenizer)
    if args.apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise UsageError("--apply_chat_template: the tokenizer of --pretrain has no chat template; "
                         "give one with --tokenizer_chat_template")
    cfg = from_args(ModelConfig, args, param_dtype=dtype, lora_rank=0, gradient_checkpointing=False)
    return load_causal_lm(cfg, device=device).eval(), tokenizer


def use_chat_template(tokenizer: Any, apply_chat_template: bool, input_template: str | None) -> bool:
    """The chat template renders the conversation: asked for, or the tokenizer has one and no
    --input_template is given (module docstring); one line on stderr says which format is used when not
    asked (stdout holds the replies only)."""
    if apply_chat_template:
        if input_template is not None:
            print(f"note: {PROG}: --input_template has no effect: --apply_chat_template renders the conversation",
                  file=sys.stderr)
        return True
    if input_template is not None:
        return False
    if has_chat_template(tokenizer):
        print(f"note: {PROG}: turns are rendered with the tokenizer's chat template (give --input_template for a "
              "plain template instead)", file=sys.stderr)
        return True
    print(f"note: {PROG}: the tokenizer has no chat template; each turn is the line as typed (give "
          "--input_template, e.g. $'User: {}\\nAssistant: ', for a plain template)", file=sys.stderr)
    return False


def run(args: argparse.Namespace, stream: TextIO | None = None, out: TextIO | None = None) -> int:
    if not args.pretrain:
        raise UsageError("--pretrain is required (a model directory or hub id)")
    template = check_input_template(args.input_template)
    cfg = ReplyConfig(args.max_len, args.greedy_sampling, args.temperature, args.top_p, args.repetition_penalty)
    check_packages(args)
    resolve_model_paths(args)
    set_seed(args.seed)
    model, tokenizer = load(args)
    chat = use_chat_template(tokenizer, args.apply_chat_template, args.input_template)
    session = ChatSession(tokenizer, read_system_prompt(args.ta_prompt), None if chat else template, chat,
                          args.csft_prompt if args.enable_csft else None)
    if (stream or sys.stdin).isatty():
        print(f"{PROG}: type a message; 'clear' starts over, 'exit' quits", file=sys.stderr)
    return chat_loop(model, tokenizer, session, cfg, stream or sys.stdin, out or sys.stdout)


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse(argv)
    cli_main(PROG, lambda: run(args))


if __name__ == "__main__":
    from rlhfkit.parallel.rendezvous import run_main

    run_main(main)
