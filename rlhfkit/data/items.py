"""Tokenized dataset items and the prompt + response joining rule they share.

Items hold plain lists; `rlhfkit.data.collate` turns them into tensors. A `loss_mask[t] = 1`
marks token `t` as trained on, i.e. its log-prob `log p(ids[t] | ids[:t])` enters the loss
(docs/architecture.md); `loss_mask[0]` is therefore always 0, since token 0 is not predicted.

Joining rule (SFT, DPO/RM, KTO; `encode_prompt_response`, `join_prompt_response`):

    prompt_ids   = encode(prompt, start=True)          (the BOS rule: the tokenizer's BOS, once)
    response_ids = encode(response with trailing newlines stripped)
    ids       = prompt_ids + response_ids + [eos]      (eos only if the response does not end with it)
    loss_mask = [0] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids))
    ids, loss_mask cut to max_len; None when no response token survives.

A kept row that the cut shortened (its end token, the EOS after the response, is then not trained) is
counted in `TokenizedDataset.num_cut` and reported once at load (`check_cut`), as rows left out are
(`check_dropped`).

Prompt and response are encoded separately and the ids concatenated, so the mask boundary is
exact (OpenRLHF encodes the joined text and uses the prompt's token count, which can be off by
one when a merge crosses the boundary) and the ids are what an RL rollout would produce.
Unlike OpenRLHF, a truncated response does not get its last token overwritten with EOS: a cut
response is trained as a cut response, not taught to stop mid-sentence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from torch.utils.data import Dataset

from rlhfkit.data.io import DataError, Row
from rlhfkit.types import ImageRef
from rlhfkit.data.templates import encode, encode_head, require_chat_template, set_chat_template


@dataclass
class SFTItem:
    """One SFT sample: `input_ids [L]`, `loss_mask [L]`; `images`: its pictures (a VLM's, one
    placeholder run each in `input_ids`), processed when a batch is collated."""

    input_ids: list[int]
    loss_mask: list[int]
    images: list[ImageRef] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class PreferenceItem:
    """One preference pair (reward model, DPO): chosen and rejected sequences, optional margin."""

    chosen_ids: list[int]
    chosen_loss_mask: list[int]
    rejected_ids: list[int]
    rejected_loss_mask: list[int]
    margin: float = 0.0
    images: list[ImageRef] = field(default_factory=list)  # the prompt's pictures (both sides show them)

    def __len__(self) -> int:
        return len(self.chosen_ids) + len(self.rejected_ids)


@dataclass
class UnpairedItem:
    """One KTO sample: a prompt + response sequence and whether the response is desirable.

    `prompt_len` splits `input_ids` into prompt and response, so mismatched pairs for KTO's KL
    estimate can be built (`rlhfkit.data.preference.kto_mismatched`).
    """

    input_ids: list[int]
    loss_mask: list[int]
    label: bool
    prompt_len: int

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class PRMItem:
    """One process-reward sample: `input_ids [L]` and `labels [L]`, -100 except at step ends.

    Hard labels are token ids of the `--reward_tokens`; soft labels are floats (`soft=True`).
    """

    input_ids: list[int]
    labels: list[float] | list[int]
    soft: bool = False

    def __len__(self) -> int:
        return len(self.input_ids)


def encode_prompt_response(tokenizer: Any, prompt: str, response: str, max_len: int | None = None
                           ) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids) by the joining rule above: the prompt starts the sequence (the BOS rule,
    `rlhfkit.data.templates`), the response's trailing newlines are stripped. With `max_len` (the cut the
    ids are for) a huge text is encoded only as far as the cut can reach (`templates.encode_head`): the
    joined ids cut to `max_len` are the same, and a response after a prompt that fills the cut is not
    encoded at all."""
    prompt_ids = encode_head(tokenizer, prompt, max_len, start=True)
    if max_len is None:
        return prompt_ids, encode(tokenizer, response.rstrip("\n"))
    room = max_len - len(prompt_ids)
    return prompt_ids, (encode_head(tokenizer, response.rstrip("\n"), room) if room > 0 else [])


def joined_length(prompt_ids: list[int], response_ids: list[int], eos_id: int | None) -> int:
    """The length of prompt + response + EOS by the joining rule, before the cut to max_len."""
    eos = eos_id is not None and (not response_ids or response_ids[-1] != eos_id)
    return len(prompt_ids) + len(response_ids) + int(eos)


def join_prompt_response(prompt_ids: list[int], response_ids: list[int], eos_id: int | None,
                         max_len: int) -> tuple[list[int], list[int]] | None:
    """`(ids, loss_mask)` by the joining rule above, or None when the response is cut away."""
    response_ids = list(response_ids)
    if eos_id is not None and (not response_ids or response_ids[-1] != eos_id):
        response_ids.append(eos_id)
    ids = (list(prompt_ids) + response_ids)[:max_len]
    mask = ([0] * len(prompt_ids) + [1] * len(response_ids))[:max_len]
    if mask:
        mask[0] = 0
    if not any(mask):
        return None
    return ids, mask


class TokenizedDataset(Dataset):
    """Items built once from rows by `encode_row` (None drops a row, counted in `num_dropped`; the
    first dropped row is `first_dropped`, the reason `drop_reason`). A kept row that `encode_row` cut at
    --max_len (it sets `self._cut`) is counted in `num_cut`, the first one is `first_cut`, and what the
    cut costs the training is `cut_effect`.

    `chat_flag` names the flag that needs the tokenizer's chat template (None: not needed);
    `chat_template` (`--tokenizer_chat_template`) replaces the tokenizer's template first.
    """

    def __init__(self, rows: Sequence[Row], tokenizer: Any, chat_template: str | None,
                 chat_flag: str | None) -> None:
        self.tokenizer = tokenizer
        set_chat_template(tokenizer, chat_template)
        if chat_flag:
            require_chat_template(tokenizer, chat_flag)
        self.eos_id: int | None = tokenizer.eos_token_id
        self.items: list[Any] = []
        self.num_dropped = 0
        self.first_dropped: Row | None = None
        self.num_cut = 0
        self.first_cut: Row | None = None
        for row in rows:
            self._cut = False
            item = self.encode_row(row)
            if item is None:
                self.num_dropped += 1
                self.first_dropped = self.first_dropped or row
            else:
                self.items.append(item)
                if self._cut:
                    self.num_cut += 1
                    self.first_cut = self.first_cut or row

    @property
    def drop_reason(self) -> str:
        """Why `encode_row` leaves a row out (for the load report)."""
        max_len = getattr(getattr(self, "config", None), "max_len", None)
        return f"no token to train on within --max_len {max_len}" if max_len else "no token to train on"

    @property
    def cut_effect(self) -> str:
        """What a row cut at --max_len loses (for the load report)."""
        return "their end token not trained"

    def encode_row(self, row: Row) -> Any:
        """One row -> one item, or None to drop it; sets `self._cut` when it cut the row at --max_len."""
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, idx: int) -> Any:
        return self.items[idx]

    @property
    def lengths(self) -> list[int]:
        """Token count of each item (for token-budget batching)."""
        return [len(it) for it in self.items]

    def _join(self, prompt: str, response: str, max_len: int, images: Any = None, refs: Sequence[ImageRef] = (),
              row: Row | None = None) -> tuple[list[int], list[int]] | None:
        """Encode prompt and response (trailing newlines stripped) and join them. With `images` (a
        `RowImages`) the pictures' placeholders expand to their runs, those tokens stay out of the
        loss, and a sample whose runs the cut would break is dropped (None)."""
        if images is None:
            prompt_ids, response_ids = encode_prompt_response(self.tokenizer, prompt, response, max_len)
            self._cut |= joined_length(prompt_ids, response_ids, self.eos_id) > max_len
            return join_prompt_response(prompt_ids, response_ids, self.eos_id, max_len)
        prompt_ids, response_ids = encode_prompt_response(self.tokenizer, prompt, response)
        images.expand(prompt_ids + response_ids, refs, row)  # one placeholder per picture, or an error
        k = prompt_ids.count(images.image_token_id)
        prompt_ids, _ = images.expand(prompt_ids, refs[:k], row)
        response_ids, _ = images.expand(response_ids, refs[k:], row)
        self._cut |= joined_length(prompt_ids, response_ids, self.eos_id) > max_len
        joined = join_prompt_response(prompt_ids, response_ids, self.eos_id, max_len)
        if joined is None or not images.intact(joined[0], refs):
            return None
        return joined[0], images.mask_out(joined[0], joined[1])


def check_dropped(ds: TokenizedDataset, rows_read: int, what: str, training: bool = True) -> str | None:
    """The load report of a tokenized dataset: one line counting and naming the rows it left out
    (None when none was), e.g.

        --dataset data.jsonl: 104 of 200 rows left out: longer than --prompt_max_len 9 tokens (the first: data.jsonl row 3)

    For training data (`training`), keeping fewer than half the rows, or none, is a DataError with that reason."""
    if not ds.num_dropped:
        return None
    first = f" (the first: {ds.first_dropped.where})" if ds.first_dropped is not None else ""
    line = f"{what}: {ds.num_dropped} of {rows_read} rows left out: {ds.drop_reason}{first}"
    kept = len(ds.items)
    if not kept or (training and 2 * kept < rows_read):
        raise DataError(f"{line}; {'no row is' if not kept else f'only {kept} rows are'} left to train on "
                        "(lengthen the limit or shorten the data)")
    return line


def check_cut(ds: TokenizedDataset, rows_read: int, what: str) -> str | None:
    """The load report of the rows a tokenized dataset kept but cut at --max_len: one line (None when no
    row was cut), e.g.

        --dataset data.jsonl: 3 of 200 rows cut at --max_len 64; their end token not trained (the first: data.jsonl row 7)
    """
    if not getattr(ds, "num_cut", 0):
        return None
    max_len = getattr(getattr(ds, "config", None), "max_len", None)
    first = f" (the first: {ds.first_cut.where})" if ds.first_cut is not None else ""
    return f"{what}: {ds.num_cut} of {rows_read} rows cut at --max_len {max_len}; {ds.cut_effect}{first}"
