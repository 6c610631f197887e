"""A chat with a model, turn by turn (the `rlhfkit chat` / interactive_chat command runs it on a terminal):

    ChatSession     the conversation so far and the text the model continues for the next user turn (the
                    tokenizer's chat template, or a plain --input_template transcript; csft suffix)
    ReplyConfig     sampling settings of a reply (greedy or temperature / top-p, repetition penalty, --max_len)
    generate_reply  Hugging Face `generate` on a turn's text (the BOS the tokenizer adds, once)
    chat_loop       answer each line of a stream until `exit`; `clear` forgets the conversation
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator, TextIO

import torch

from rlhfkit.config.configs import ChatSamplingFlags, DataFlags
from rlhfkit.config.declare import default_of
from rlhfkit.config.errors import UsageError
from rlhfkit.config.flags import DEFAULT_INPUT_TEMPLATE
from rlhfkit.data.post_processors import csft_prompt_suffix
from rlhfkit.data.templates import fill_template, render_chat

PROG = "interactive_chat"  # the name notices on stderr carry


@dataclass
class ChatSession:
    """The conversation so far and how it becomes prompt text."""

    tokenizer: Any
    system: str = ""
    input_template: str | None = DEFAULT_INPUT_TEMPLATE
    apply_chat_template: bool = default_of(DataFlags, "apply_chat_template")
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


# interactive_chat's defaults of --max_len, --temperature, --top_p, --repetition_penalty (its parser reads them)
CHAT_MAX_LEN = 4096
CHAT_TEMPERATURE = 0.2
CHAT_TOP_P = 0.9
CHAT_REPETITION_PENALTY = 1.2


@dataclass
class ReplyConfig:
    max_len: int = CHAT_MAX_LEN
    greedy_sampling: bool = default_of(ChatSamplingFlags, "greedy_sampling")
    temperature: float = CHAT_TEMPERATURE
    top_p: float = CHAT_TOP_P
    repetition_penalty: float = CHAT_REPETITION_PENALTY

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
