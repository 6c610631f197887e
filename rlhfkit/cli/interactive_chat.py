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
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence, TextIO

import torch

from rlhfkit.cli.common import UsageError, check_packages, cli_main, resolve_model_paths, set_seed
from rlhfkit.config.flags import (DEFAULT_INPUT_TEMPLATE, MODEL, FlagParser, add_csft_flags, add_device_flag,
                                  add_max_len_flag, add_model_flags, add_model_name_alias_flag, add_sampling_flags,
                                  add_seed_flag, add_template_flags, mark_training_only)
from rlhfkit.data.post_processors import csft_prompt_suffix
from rlhfkit.data.templates import check_input_template, fill_template, has_chat_template, render_chat

PROG = "interactive_chat"


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
    p.set_defaults(max_len=4096, top_p=0.9, temperature=0.2, repetition_penalty=1.2)
    mark_training_only(p)
    return p


@dataclass
class ChatSession:
    """The conversation so far and how it becomes prompt text."""

    tokenizer: Any
    system: str = ""
    input_template: str | None = DEFAULT_INPUT_TEMPLATE
    apply_chat_template: bool = False
    csft_prompt: str | None = None  # set when --enable_csft
    messages: list[dict[str, str]] = field(default_factory=list)
    transcript: str = ""

    def __post_init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.transcript = self.system

    def _turn_text(self, user: str) -> str:
        if self.apply_chat_template:
            return render_chat(self.tokenizer, self.messages + [{"role": "user", "content": user}],
                               add_generation_prompt=True)
        sep = "\n" if self.transcript else ""
        return self.transcript + sep + fill_template(self.input_template, user)

    def prompt(self, user: str) -> str:
        """The text the model continues for this user turn."""
        text = self._turn_text(user)
        return csft_prompt_suffix(text, self.csft_prompt) if self.csft_prompt is not None else text

    def add_turn(self, user: str, reply: str) -> None:
        self.transcript = self._turn_text(user) + reply
        self.messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]


@dataclass
class ReplyConfig:
    max_len: int = 4096
    greedy_sampling: bool = False
    temperature: float = 0.2
    top_p: float = 0.9
    repetition_penalty: float = 1.2

    def __post_init__(self) -> None:
        if self.max_len < 2:
            raise UsageError(f"--max_len must be >= 2, got {self.max_len}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"--top_p must lie in (0, 1], got {self.top_p}")
        if self.temperature <= 0 and not self.greedy_sampling:
            raise UsageError(f"--temperature must be > 0 (or pass --greedy_sampling), got {self.temperature}")
        if self.repetition_penalty <= 0:
            raise UsageError(f"--repetition_penalty must be > 0, got {self.repetition_penalty}")


class PromptTooLong(Exception):
    pass


@torch.no_grad()
def generate_reply(model: Any, tokenizer: Any, prompt: str, cfg: ReplyConfig) -> str:
    """HF `generate` on `prompt` (no special tokens added but the BOS the tokenizer adds, once); the new
    text without special tokens."""
    from transformers import GenerationConfig

    from rlhfkit.data.templates import encode
    from rlhfkit.rollout.engine_utils import eos_ids_of

    ids = encode(tokenizer, prompt, start=True)
    budget = cfg.max_len - len(ids)
    if budget < 1:
        raise PromptTooLong(f"the conversation is {len(ids)} tokens; --max_len {cfg.max_len} leaves no room "
                            "for a reply (type 'clear' to start over)")
    sample = not cfg.greedy_sampling
    gen = GenerationConfig(do_sample=sample, temperature=cfg.temperature if sample else None,
                           top_p=cfg.top_p if sample else None, top_k=0 if sample else None,
                           repetition_penalty=cfg.repetition_penalty, max_new_tokens=budget,
                           eos_token_id=eos_ids_of(model.generation_config, tokenizer) or None,
                           pad_token_id=tokenizer.pad_token_id)
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=gen)
    return tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)


def read_system_prompt(value: str | None) -> str:
    """--ta_prompt: the contents of a file, or the value itself when no such file exists."""
    if not value:
        return ""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    return value


def user_lines(stream: TextIO) -> Iterator[str]:
    """Lines of `stream` without their newline; a prompt on stderr when it is a terminal."""
    interactive = stream.isatty()
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = stream.readline()
        if not line:
            return
        yield line.rstrip("\r\n")


def chat_loop(model: Any, tokenizer: Any, session: ChatSession, cfg: ReplyConfig, stream: TextIO,
              out: TextIO) -> int:
    """Answer each line of `stream` on `out` until 'exit' or end of input; returns the number of replies."""
    replies = 0
    for line in user_lines(stream):
        command = line.strip().lower()
        if command == "exit":
            break
        if command == "clear":
            session.clear()
            print("(conversation cleared)", file=sys.stderr)
            continue
        try:
            reply = generate_reply(model, tokenizer, session.prompt(line), cfg)
        except PromptTooLong as e:
            print(f"{PROG}: {e}", file=sys.stderr)
            continue
        session.add_turn(line, reply)
        print(reply, file=out, flush=True)
        replies += 1
    return replies


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
