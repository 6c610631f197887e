"""Best-of-n generation of prompt rows outside training (batch_inference --eval_task generate): the prompts
of an --iter slice, encoded with the BOS the tokenizer adds (once) and cut from the front to fit, sampled
with a seed per prompt (the same samples whatever slice or batch a prompt is in), written atomically."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Sequence

from rlhfkit.config.configs import ChatSamplingFlags, DataFlags, SamplingFlags
from rlhfkit.config.declare import default_of, flag
from rlhfkit.config.errors import UsageError
from rlhfkit.data.io import Row
from rlhfkit.inference.score import progress_bar


def write_jsonl_atomic(path: str, rows: Sequence[dict[str, Any]]) -> None:
    """Write JSON lines to a temporary file in the same folder, then rename it to `path`."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


@dataclass
class GenerateFlags:
    """batch_inference's own generation flag (rlhfkit.config.declare)."""

    best_of_n: int = flag(1, help="samples per prompt")


GENERATE_SEED = 1234  # batch_inference's --seed (its parser's default)
GENERATE_MAX_NEW_TOKENS = 1024  # batch_inference's --max_new_tokens


@dataclass
class GenerateConfig:
    """Sampling settings of the generate task (names match the flags)."""

    best_of_n: int = default_of(GenerateFlags, "best_of_n")
    max_new_tokens: int = GENERATE_MAX_NEW_TOKENS
    prompt_max_len: int = default_of(SamplingFlags, "prompt_max_len")
    max_len: int = default_of(DataFlags, "max_len")
    temperature: float = default_of(SamplingFlags, "temperature")
    top_p: float = default_of(SamplingFlags, "top_p")
    greedy_sampling: bool = default_of(ChatSamplingFlags, "greedy_sampling")
    seed: int = GENERATE_SEED
    chunk_prompts: int = 256  # prompts handed to the engine per call (progress granularity)
    repetition_penalty: float = default_of(ChatSamplingFlags, "repetition_penalty")

    def __post_init__(self) -> None:
        for name in ("best_of_n", "max_new_tokens", "prompt_max_len", "max_len"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"--top_p must lie in (0, 1], got {self.top_p}")
        if self.temperature < 0:
            raise UsageError(f"--temperature must be >= 0, got {self.temperature}")
        if self.repetition_penalty <= 0:
            raise UsageError(f"--repetition_penalty must be > 0, got {self.repetition_penalty}")

    def request_seed(self, index: int) -> int:
        """Seed of the prompt with dataset index `index` (the engine derives one per sample from it)."""
        return (self.seed * 1_000_003) % (2**31 - 1) + index


def select_rows(rows: Sequence[Row], it: int | None, rollout_batch_size: int) -> tuple[list[Row], int]:
    """(rows of slice `it`, index of its first row): [it * size, (it + 1) * size), or all rows for None."""
    if it is None:
        return list(rows), 0
    if it < 0 or rollout_batch_size < 1:
        raise UsageError(f"--iter must be >= 0 and --rollout_batch_size >= 1, got {it} and {rollout_batch_size}")
    start = it * rollout_batch_size
    if start >= len(rows):
        raise UsageError(f"--iter {it} x --rollout_batch_size {rollout_batch_size} starts at prompt {start}, "
                         f"but the dataset has {len(rows)} prompts (after --max_samples)")
    return list(rows[start:start + rollout_batch_size]), start


def encode_prompts(tokenizer: Any, prompts: Sequence[str], max_tokens: int) -> tuple[list[list[int]], int]:
    """Token ids (no special tokens added but the BOS the tokenizer adds, once: the BOS rule of
    rlhfkit.data.templates), keeping the BOS and the last tokens within `max_tokens`; returns (ids, number cut)."""
    from rlhfkit.data.templates import bos_prefix, encode

    out, cut = [], 0
    for text in prompts:
        body = encode(tokenizer, text)
        lead = bos_prefix(tokenizer, body)
        keep = max(max_tokens - len(lead), 0)
        if len(lead) + len(body) > max_tokens:
            body, cut = body[len(body) - keep:], cut + 1
        out.append(lead + body)
    return out, cut


def build_requests(prompt_ids: Sequence[list[int]], rows: Sequence[Row], cfg: GenerateConfig,
                   first_index: int, limit: int) -> list[Any]:
    """One GenerationRequest per prompt; `limit` caps prompt + new tokens."""
    from rlhfkit.types import GenerationRequest, SamplingParams

    reqs = []
    for i, (ids, row) in enumerate(zip(prompt_ids, rows)):
        if not ids:
            raise row.error("the prompt is empty after formatting (--input_key)")
        budget = min(cfg.max_new_tokens, limit - len(ids))
        if budget < 1:
            raise row.error(f"the prompt has {len(ids)} tokens, leaving no room to generate under {limit} "
                            "(--max_len / the model's max_position_embeddings); lower --prompt_max_len")
        params = SamplingParams(temperature=0.0 if cfg.greedy_sampling else cfg.temperature, top_p=cfg.top_p,
                                max_new_tokens=budget, n=cfg.best_of_n, seed=cfg.request_seed(first_index + i),
                                logprobs=False, repetition_penalty=cfg.repetition_penalty)
        reqs.append(GenerationRequest(list(ids), params, request_id=first_index + i))
    return reqs


def generate_samples(engine: Any, tokenizer: Any, prompts: Sequence[str], requests: Sequence[Any],
                     cfg: GenerateConfig, show_progress: bool = True) -> list[dict[str, str]]:
    """Run the requests through `engine`; rows {input, output}, n per prompt, in prompt order."""
    out: list[dict[str, str]] = []
    bar = progress_bar(len(requests), "generate", not show_progress)
    for start in range(0, len(requests), cfg.chunk_prompts):
        chunk = list(requests[start:start + cfg.chunk_prompts])
        for prompt, comps in zip(prompts[start:start + len(chunk)], engine.generate(chunk)):
            for c in comps:
                out.append({"input": prompt, "output": tokenizer.decode(c.token_ids, skip_special_tokens=True)})
        bar.update(len(chunk))
    bar.close()
    return out
