"""The reward model behind the server: `ServeConfig` (the settings `rlhfkit.cli.serve_rm` reads from its
flags) and `RewardScorer` (tokenizer + reward model; one padded forward per micro-batch, called from the
batcher's worker thread; an empty or too long query is `Rejected`, not truncated)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from rlhfkit.config.configs import BackendFlags, DataFlags, ModelConfig, ModelFlags, RewardModelFlags, ValueHeadFlags
from rlhfkit.config.declare import default_of
from rlhfkit.serving.batcher import Rejected
from rlhfkit.serving.flags import ServerFlags
from rlhfkit.serving.request import (RequestLimits)

logger = logging.getLogger("rlhfkit.serve_rm")


@dataclass
class ServeConfig:
    """What the server takes of serve_rm's flags; each default is its flag's declared one."""

    reward_pretrain: str
    max_len: int = default_of(DataFlags, "max_len")
    batch_size: int = default_of(ServerFlags, "batch_size")
    batch_wait_ms: float = default_of(ServerFlags, "batch_wait_ms")
    normalize_reward: bool = default_of(RewardModelFlags, "normalize_reward")
    value_head_prefix: str = default_of(ValueHeadFlags, "value_head_prefix")
    param_dtype: str = default_of(ModelFlags, "param_dtype")
    attn_implementation: str = default_of(ModelFlags, "attn_implementation")
    load_in_4bit: bool = default_of(ModelFlags, "load_in_4bit")
    disable_fast_tokenizer: bool = default_of(ModelFlags, "disable_fast_tokenizer")
    device: str | None = default_of(BackendFlags, "device")
    experts_implementation: str | None = default_of(ModelFlags, "experts_implementation")
    max_body_mb: float = default_of(ServerFlags, "max_body_mb")
    max_queries: int = default_of(ServerFlags, "max_queries")
    # 0: from --max_len and the vocabulary (RewardScorer.longest_token_chars)
    max_query_chars: int = default_of(ServerFlags, "max_query_chars")
    max_json_depth: int = default_of(ServerFlags, "max_json_depth")
    read_timeout_s: float = default_of(ServerFlags, "read_timeout_s")

    def __post_init__(self) -> None:
        for name in ("max_len", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_wait_ms < 0 or self.max_body_mb <= 0:
            raise ValueError("--batch_wait_ms must be >= 0 and --max_body_mb > 0")
        if self.max_query_chars < 0:
            raise ValueError(f"--max_query_chars must be >= 0 (0: automatic), got {self.max_query_chars}")
        self.limits(1)  # the other limits' checks

    def limits(self, longest_token_chars: int) -> RequestLimits:
        chars = self.max_query_chars or self.max_len * max(1, longest_token_chars)
        return RequestLimits(max_body_bytes=int(self.max_body_mb * 1024 * 1024), max_queries=self.max_queries,
                             max_query_chars=chars, max_json_depth=self.max_json_depth,
                             read_timeout_s=self.read_timeout_s)


class RewardScorer:
    """Tokenizer + reward model; `score` runs one padded forward (called from one worker thread)."""

    def __init__(self, cfg: ServeConfig) -> None:
        from rlhfkit.models.loader import load_tokenizer
        from rlhfkit.models.value import load_value_model, reward_settings

        self.cfg = cfg
        self.device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = load_tokenizer(cfg.reward_pretrain, padding_side="right",
                                        use_fast=not cfg.disable_fast_tokenizer, flag="--reward_pretrain")
        mcfg = ModelConfig(param_dtype=cfg.param_dtype, attn_implementation=cfg.attn_implementation,
                           load_in_4bit=cfg.load_in_4bit, lora_rank=0,
                           experts_implementation=cfg.experts_implementation)
        # Loaded un-normalised: the raw score goes to extra_logs, the normalised one to rewards.
        self.model = load_value_model(cfg.reward_pretrain, value_head_prefix=cfg.value_head_prefix,
                                      dtype=cfg.param_dtype, device=self.device, cfg=mcfg,
                                      flag="--reward_pretrain").eval()
        if cfg.load_in_4bit:  # bitsandbytes placed it already; make sure we feed the same device
            self.device = next(self.model.parameters()).device
        mc = self.model.config
        self.mean, self.std = float(mc.mean), float(mc.std)
        if cfg.normalize_reward:
            stored = reward_settings(cfg.reward_pretrain)
            if stored.get("mean") is None or stored.get("std") is None:
                logger.warning("--normalize_reward: %s/config.json stores no reward mean/std; rewards are "
                               "(r - 0) / 1", cfg.reward_pretrain)
            if not self.std > 0:
                raise ValueError(f"--normalize_reward: std={self.std} in {cfg.reward_pretrain}/config.json")
        self.pad_id = self.tokenizer.pad_token_id

    def longest_token_chars(self) -> int:
        """Characters of the longest vocabulary entry (byte-level entries count bytes, an upper bound)."""
        vocab = list(self.tokenizer.get_vocab()) + list(getattr(self.tokenizer, "all_special_tokens", []))
        return max((len(t) for t in vocab), default=1)

    def score_texts(self, texts: list[str]) -> list[float | Rejected]:
        """Tokenise one micro-batch (no special tokens added: queries are decoded with them; but a query
        without the BOS the tokenizer adds gets it, as in training: the BOS rule of rlhfkit.data.templates)
        and score it; an empty or too long text is `Rejected` instead (the worker thread of FairBatcher)."""
        from rlhfkit.data.templates import bos_prefix

        ids = [bos_prefix(self.tokenizer, row) + list(row) if row else []
               for row in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
        out: list[float | Rejected] = [0.0] * len(texts)
        rows, where = [], []
        for k, row in enumerate(ids):
            if not row:
                out[k] = Rejected("is empty (no tokens to score)")
            elif len(row) > self.cfg.max_len:
                out[k] = Rejected(f"has {len(row)} tokens, more than --max_len {self.cfg.max_len}")
            else:
                rows.append(row)
                where.append(k)
        if rows:
            for k, score in zip(where, self.score(rows)):
                out[k] = score
        return out

    @torch.inference_mode()
    def score(self, batch: list[list[int]]) -> list[float]:
        """Raw scores (value at the last token) of right-padded sequences."""
        from rlhfkit.models.value import reward_at_last_token

        width = max(len(r) for r in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, row in enumerate(batch):
            ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, :len(row)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        values = self.model(input_ids=ids, attention_mask=mask)
        return reward_at_last_token(values, mask).float().cpu().tolist()

    def normalise(self, raw: list[float]) -> list[float]:
        if not self.cfg.normalize_reward:
            return list(raw)
        return [(r - self.mean) / self.std for r in raw]
