"""Prompt building and encoding: `--input_template`, `--apply_chat_template`, `--tokenizer_chat_template`,
and the BOS rule every encode path follows.

Two ways to turn a dataset value into model text, as in OpenRLHF:

* `--input_template "User: {}\\nAssistant: "`: the string value replaces `{}`. An empty template
  (`--input_template ""`, as OpenRLHF's rejection sampling script passes to train_sft) is no
  template: the value is used as it is, as OpenRLHF does.
* `--apply_chat_template`: the value (a string, taken as one user message, or a list of
  `{"role", "content"}` messages) goes through `tokenizer.apply_chat_template`. When both are
  given the chat template wins (and one line says --input_template has no effect).

Defaults, the same in every command (declared once: `rlhfkit.config.flags.DEFAULT_INPUT_TEMPLATE`, with
the three flags, `add_template_flags`):

* No input template: a string value is used as it is (RL, RM, DPO, KTO and TRL's string prompts all
  work so; OpenRLHF's train_sft alone defaulted to `User: {}\\nAssistant: `, which an SFT'd model then
  expected while RL fed it raw text).
* The chat template is used when asked for (`--apply_chat_template`), as OpenRLHF's command lines
  mean; when the tokenizer has one and a data command neither asks for it nor gives an input template,
  one line says so (`PromptFormat.note_unused`). The chat command (`rlhfkit chat`) renders its
  conversation with the chat template whenever the tokenizer has one (a conversation is what a chat
  template is for; `--input_template` picks a plain template instead).

`--tokenizer_chat_template` replaces the tokenizer's template (Jinja text, or a path to a file
holding it).

A response under a chat template is the text the template adds after the generation prompt:
`render(prompt + [assistant]) [len(render(prompt, add_generation_prompt=True)):]`. Rendering
is always done with `tokenize=False` (transformers 5 returns a dict for `tokenize=True`).

The BOS rule (`encode(..., start=True)`, `bos_prefix`): text is encoded without special tokens, and
a sequence that starts there (a prompt, a training row, a chat turn's whole conversation) gets the BOS
the tokenizer adds, once: `[bos] + ids` when `tokenizer("x")` puts `bos_token_id` before the ids of
`tokenizer("x", add_special_tokens=False)` (Llama 3, Gemma: yes; Qwen, SmolLM2/ChatML: no) and the
text's own ids do not start with it already (Gemma's chat template writes `<bos>` itself: not
doubled). Nothing else the tokenizer would add (an EOS some tokenizers append) is added, and text in
the middle of a sequence (a response, an agent's environment feedback, a multi-turn piece) gets none.
"""

from __future__ import annotations

import os
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

from rlhfkit.config.configs import DataFlags
from rlhfkit.config.declare import default_of
from rlhfkit.config.flags import DEFAULT_INPUT_TEMPLATE
from rlhfkit.config.notes import note_once
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


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


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


_BOS: "weakref.WeakKeyDictionary[Any, int | None]" = weakref.WeakKeyDictionary()


def added_bos(tokenizer: Any) -> int | None:
    """The BOS id `tokenizer(text)` (special tokens on) puts before the text's ids, or None when it adds
    none (probed once per tokenizer object)."""
    try:
        return _BOS[tokenizer]
    except (KeyError, TypeError):
        pass
    bos = tokenizer.bos_token_id
    with_special = list(tokenizer("a")["input_ids"])
    plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    found = bos if bos is not None and with_special[:1] == [bos] and plain[:1] != [bos] else None
    try:
        _BOS[tokenizer] = found
    except TypeError:  # not weak-referenceable: probed on every call
        pass
    return found


def bos_prefix(tokenizer: Any, ids: Sequence[int]) -> list[int]:
    """What the BOS rule puts before `ids` that start a sequence: `[bos]` when the tokenizer adds a BOS
    and `ids` do not start with it, else `[]`."""
    bos = added_bos(tokenizer)
    return [bos] if bos is not None and list(ids[:1]) != [bos] else []


def encode(tokenizer: Any, text: str, start: bool = False) -> list[int]:
    """Token ids of `text`, without special tokens added; `start`: the text begins a sequence, so it
    gets the BOS the tokenizer adds, once (the BOS rule, module docstring)."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
    return bos_prefix(tokenizer, ids) + ids if start else ids


HEAD_MARGIN = 32  # ids encoded past a limit, so that merges across the cut of a prefix cannot reach the limit
HEAD_CHARS = 8  # characters per token guessed for the first prefix; it grows 4x while it holds too few


def encode_head(tokenizer: Any, text: str, max_tokens: int | None, start: bool = False) -> list[int]:
    """The ids of `text` as `encode(tokenizer, text, start)` gives them, for a length filter or a cut at
    `max_tokens`: a text longer than that may give only its first `max_tokens + HEAD_MARGIN` ids, found by
    encoding growing prefixes of it, so that a huge row costs what the limit costs, not what the row does.
    The first `max_tokens + 1` ids are encode's either way: a prefix's last ids, which a merge across its
    cut may change, lie HEAD_MARGIN beyond them. `max_tokens` None: the whole text."""
    if max_tokens is None:
        return encode(tokenizer, text, start)
    keep = max(max_tokens, 0) + HEAD_MARGIN
    chars = keep * HEAD_CHARS
    while chars < len(text):
        ids = encode(tokenizer, text[:chars], start)
        if len(ids) > keep + HEAD_MARGIN:
            return ids[:keep]
        chars *= 4
    return encode(tokenizer, text, start)


def token_id(tokenizer: Any, token: str, flag: str) -> int:
    """The id of a string that must be exactly one token."""
    ids = encode(tokenizer, token)
    if len(ids) != 1:
        raise DataError(f"{flag} {token!r} must be a single token, but it encodes to {len(ids)} tokens {ids}")
    return ids[0]


@dataclass
class PromptFormat:
    """How a prompt value becomes text: `--input_template` and/or `--apply_chat_template`."""

    input_template: str | None = DEFAULT_INPUT_TEMPLATE
    apply_chat_template: bool = default_of(DataFlags, "apply_chat_template")

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

    def note_unused(self, tokenizer: Any) -> None:
        """One line when --input_template is given with --apply_chat_template (the chat template wins), or
        when the tokenizer has a chat template that neither flag asks for (module docstring)."""
        if self.apply_chat_template and self.input_template:
            note_once("note: --input_template has no effect: --apply_chat_template formats the prompts")
        if self.apply_chat_template or self.input_template is not None or not has_chat_template(tokenizer):
            return
        note_once("note: the tokenizer has a chat template, but --apply_chat_template is off: prompts are used "
                  "as they are (pass --apply_chat_template to use it, or --input_template '{}' for raw text "
                  "without this note)")

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
