"""Prompt dataset for RL: rows -> `rlhfkit.types.PromptSample`.

Each sample's `prompt` is the final text given to the tokenizer: the `--input_key` value run
through `--apply_chat_template` (a string becomes one user message; a message list is used as
is; the generation prompt is added) or `--input_template`. Its token ids start with the BOS the
tokenizer adds, once (`encode(..., start=True)`: the BOS rule of rlhfkit.data.templates); the text
itself does not get it (reward functions see the prompt as formatted). `label` is the `--label_key` value,
passed untouched to `reward_func` and agents (missing or null is an error naming file and row); `datasource` is the row's `datasource` column
(default "default"), used to split evaluation metrics per source, as in OpenRLHF. `input` and `columns`
keep the row's prompt value as read and its other columns, for reward functions in TRL's shape.

With `max_prompt_len`, prompts longer than that many tokens are dropped and counted
(`rlhfkit.data.items.check_dropped` reports them); a huge prompt is measured by encoding its head only
(`templates.encode_head`), never whole. An empty prompt, or one of only whitespace and invisible
characters (zero-width spaces, other format and control characters), is an error naming file, row and
key (one with a picture may have no text).

Vision-language prompts (`images`, a `rlhfkit.data.images.RowImages`: `--image_key`,
`--max_images_per_prompt`): each row's pictures are read and checked, and the prompt gets one
placeholder per picture (`<image>` tags or image content parts, through the chat template); a
prompt's length counts each picture's placeholder tokens. A bad picture is an error naming the row,
or under `--image_failure drop` the row is left out and counted in `num_bad_images`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from rlhfkit.config.configs import DataFlags, LabelFlags
from rlhfkit.config.declare import default_of
from rlhfkit.data.images import RowImages
from rlhfkit.data.io import DataError, Row
from rlhfkit.data.items import TokenizedDataset
from rlhfkit.data.templates import PromptFormat, check_input_template, encode, encode_head
from rlhfkit.types import PromptSample


@dataclass
class PromptDataConfig:
    """Prompt data flags (names match the flag dests)."""

    input_key: str = default_of(DataFlags, "input_key")
    label_key: str | None = default_of(LabelFlags, "label_key")
    input_template: str | None = default_of(DataFlags, "input_template")
    apply_chat_template: bool = default_of(DataFlags, "apply_chat_template")
    tokenizer_chat_template: str | None = default_of(DataFlags, "tokenizer_chat_template")
    max_prompt_len: int | None = None

    def __post_init__(self) -> None:
        check_input_template(self.input_template)
        if self.max_prompt_len is not None and self.max_prompt_len < 1:
            raise DataError(f"--prompt_max_len must be positive, got {self.max_prompt_len}")


class PromptDataset(TokenizedDataset):
    """`PromptSample`s; `samples[i].index == i`."""

    def __init__(self, rows: Sequence[Row], tokenizer: Any, config: PromptDataConfig,
                 images: RowImages | None = None) -> None:
        self.config = config
        self.format = PromptFormat(config.input_template, config.apply_chat_template)
        self.format.note_unused(tokenizer)
        self.images = images
        super().__init__(rows, tokenizer, config.tokenizer_chat_template,
                         "--apply_chat_template" if config.apply_chat_template else None)

    def __getitem__(self, idx: int) -> PromptSample:
        return self.items[idx]

    @property
    def samples(self) -> list[PromptSample]:
        return self.items

    @property
    def num_bad_images(self) -> int:
        """Rows dropped for a bad picture (--image_failure drop)."""
        return 0 if self.images is None else self.images.num_dropped

    @property
    def lengths(self) -> list[int]:
        return [len(encode(self.tokenizer, s.prompt, start=True)) + sum(r.num_tokens - 1 for r in s.images)
                for s in self.items]

    @property
    def drop_reason(self) -> str:
        return f"longer than --prompt_max_len {self.config.max_prompt_len} tokens"

    def encode_row(self, row: Row) -> PromptSample | None:
        cfg = self.config
        value = row.get(cfg.input_key, "--input_key")
        refs = []
        if self.images is not None:
            refs = self.images.read_or_drop(row)
            if refs is None:
                return None
        blank = None if refs else _no_text(value)
        if blank is not None:
            raise row.error(f"key {cfg.input_key!r} (--input_key) is {blank}: a prompt needs text")
        if self.images is not None:
            value = self.images.place(value, len(refs), row, cfg.input_key, cfg.apply_chat_template)
        prompt = self.format.prompt_text(self.tokenizer, value, row, cfg.input_key)
        limit = cfg.max_prompt_len if self.images is None else None  # a picture's runs need every placeholder
        ids = encode_head(self.tokenizer, prompt, limit, start=True)
        if self.images is not None:
            ids, _ = self.images.expand(ids, refs, row)  # checks the template wrote one placeholder each
        length = len(ids)
        if cfg.max_prompt_len is not None and length > cfg.max_prompt_len:
            return None
        label = row.get(cfg.label_key, "--label_key") if cfg.label_key else None
        if cfg.label_key and label is None:
            raise row.error(f"key {cfg.label_key!r} (--label_key) is null; every prompt needs a label "
                            "when --label_key is given")
        source = row.opt("datasource", "default")
        columns = {k: v for k, v in row.data.items() if k != cfg.input_key}
        return PromptSample(prompt=prompt, label=label, datasource=str(source), index=len(self.items), images=refs,
                            input=row.data[cfg.input_key], columns=columns)


def _invisible(text: str) -> bool:
    """No character that shows: only whitespace, zero-width and other format characters (Unicode Cf),
    control characters (the characters `str.isprintable` refuses, but for spaces)."""
    return not any(ch.isprintable() and not ch.isspace() for ch in text)


def _no_text(value: Any) -> str | None:
    """Why a prompt value has no text to prompt with (a string, or a conversation whose messages' text
    contents are all invisible), else None."""
    if isinstance(value, str):
        texts = [value]
    elif isinstance(value, (list, tuple)):
        if not value:
            return "empty"
        texts = [m.get("content") for m in value if isinstance(m, dict)]
        if len(texts) < len(value) or not all(isinstance(t, str) for t in texts):
            return None  # content parts (pictures) or another shape: to_messages judges it
    else:
        return None
    if not any(texts):
        return "empty"
    if all(not t.strip() for t in texts):
        return "only whitespace"
    if all(_invisible(t) for t in texts):
        return "only invisible characters (zero-width spaces, format or control characters)"
    return None


def build_prompt_samples(rows: Sequence[Row], tokenizer: Any, config: PromptDataConfig) -> list[PromptSample]:
    """The prompt dataset's samples as a plain list."""
    return PromptDataset(rows, tokenizer, config).samples
