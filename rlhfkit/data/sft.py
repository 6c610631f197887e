"""SFT dataset: rows -> `SFTItem(input_ids, loss_mask)`.

Three modes (OpenRLHF `train_sft` flags):

* prompt/response: `--input_key` (prompt) and `--output_key` (response), formatted with
  `--input_template` or `--apply_chat_template`. With `--apply_chat_template` and no
  `--output_key`, `--input_key` holds a whole conversation whose last (assistant) message is
  the response. Loss on the response and the EOS after it (`rlhfkit.data.items`).
* `--multiturn`: `--input_key` holds a conversation (an `--output_key` value, if given, is
  appended as the final assistant turn); loss on every assistant turn. Spans come from
  rendering growing prefixes of the conversation with the chat template:

      piece before assistant turn i = render(msgs[:i], add_generation_prompt=True) - render(msgs[:i])
      assistant turn i              = render(msgs[:i+1]) - render(msgs[:i], add_generation_prompt=True)

  so the template must render each prefix as a prefix of the longer conversation (templates
  that rewrite earlier turns, e.g. strip old reasoning, are reported as errors).
* `--pretrain_mode`: the raw `--input_key` text (then the `--output_key` text, if given),
  no template, loss on every token that has a predecessor.

Samples longer than `--max_len` are cut: a sample with no response token left is dropped and
counted in `num_dropped`, a kept one whose trained tokens (the end token among them) were cut is counted
in `num_cut`; both are reported once at load. Texts are encoded only as far as the cut can reach
(`templates.encode_head`), so a huge row costs what `--max_len` costs.

Vision-language SFT (`images`, a `RowImages`: `--image_key`, `--max_images_per_prompt`): a row's
pictures get one placeholder each in its prompt or conversation (`<image>` tags or image content
parts), expanded to each picture's token run; those tokens never enter the loss, and a sample whose
runs the cut would break is dropped. Not with `--pretrain_mode`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from rlhfkit.config.configs import DataFlags, OfflineDataFlags, PretrainModeFlags
from rlhfkit.config.declare import default_of
from rlhfkit.config.offline_flags import SFTFlags
from rlhfkit.data.images import RowImages
from rlhfkit.data.io import DataError, Row
from rlhfkit.data.items import SFTItem, TokenizedDataset
from rlhfkit.data.templates import (Message, PromptFormat, bos_prefix, check_input_template,
                                    chat_prompt_response, encode_head, render_chat, to_messages)


@dataclass
class SFTDataConfig:
    """SFT data flags (names match the flag dests, so `from_args(SFTDataConfig, ns)` works); each default is
    its flag's declared one."""

    input_key: str = default_of(DataFlags, "input_key")
    output_key: str | None = default_of(OfflineDataFlags, "output_key")
    input_template: str | None = default_of(DataFlags, "input_template")
    apply_chat_template: bool = default_of(DataFlags, "apply_chat_template")
    tokenizer_chat_template: str | None = default_of(DataFlags, "tokenizer_chat_template")
    multiturn: bool = default_of(SFTFlags, "multiturn")
    pretrain_mode: bool = default_of(PretrainModeFlags, "pretrain_mode")
    max_len: int = default_of(DataFlags, "max_len")

    def __post_init__(self) -> None:
        check_input_template(self.input_template)
        if self.max_len < 2:
            raise DataError(f"--max_len must be at least 2, got {self.max_len}")
        if self.multiturn and self.pretrain_mode:
            raise DataError("--multiturn and --pretrain_mode cannot be combined")
        if not (self.pretrain_mode or self.multiturn or self.output_key or self.apply_chat_template):
            raise DataError("SFT needs --output_key (the response column), or --apply_chat_template with "
                            "conversations in --input_key, or --multiturn, or --pretrain_mode")


class SFTDataset(TokenizedDataset):
    """Tokenized SFT items; `num_dropped` counts samples whose response did not fit `max_len`."""

    def __init__(self, rows: Sequence[Row], tokenizer: Any, config: SFTDataConfig,
                 images: RowImages | None = None) -> None:
        self.config = config
        self.images = images
        if images is not None and config.pretrain_mode:
            raise DataError("--max_images_per_prompt: --pretrain_mode reads no pictures (it has no prompt)")
        self.format = PromptFormat(config.input_template, config.apply_chat_template)
        chat_flag = ("--multiturn" if config.multiturn else
                     "--apply_chat_template" if config.apply_chat_template and not config.pretrain_mode else None)
        if not (config.multiturn or config.pretrain_mode):
            self.format.note_unused(tokenizer)
        super().__init__(rows, tokenizer, config.tokenizer_chat_template, chat_flag)

    def __getitem__(self, idx: int) -> SFTItem:
        return self.items[idx]

    def encode_row(self, row: Row) -> SFTItem | None:
        """One row -> item (None: dropped by truncation)."""
        if self.config.pretrain_mode:
            return self._pretrain(row)
        refs = []
        if self.images is not None:
            refs = self.images.read_or_drop(row)
            if refs is None:
                return None
        if self.config.multiturn:
            return self._multiturn(row, refs)
        return self._prompt_response(row, refs)

    @property
    def num_bad_images(self) -> int:
        """Rows dropped for a bad picture (--image_failure drop)."""
        return 0 if self.images is None else self.images.num_dropped

    @property
    def cut_effect(self) -> str:
        return "the rest of their text not trained" if self.config.pretrain_mode else super().cut_effect

    # ------------------------------------------------------------------ modes

    def _pretrain(self, row: Row) -> SFTItem | None:
        text = row.get_str(self.config.input_key, "--input_key")
        if self.config.output_key:
            text += row.get_str(self.config.output_key, "--output_key")
        ids = encode_head(self.tokenizer, text, self.config.max_len, start=True)
        self._cut = len(ids) > self.config.max_len
        ids = ids[: self.config.max_len]
        if len(ids) < 2:
            return None
        return SFTItem(ids, [0] + [1] * (len(ids) - 1))

    def _prompt_response(self, row: Row, refs: list) -> SFTItem | None:
        cfg = self.config
        value = row.get(cfg.input_key, "--input_key")
        if self.images is not None:
            value = self.images.place(value, len(refs), row, cfg.input_key, cfg.apply_chat_template)
        if cfg.output_key:
            response = row.get(cfg.output_key, "--output_key")
            prompt, answer = self.format.prompt_and_response(
                self.tokenizer, value, response, row, (cfg.input_key, cfg.output_key))
        else:  # a conversation whose last message is the response
            msgs = to_messages(value, row, cfg.input_key)
            if len(msgs) < 2 or msgs[-1]["role"] != "assistant":
                raise row.error(f"key {cfg.input_key!r} must be a conversation ending with an assistant "
                                "message when --output_key is not given")
            prompt, answer = chat_prompt_response(self.tokenizer, msgs[:-1], msgs[-1:], row)
        joined = self._join(prompt, answer, cfg.max_len, self.images, refs, row)
        return None if joined is None else SFTItem(*joined, images=refs)

    def _conversation(self, row: Row, refs: list) -> list[Message]:
        cfg = self.config
        value = row.get(cfg.input_key, "--input_key")
        if self.images is not None:
            value = self.images.place(value, len(refs), row, cfg.input_key, True)
        msgs = to_messages(value, row, cfg.input_key)
        if cfg.output_key:
            extra = row.get(cfg.output_key, "--output_key")
            msgs = msgs + to_messages(extra, row, cfg.output_key, role="assistant")
        return msgs

    def _multiturn(self, row: Row, refs: list) -> SFTItem | None:
        msgs = self._conversation(row, refs)
        pieces = conversation_pieces(self.tokenizer, msgs, row)
        ids: list[int] = []
        mask: list[int] = []
        budget = self.config.max_len if self.images is None else None  # a picture's runs need every placeholder
        for k, (text, trained) in enumerate(pieces):
            if budget is not None and len(ids) > budget:
                break  # the rest is cut away below
            if k == len(pieces) - 1 and trained:
                text = text.rstrip("\n")
            piece = encode_head(self.tokenizer, text, None if budget is None else budget - len(ids))
            if k == len(pieces) - 1 and trained and self.eos_id is not None and piece[-1:] != [self.eos_id]:
                piece.append(self.eos_id)
            ids += piece
            mask += [int(trained)] * len(piece)
        lead = bos_prefix(self.tokenizer, ids)  # the BOS rule (rlhfkit.data.templates)
        ids, mask = lead + ids, [0] * len(lead) + mask
        if self.images is not None:
            ids, mask = self.images.expand(ids, refs, row, mask)
            mask = self.images.mask_out(ids, mask)
        self._cut = any(mask[self.config.max_len:])  # a trained token (the last turn's end token) cut away
        ids, mask = ids[: self.config.max_len], mask[: self.config.max_len]
        if mask:
            mask[0] = 0
        if self.images is not None and not self.images.intact(ids, refs):
            return None
        return SFTItem(ids, mask, refs) if any(mask) else None


def conversation_pieces(tokenizer: Any, msgs: list[Message], row: Row) -> list[tuple[str, bool]]:
    """Split the rendered conversation into (text, is_assistant_turn) pieces, in order."""
    pieces: list[tuple[str, bool]] = []
    prev = ""
    for i, msg in enumerate(msgs):
        full = render_chat(tokenizer, msgs[: i + 1])
        if msg["role"] == "assistant":
            head = render_chat(tokenizer, msgs[:i], add_generation_prompt=True)
            if not head.startswith(prev) or not full.startswith(head):
                raise row.error(f"the chat template does not render message {i} as an extension of the "
                                "earlier messages; --multiturn cannot locate the assistant turns")
            pieces += [(head[len(prev):], False), (full[len(head):], True)]
        else:
            if not full.startswith(prev):
                raise row.error(f"the chat template does not render message {i} as an extension of the "
                                "earlier messages; --multiturn cannot locate the assistant turns")
            pieces.append((full[len(prev):], False))
        prev = full
    if not any(trained for _, trained in pieces):
        raise row.error("--multiturn conversation has no assistant message")
    return [(t, trained) for t, trained in pieces if t]
