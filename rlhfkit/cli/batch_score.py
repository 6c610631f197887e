"""The reward-model task of batch_inference (`--eval_task rm`): rows -> train_rm's formatting ->
reward model -> rewards, optionally post-processed (rs | iter_dpo | csft). The module docstring of
rlhfkit.cli.batch_inference describes the flags and rules."""

from __future__ import annotations

import argparse
import logging
from typing import Any

import torch

from rlhfkit.config.dtypes import run_dtype
from rlhfkit.data.io import DataError, load_mixture
from rlhfkit.data.post_processors import (ScoredSample, apply_post_processor, check_reward_template,
                                          resolve_post_processor)
from rlhfkit.inference.score import SCORE_OUTPUT_KEY, ScoreConfig, reward_scores, score_items

log = logging.getLogger(__name__)

PROG = "batch_inference"


def resolve_device(args: argparse.Namespace) -> str:
    from rlhfkit.parallel.dist import resolve_device as resolve

    return resolve(args.device)


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
    cfg = ScoreConfig(args.input_key, args.output_key or SCORE_OUTPUT_KEY, args.input_template,
                      args.apply_chat_template, args.max_len, args.micro_batch_size,
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
