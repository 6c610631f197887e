"""Prompt building: `--input_template`, `--apply_chat_template`, `--tokenizer_chat_template`.

Two ways to turn a dataset value into model text, as in OpenRLHF:

* `--input_template "User: {}\\nAssistant: "`: the string value replaces `{}`. An empty template
  (`--input_template ""`, as OpenRLHF's rejection sampling script passes to train_sft) is no
  template: the value is used as it is, as OpenRLHF does.
* `--apply_chat_template`: the value (a string, taken as one user message, or a list of
  `{"role", "content"}` messages) goes through `tokenizer.apply_chat_template`. When both are
  given the chat template wins (the SFT command has a default `--input_template`).

`--tokenizer_chat_template` replaces the tokenizer's template (Jinja text, or a path to a file
holding it).

A response under a chat template is the text the template adds after the generation prompt:
`render(prompt + [assistant]) [len(render(prompt, add_generation_prompt=True)):]`. Rendering
is always done with `tokenize=False` (transformers 5 returns a dict for `tokenize=True`), and
text is encoded without special tokens, so templates that write `<s>` themselves are not doubled.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

from rlhfkit.data.io import DataError, Row

Message = dict[str, Any]


def check_input_template(template: str | None, flag: str = "--input_template") -> str | None:
    """Validate an input template: None or "" (no template), or a string with exactly one `{}`."""
    if template is None or template == "":
        return None
    if not isinstance(template, str) or "{}" not in template:
        raise DataError(f"{flag} must contain '{{}}' where the input goes, got {template!r}")
    if template.count("{}") > 1:
        raise DataError(f"{flag} must contain '{{}}' once, got {template!r}")
    if "\\n" in template:
        warnings.warn(f"{flag} contains a literal backslash-n ({template!r}); "
                      "use $'...' in bash for a real newline", stacklevel=2)
    return template


def fill_template(template: str | None, text: str) -> str:
    """`template` with `{}` replaced by `text` (no other braces are interpreted)."""
    return text if not template else template.replace("{}", text, 1)


def load_chat_template(value: str) -> str:
    """`--tokenizer_chat_template`: Jinja text, or a path to a file holding it."""
    if "{" not in value and os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise DataError(f"--tokenizer_chat_template is neither a Jinja template nor a file: {value!r}")
    return value


def set_chat_template(tokenizer: Any, template: str | None) -> None:
    """Replace the tokenizer's chat template (no-op for None)."""
    if template:
        tokenizer.chat_template = load_chat_template(template)


def require_chat_template(tokenizer: Any, flag: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{flag} needs a chat template, but the tokenizer has none; "
                        "give one with --tokenizer_chat_template")


def to_messages(value: Any, row: Row, key: str, role: str = "user") -> list[Message]:
    """A string becomes `[{"role": role, "content": value}]`; a message list is checked."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, dict) and "role" in value:
        value = [value]
    if not isinstance(value, list) or not value:
        raise row.error(f"key {key!r} must be a string or a non-empty list of chat messages, "
                        f"got {type(value).__name__}")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise row.error(f"key {key!r} message {i} must be an object with a string 'role'")
    return list(value)


def render_chat(tokenizer: Any, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
    """The chat template applied to `messages`, as text."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    if not isinstance(text, str):
        raise DataError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not text")
    return text


def chat_prompt_response(tokenizer: Any, prompt: Sequence[Message], response: Sequence[Message],
                         row: Row) -> tuple[str, str]:
    """(prompt text with generation prompt, the text the response messages add after it)."""
    head = render_chat(tokenizer, prompt, add_generation_prompt=True)
    full = render_chat(tokenizer, list(prompt) + list(response))
    if not full.startswith(head):
        raise row.error("the chat template does not render prompt+response as an extension of "
                        "the prompt with add_generation_prompt=True; cannot find the response span")
    return head, full[len(head):]


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text`, without special tokens added."""
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def token_id(tokenizer: Any, token: str, flag: str) -> int:
    """The id of a string that must be exactly one token."""
    ids = encode(tokenizer, token)
    if len(ids) != 1:
        raise DataError(f"{flag} {token!r} must be a single token, but it encodes to {len(ids)} tokens {ids}")
    return ids[0]


@dataclass
class PromptFormat:
    """How a prompt value becomes text: `--input_template` and/or `--apply_chat_template`."""

    input_template: str | None = None
    apply_chat_template: bool = False

    def __post_init__(self) -> None:
        check_input_template(self.input_template)

    def prompt_text(self, tokenizer: Any, value: Any, row: Row, key: str) -> str:
        """Prompt text, ending with the generation prompt under a chat template."""
        if self.apply_chat_template:
            return render_chat(tokenizer, to_messages(value, row, key), add_generation_prompt=True)
        if not isinstance(value, str):
            raise row.error(f"key {key!r} is a {type(value).__name__}; chat messages need "
                            "--apply_chat_template, otherwise give a string")
        return fill_template(self.input_template, value)

    def prompt_and_response(self, tokenizer: Any, prompt: Any, response: Any, row: Row,
                            keys: tuple[str, str]) -> tuple[str, str]:
        """(prompt text, response text) for one prompt value and one response value."""
        if self.apply_chat_template:
            p = to_messages(prompt, row, keys[0])
            r = to_messages(response, row, keys[1], role="assistant")
            return chat_prompt_response(tokenizer, p, r, row)
        if not isinstance(response, str):
            raise row.error(f"key {keys[1]!r} must be a string, got {type(response).__name__}")
        return self.prompt_text(tokenizer, prompt, row, keys[0]), response
