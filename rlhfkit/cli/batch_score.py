"""The reward-model task of batch_inference (`--eval_task rm`): rows -> train_rm's formatting ->
reward model -> rewards, optionally post-processed (rs | iter_dpo | csft). The module docstring of
rlhfkit.cli.batch_inference describes the flags and rules."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from rlhfkit.cli.common import UsageError
from rlhfkit.config.dtypes import run_dtype
from rlhfkit.data.io import DataError, Row, load_mixture
from rlhfkit.data.post_processors import (ScoredSample, apply_post_processor, check_reward_template,
                                          resolve_post_processor)

log = logging.getLogger(__name__)

PROG = "batch_inference"


def progress_bar(total: int, desc: str, disable: bool) -> Any:
    """A bar on stderr, only on a terminal (a log file gets no carriage returns)."""
    from tqdm.auto import tqdm

    from rlhfkit.trainers.metrics import terminal

    return tqdm(total=total, desc=desc, disable=disable or not terminal(), file=sys.stderr)


def resolve_device(args: argparse.Namespace) -> str:
    from rlhfkit.parallel.dist import resolve_device as resolve

    return resolve(args.device)


# ----------------------------------------------------------------------------- reward scoring


@dataclass
class ScoreConfig:
    """How rows become reward-model inputs (names match the flags)."""

    input_key: str = "input"
    output_key: str = "output"
    input_template: str | None = None
    apply_chat_template: bool = False
    max_len: int = 2048
    micro_batch_size: int = 16
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


def load_reward_model(args: argparse.Namespace, device: str) -> Any:
    from rlhfkit.config.configs import ModelConfig
    from rlhfkit.models.value import load_value_model

    dtype = run_dtype(args.param_dtype, device)
    mcfg = ModelConfig(param_dtype=args.param_dtype, attn_implementation=args.attn_implementation,
                       load_in_4bit=args.load_in_4bit, lora_rank=0, experts_implementation=args.experts_implementation)
    return load_value_model(args.pretrain, value_head_prefix=args.value_head_prefix, dtype=dtype,
                            normalize_reward=args.normalize_reward, device=device, cfg=mcfg,
                            flag="--pretrain").eval()


def run_rm(args: argparse.Namespace) -> list[dict[str, Any]]:
    from rlhfkit.models.loader import load_tokenizer

    processor = resolve_post_processor(args.post_processor)
    if processor == "csft":
        check_reward_template(args.reward_template)
    cfg = ScoreConfig(args.input_key, args.output_key or "output", args.input_template, args.apply_chat_template,
                      args.max_len, args.micro_batch_size,
                      conversation_rows=args.apply_chat_template and args.output_key is None)
    tokenizer = load_tokenizer(args.pretrain, padding_side="right", chat_template=args.tokenizer_chat_template,
                               use_fast=not args.disable_fast_tokenizer)
    rows = load_mixture(args.dataset, args.dataset_probs, split=args.dataset_split,
                        max_samples=args.max_samples, seed=args.seed, max_row_bytes=args.max_row_bytes)
    if not rows:
        raise DataError(f"--dataset {args.dataset}: no rows to score")
    items, texts, cut = score_items(tokenizer, rows, cfg)
    if cut:
        log.info(f"note: {cut} of {len(items)} rows longer than --max_len {cfg.max_len} were scored on their "
                 "first --max_len tokens")
    device = resolve_device(args)
    model = load_reward_model(args, device)
    rewards = reward_scores(model, items, tokenizer.pad_token_id, cfg.micro_batch_size, device,
                            not args.disable_progress)
    r = torch.tensor(rewards, dtype=torch.float64)
    std = r.std().item() if len(rewards) > 1 else 0.0
    log.info(f"{PROG}: {len(rewards)} rows scored, reward mean {r.mean().item():.4f} std {std:.4f}")
    if processor is None:
        return [{**row.data, "reward": rew} for row, rew in zip(rows, rewards)]
    samples = [ScoredSample(t.input, t.output, rew, t.where) for t, rew in zip(texts, rewards)]
    out, summary = apply_post_processor(processor, samples, args.reward_template)
    log.info(f"{PROG}: {summary}")
    return out
