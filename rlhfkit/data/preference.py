"""Preference datasets: paired (reward model, DPO) and unpaired (KTO).

Paired rows, as OpenRLHF's reward dataset reads them:

* with `--prompt_key`: the prompt column plus `--chosen_key` / `--rejected_key` responses
  (strings, or message lists under `--apply_chat_template`; `--input_template` formats a string
  prompt);
* without it: chosen and rejected are whole texts (empty prompt), or, under
  `--apply_chat_template`, whole conversations whose last message is the assistant answer (the
  earlier messages form the prompt, which gets loss mask 0);
* an optional `margin` column (float, default 0) for the margin loss.

Unpaired rows (KTO): `--input_key` prompt, `--output_key` response and a
boolean `--label_key` (desirable or not). `kto_mismatched` builds the (prompt_i, response_{i+1})
pairs whose log-ratios estimate KTO's reference point z0 = KL(pi || pi_ref).

Both use the joining and truncation rule of `rlhfkit.data.items`; a pair is dropped (and counted)
when either side has no response token left within `--max_len`, and a kept row with a side cut at
`--max_len` (its end token not trained) is counted in `num_cut`.

Vision-language pairs (`images`, a `RowImages`): the row's pictures are placed in the prompt (or,
without `--prompt_key`, in each side's conversation or text) and both sides show them; their
tokens never enter the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from rlhfkit.config.configs import DataFlags
from rlhfkit.config.declare import default_of
from rlhfkit.config.offline_flags import PairKeyFlags
from rlhfkit.data.images import RowImages
from rlhfkit.data.io import DataError, Row
from rlhfkit.data.items import (PreferenceItem, SFTItem, TokenizedDataset, UnpairedItem, encode_prompt_response,
                                join_prompt_response, joined_length)
from rlhfkit.data.templates import (PromptFormat, check_input_template, chat_prompt_response,
                                    to_messages)


PAIRED_MAX_LEN = 512  # --max_len of train_rm and train_dpo (their parsers' default)


@dataclass
class PreferenceDataConfig:
    """Paired preference data flags (names match the flag dests); defaults: the flags' declared ones, --max_len
    train_rm's and train_dpo's."""

    prompt_key: str | None = default_of(PairKeyFlags, "prompt_key")
    chosen_key: str = default_of(PairKeyFlags, "chosen_key")
    rejected_key: str = default_of(PairKeyFlags, "rejected_key")
    input_template: str | None = default_of(DataFlags, "input_template")
    apply_chat_template: bool = default_of(DataFlags, "apply_chat_template")
    tokenizer_chat_template: str | None = default_of(DataFlags, "tokenizer_chat_template")
    max_len: int = PAIRED_MAX_LEN

    def __post_init__(self) -> None:
        check_input_template(self.input_template)
        if self.max_len < 2:
            raise DataError(f"--max_len must be at least 2, got {self.max_len}")


class PreferenceDataset(TokenizedDataset):
    """Chosen/rejected pairs -> `PreferenceItem`."""

    def __init__(self, rows: Sequence[Row], tokenizer: Any, config: PreferenceDataConfig,
                 images: RowImages | None = None) -> None:
        self.config = config
        self.images = images
        self.format = PromptFormat(config.input_template, config.apply_chat_template)
        self.format.note_unused(tokenizer)
        super().__init__(rows, tokenizer, config.tokenizer_chat_template,
                         "--apply_chat_template" if config.apply_chat_template else None)

    @property
    def num_bad_images(self) -> int:
        """Rows dropped for a bad picture (--image_failure drop)."""
        return 0 if self.images is None else self.images.num_dropped

    def _side(self, row: Row, key: str, flag: str, refs: list) -> tuple[str, str]:
        """(prompt text, response text) of one side (its pictures placed, when there are any)."""
        cfg = self.config
        value = row.get(key, flag)
        if cfg.prompt_key:
            prompt = row.get(cfg.prompt_key, "--prompt_key")
            if self.images is not None:
                prompt = self.images.place(prompt, len(refs), row, cfg.prompt_key, cfg.apply_chat_template)
            return self.format.prompt_and_response(self.tokenizer, prompt, value, row, (cfg.prompt_key, key))
        if self.images is not None:
            value = self.images.place(value, len(refs), row, key, cfg.apply_chat_template)
        if not cfg.apply_chat_template:
            if not isinstance(value, str):
                raise row.error(f"key {key!r} ({flag}) must be a string without --apply_chat_template, "
                                f"got {type(value).__name__}")
            return "", value
        msgs = to_messages(value, row, key, role="assistant")
        if msgs[-1]["role"] != "assistant":
            raise row.error(f"key {key!r} ({flag}) must end with an assistant message")
        return chat_prompt_response(self.tokenizer, msgs[:-1], msgs[-1:], row)

    def encode_row(self, row: Row) -> PreferenceItem | None:
        cfg = self.config
        refs = []
        if self.images is not None:
            refs = self.images.read_or_drop(row)
            if refs is None:
                return None
        chosen = self._join(*self._side(row, cfg.chosen_key, "--chosen_key", refs), cfg.max_len, self.images, refs, row)
        rejected = self._join(*self._side(row, cfg.rejected_key, "--rejected_key", refs), cfg.max_len, self.images,
                              refs, row)
        margin = row.opt("margin", 0.0)
        if isinstance(margin, bool) or not isinstance(margin, (int, float)):
            raise row.error(f"key 'margin' must be a number, got {type(margin).__name__}")
        if chosen is None or rejected is None:
            return None
        return PreferenceItem(chosen[0], chosen[1], rejected[0], rejected[1], float(margin), refs)


def preference_rows(items: Sequence[PreferenceItem]) -> list[SFTItem]:
    """The 2B sequences of B pairs for one forward pass: all chosen first, then all rejected."""
    return ([SFTItem(it.chosen_ids, it.chosen_loss_mask, it.images) for it in items]
            + [SFTItem(it.rejected_ids, it.rejected_loss_mask, it.images) for it in items])


# ----------------------------------------------------------------------------- KTO


UNPAIRED_OUTPUT_KEY = "output"  # --output_key of train_kto (its parser's default)
UNPAIRED_LABEL_KEY = "label"  # --label_key of train_kto


@dataclass
class UnpairedDataConfig:
    """Unpaired (KTO) data flags; defaults: the flags' declared ones, --output_key and --label_key train_kto's."""

    input_key: str = default_of(DataFlags, "input_key")
    output_key: str | None = UNPAIRED_OUTPUT_KEY
    label_key: str = UNPAIRED_LABEL_KEY
    input_template: str | None = default_of(DataFlags, "input_template")
    apply_chat_template: bool = default_of(DataFlags, "apply_chat_template")
    tokenizer_chat_template: str | None = default_of(DataFlags, "tokenizer_chat_template")
    max_len: int = default_of(DataFlags, "max_len")

    def __post_init__(self) -> None:
        check_input_template(self.input_template)
        if not self.output_key:
            raise DataError("KTO data needs --output_key (the response column)")
        if self.max_len < 2:
            raise DataError(f"--max_len must be at least 2, got {self.max_len}")


_TRUE = ("true", "1", "yes", "y", "desirable", "good")
_FALSE = ("false", "0", "no", "n", "undesirable", "bad")


def parse_label(value: Any, row: Row, key: str) -> bool:
    """A boolean label: bool, 0/1, or a word like 'true'/'false' (CSV files give strings)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise row.error(f"key {key!r} (--label_key) must be a boolean (true/false or 1/0), got {value!r}")


class UnpairedDataset(TokenizedDataset):
    """Prompt + response + desirable label -> `UnpairedItem`."""

    def __init__(self, rows: Sequence[Row], tokenizer: Any, config: UnpairedDataConfig) -> None:
        self.config = config
        self.format = PromptFormat(config.input_template, config.apply_chat_template)
        self.format.note_unused(tokenizer)
        super().__init__(rows, tokenizer, config.tokenizer_chat_template,
                         "--apply_chat_template" if config.apply_chat_template else None)

    def encode_row(self, row: Row) -> UnpairedItem | None:
        cfg = self.config
        assert cfg.output_key is not None
        label = parse_label(row.get(cfg.label_key, "--label_key"), row, cfg.label_key)
        prompt, response = self.format.prompt_and_response(
            self.tokenizer, row.get(cfg.input_key, "--input_key"), row.get(cfg.output_key, "--output_key"),
            row, (cfg.input_key, cfg.output_key))
        prompt_ids, response_ids = encode_prompt_response(self.tokenizer, prompt, response)
        self._cut = joined_length(prompt_ids, response_ids, self.eos_id) > cfg.max_len
        joined = join_prompt_response(prompt_ids, response_ids, self.eos_id, cfg.max_len)
        if joined is None:
            return None
        return UnpairedItem(joined[0], joined[1], label, prompt_len=len(prompt_ids))


def kto_mismatched(items: Sequence[UnpairedItem], max_len: int) -> list[SFTItem]:
    """Sequences (prompt of item i, response of item i+1 mod B) for KTO's KL reference point."""
    out = []
    n = len(items)
    for i, it in enumerate(items):
        other = items[(i + 1) % n]
        prompt = it.input_ids[: it.prompt_len]
        response = other.input_ids[other.prompt_len:]
        ids = (prompt + response)[:max_len]
        mask = ([0] * len(prompt) + [1] * len(response))[:max_len]
        if mask:
            mask[0] = 0
        out.append(SFTItem(ids, mask))
    return out
