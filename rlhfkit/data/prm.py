"""Process-reward (PRM) dataset: step-annotated text -> ids + per-position labels.

A row holds a solution text with `--placeholder_token` at the end of each step (Math-Shepherd
uses "ки") under `--input_key`, and one label per step under `--label_key`: strings from
`--reward_tokens` (e.g. "+" / "-": hard labels, stored as those tokens' ids) or numbers (soft
labels, e.g. the probability that the step is correct). Following OpenRLHF's process reward
dataset (Math-Shepherd format), the label of a step sits at the placeholder's
position:

    labels[t] = label of step k   if ids[t] is the k-th placeholder
    labels[t] = -100              elsewhere

i.e. `labels[t]` is the target of the model output *at* position t (the PRM loss reads the
logits there, restricted to the reward tokens). Text beyond `--max_len` is cut, and the labels
of cut steps go with it (a row with no step left is dropped; a kept row that lost a labelled step
is counted in `num_cut` and reported at load). The number of placeholders must equal the number of labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from rlhfkit.config.configs import DataFlags
from rlhfkit.config.declare import default_of
from rlhfkit.config.offline_flags import PRMFlags
from rlhfkit.data.collate import PaddedBatch, pad_batch, pad_sequences
from rlhfkit.data.io import DataError, Row
from rlhfkit.data.items import PRMItem, SFTItem, TokenizedDataset
from rlhfkit.data.templates import encode, token_id

IGNORE_INDEX = -100


PRM_LABEL_KEY = "value"  # --label_key of train_prm (its parser's default)


@dataclass
class PRMDataConfig:
    """PRM data flags (names match the flag dests); defaults: the flags' declared ones, --label_key train_prm's."""

    input_key: str = default_of(DataFlags, "input_key")
    label_key: str = PRM_LABEL_KEY
    placeholder_token: str | None = default_of(PRMFlags, "placeholder_token")
    reward_tokens: list[str] | None = default_of(PRMFlags, "reward_tokens")
    max_len: int = default_of(DataFlags, "max_len")

    def __post_init__(self) -> None:
        if not self.placeholder_token:
            raise DataError("PRM data needs --placeholder_token (the step separator, e.g. 'ки')")
        if self.max_len < 1:
            raise DataError(f"--max_len must be positive, got {self.max_len}")


class PRMDataset(TokenizedDataset):
    """Rows -> `PRMItem(input_ids, labels, soft)`."""

    def __init__(self, rows: Sequence[Row], tokenizer: Any, config: PRMDataConfig) -> None:
        self.config = config
        assert config.placeholder_token is not None
        self.placeholder_id = token_id(tokenizer, config.placeholder_token, "--placeholder_token")
        self.reward_ids = {t: token_id(tokenizer, t, "--reward_tokens") for t in (config.reward_tokens or [])}
        super().__init__(rows, tokenizer, None, None)

    def __getitem__(self, idx: int) -> PRMItem:
        return self.items[idx]

    @property
    def cut_effect(self) -> str:
        return "the labels of their steps after the cut not trained"

    def _label_values(self, row: Row) -> tuple[list[Any], bool]:
        """Hard labels as token ids, or soft labels as floats; and whether they are soft."""
        key = self.config.label_key
        values = row.get(key, "--label_key")
        if not isinstance(values, list):
            raise row.error(f"key {key!r} (--label_key) must be a list with one label per step, "
                            f"got {type(values).__name__}")
        if all(isinstance(v, str) for v in values):
            return [self._hard_label(row, v) for v in values], False
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            return [float(v) for v in values], True
        raise row.error(f"key {key!r} (--label_key) must hold only strings (reward tokens) or only numbers")

    def _hard_label(self, row: Row, value: str) -> int:
        if self.reward_ids:
            if value not in self.reward_ids:
                raise row.error(f"label {value!r} is not one of --reward_tokens {list(self.reward_ids)}")
            return self.reward_ids[value]
        return token_id(self.tokenizer, value, f"{row.where}: label")

    def encode_row(self, row: Row) -> PRMItem | None:
        cfg = self.config
        ids = encode(self.tokenizer, row.get_str(cfg.input_key, "--input_key"), start=True)
        values, soft = self._label_values(row)
        steps = [t for t, tok in enumerate(ids) if tok == self.placeholder_id]
        if len(steps) != len(values):
            raise row.error(f"{len(steps)} placeholder tokens {cfg.placeholder_token!r} (--placeholder_token) "
                            f"but {len(values)} labels (--label_key)")
        self._cut = any(t >= cfg.max_len for t in steps)  # a labelled step cut away
        ids = ids[: cfg.max_len]
        labels: list[Any] = [IGNORE_INDEX] * len(ids)
        for t, value in zip(steps, values):
            if t < len(ids):
                labels[t] = value
        if not ids or all(v == IGNORE_INDEX for v in labels):
            return None
        return PRMItem(ids, labels, soft)


def collate_prm(items: Sequence[PRMItem], pad_id: int) -> tuple[PaddedBatch, torch.Tensor]:
    """PRM items -> (`PaddedBatch` whose loss_mask marks labelled positions, labels `[B, L]`).

    Labels are long token ids (hard) or float (soft), padded with -100.
    """
    soft = any(it.soft for it in items)
    batch = pad_batch([SFTItem(it.input_ids, [int(v != IGNORE_INDEX) for v in it.labels]) for it in items], pad_id)
    labels = pad_sequences([it.labels for it in items], IGNORE_INDEX, dtype=torch.float32 if soft else torch.long)
    return batch, labels
