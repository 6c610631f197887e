"""Prompt dataset for RL: rows -> `rlhfkit.types.PromptSample`.

Each sample's `prompt` is the final text given to the tokenizer: the `--input_key` value run
through `--apply_chat_template` (a string becomes one user message; a message list is used as
is; the generation prompt is added) or `--input_template`. `label` is the `--label_key` value,
passed untouched to `reward_func` and agents (missing or null is an error naming file and row); `datasource` is the row's `datasource` column
(default "default"), used to split evaluation metrics per source, as in OpenRLHF.

With `max_prompt_len`, prompts longer than that many tokens are dropped and counted.

Vision-language prompts (`images`, a `rlhfkit.data.images.RowImages`: `--image_key`,
`--max_images_per_prompt`): each row's pictures are read and checked, and the prompt gets one
placeholder per picture (`<image>` tags or image content parts, through the chat template); a
prompt's length counts each picture's placeholder tokens. A bad picture is an error naming the row,
or under `--image_failure drop` the row is left out and counted in `num_bad_images`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from rlhfkit.data.images import RowImages
from rlhfkit.data.io import DataError, Row
from rlhfkit.data.items import TokenizedDataset
from rlhfkit.data.templates import PromptFormat, check_input_template, encode
from rlhfkit.types import PromptSample


@dataclass
class PromptDataConfig:
    """Prompt data flags (names match the flag dests)."""

    input_key: str = "input"
    label_key: str | None = None
    input_template: str | None = None
    apply_chat_template: bool = False
    tokenizer_chat_template: str | None = None
    max_prompt_len: int | None = None

    def __post_init__(self) -> None:
        check_input_template(self.input_template)
        if self.max_prompt_len is not None and self.max_prompt_len < 1:
            raise DataError(f"--prompt_max_len must be positive, got {self.max_prompt_len}")


class PromptDataset(TokenizedDataset):
    """`PromptSample`s; `samples[i].index == i`."""

    def __init__(self, rows: Sequence[Row], tokenizer: Any, config: PromptDataConfig,
                 images: RowImages | None = None, image_token_id: int | None = None) -> None:
        self.config = config
        self.format = PromptFormat(config.input_template, config.apply_chat_template)
        self.images, self.image_token_id = images, image_token_id
        self.num_bad_images = 0  # rows dropped for a bad picture (--image_failure drop)
        super().__init__(rows, tokenizer, config.tokenizer_chat_template,
                         "--apply_chat_template" if config.apply_chat_template else None)

    def __getitem__(self, idx: int) -> PromptSample:
        return self.items[idx]

    @property
    def samples(self) -> list[PromptSample]:
        return self.items

    @property
    def lengths(self) -> list[int]:
        return [len(encode(self.tokenizer, s.prompt)) for s in self.items]

    def encode_row(self, row: Row) -> PromptSample | None:
        cfg = self.config
        value = row.get(cfg.input_key, "--input_key")
        refs = []
        if self.images is not None:
            try:
                refs = self.images.read(row)
            except DataError:
                if self.images.cfg.image_failure != "drop":
                    raise
                self.num_bad_images += 1
                return None
            value = self.images.place(value, len(refs), row, cfg.input_key, cfg.apply_chat_template)
        prompt = self.format.prompt_text(self.tokenizer, value, row, cfg.input_key)
        ids = encode(self.tokenizer, prompt)
        if self.images is not None:
            found = ids.count(self.image_token_id)
            if found != len(refs):
                how = "the chat template" if cfg.apply_chat_template else "the prompt"
                raise row.error(f"{how} wrote {found} image placeholder token(s) for {len(refs)} picture(s)")
        length = len(ids) + sum(r.num_tokens - 1 for r in refs)
        if cfg.max_prompt_len is not None and length > cfg.max_prompt_len:
            return None
        label = row.get(cfg.label_key, "--label_key") if cfg.label_key else None
        if cfg.label_key and label is None:
            raise row.error(f"key {cfg.label_key!r} (--label_key) is null; every prompt needs a label "
                            "when --label_key is given")
        source = row.opt("datasource", "default")
        return PromptSample(prompt=prompt, label=label, datasource=str(source), index=len(self.items), images=refs)


def build_prompt_samples(rows: Sequence[Row], tokenizer: Any, config: PromptDataConfig) -> list[PromptSample]:
    """The prompt dataset's samples as a plain list."""
    return PromptDataset(rows, tokenizer, config).samples
