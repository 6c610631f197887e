"""Reward-model scoring of (input, output) rows outside training (batch_inference --eval_task rm): rows are
formatted and joined as train_rm's data (so a reward model scores text as it was trained on it), then the
value head at the last token, micro-batches of right-padded rows, shortest first."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from rlhfkit.config.configs import DataFlags
from rlhfkit.config.declare import default_of, flag
from rlhfkit.config.errors import UsageError
from rlhfkit.data.io import Row
from rlhfkit.data.post_processors import ScoredSample


def progress_bar(total: int, desc: str, disable: bool) -> Any:
    """A bar on stderr, only on a terminal (a log file gets no carriage returns)."""
    from tqdm.auto import tqdm

    from rlhfkit.trainers.metrics import terminal

    return tqdm(total=total, desc=desc, disable=disable or not terminal(), file=sys.stderr)


@dataclass
class ScoreFlags:
    """batch_inference's own scoring flag (rlhfkit.config.declare)."""

    micro_batch_size: int = flag(16, help="rows per reward-model forward")


SCORE_OUTPUT_KEY = "output"  # the response column batch_inference scores when --output_key is not given


@dataclass
class ScoreConfig:
    """How rows become reward-model inputs (names match the flags)."""

    input_key: str = default_of(DataFlags, "input_key")
    output_key: str = SCORE_OUTPUT_KEY
    input_template: str | None = default_of(DataFlags, "input_template")
    apply_chat_template: bool = default_of(DataFlags, "apply_chat_template")
    max_len: int = default_of(DataFlags, "max_len")
    micro_batch_size: int = default_of(ScoreFlags, "micro_batch_size")
    # --output_key not given and --apply_chat_template: a row without the output key is scored as the
    # conversation in --input_key, its last (assistant) message the output (OpenRLHF's SFTDataset rule)
    conversation_rows: bool = False

    def __post_init__(self) -> None:
        if self.max_len < 2 or self.micro_batch_size < 1:
            raise UsageError(f"--max_len must be >= 2 and --micro_batch_size >= 1, got {self.max_len} "
                             f"and {self.micro_batch_size}")


def score_items(tokenizer: Any, rows: Sequence[Row], cfg: ScoreConfig) -> tuple[list[Any], list[ScoredSample], int]:
    """(SFTItems to score, the rows' (input, output) texts, number cut at --max_len).

    Formatting and joining follow train_rm's data (PromptFormat, join_prompt_response).
    """
    from rlhfkit.data.items import SFTItem, encode_prompt_response, join_prompt_response
    from rlhfkit.data.templates import PromptFormat

    fmt = PromptFormat(cfg.input_template, cfg.apply_chat_template)
    fmt.note_unused(tokenizer)
    items, texts, cut = [], [], 0
    for row in rows:
        value_in = row.get(cfg.input_key, "--input_key")
        if cfg.conversation_rows and cfg.output_key not in row.data:
            prompt, response = _conversation_prompt_response(tokenizer, value_in, row, cfg)
            value_out = response
        else:
            value_out = row.get(cfg.output_key, "--output_key")
            prompt, response = fmt.prompt_and_response(tokenizer, value_in, value_out, row,
                                                       (cfg.input_key, cfg.output_key))
        p_ids, r_ids = encode_prompt_response(tokenizer, prompt, response)
        joined = join_prompt_response(p_ids, r_ids, tokenizer.eos_token_id, cfg.max_len)
        if joined is None:
            raise row.error(f"the input alone has {len(p_ids)} tokens, filling --max_len {cfg.max_len}: "
                            "nothing of the output is left to score")
        cut += len(p_ids) + len(r_ids) + 1 > cfg.max_len
        items.append(SFTItem(*joined))
        texts.append(ScoredSample(value_in if isinstance(value_in, str) else prompt,
                                  value_out if isinstance(value_out, str) else response, 0.0, row.where))
    return items, texts, cut


def _conversation_prompt_response(tokenizer: Any, value: Any, row: Row, cfg: ScoreConfig) -> tuple[str, str]:
    """(prompt, response) texts of a conversation whose last message is the assistant's answer."""
    from rlhfkit.data.templates import chat_prompt_response, to_messages

    msgs = to_messages(value, row, cfg.input_key)
    if len(msgs) < 2 or msgs[-1]["role"] != "assistant":
        raise row.error(f"no key {cfg.output_key!r} (--output_key), and key {cfg.input_key!r} is not a "
                        "conversation ending with an assistant message")
    return chat_prompt_response(tokenizer, msgs[:-1], msgs[-1:], row)


@torch.no_grad()
def reward_scores(model: Any, items: Sequence[Any], pad_id: int, micro_batch_size: int, device: str,
                  show_progress: bool = True) -> list[float]:
    """Value at the last token of each item, micro-batches of right-padded rows, shortest first."""
    from rlhfkit.data.collate import pad_batch
    from rlhfkit.models.value import reward_at_last_token

    order = sorted(range(len(items)), key=lambda i: len(items[i]))
    scores = [0.0] * len(items)
    bar = progress_bar(len(items), "rm", not show_progress)
    for start in range(0, len(order), micro_batch_size):
        idx = order[start:start + micro_batch_size]
        batch = pad_batch([items[i] for i in idx], pad_id)
        mask = batch.attention_mask.to(device)
        values = model(input_ids=batch.input_ids.to(device), attention_mask=mask)
        for i, r in zip(idx, reward_at_last_token(values, mask).float().cpu().tolist()):
            scores[i] = r
        bar.update(len(idx))
    bar.close()
    return scores
