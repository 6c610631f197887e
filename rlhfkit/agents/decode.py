"""Token ids -> text for concurrent episodes, one tokenizer call per turn of the event loop.

When a rollout's samples finish together, each episode decodes its response and its whole
transcript (the reward function's `queries`) one after the other on the trainer's event loop,
after the last decode step with the GPU idle, mostly in transformers' Python around the Rust
tokenizer. `BatchDecoder.decode` gathers the calls made in one turn of the loop
and answers them with one `decode_batch` of the Rust tokenizer (which also decodes in parallel
unless TOKENIZERS_PARALLELISM=false). The text equals `tokenizer.decode(ids, skip_special_tokens)`:
the batch path is taken only for a fast tokenizer that does not clean up tokenization spaces
(transformers' `decode` is then `_tokenizer.decode` itself); other tokenizers decode one by one.
"""

from __future__ import annotations

import asyncio
from typing import Any, Sequence


class BatchDecoder:
    """`await decode(ids, skip_special_tokens)`, merged over the episodes of one loop turn."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        fast = getattr(tokenizer, "_tokenizer", None)
        plain = not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._fast = fast if plain and callable(getattr(fast, "decode_batch", None)) else None
        self._pending: dict[tuple[Any, bool], list[tuple[list[int], asyncio.Future]]] = {}

    async def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        if self._fast is None:
            return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        loop = asyncio.get_running_loop()
        key = (loop, skip_special_tokens)
        batch = self._pending.get(key)
        if batch is None:
            batch = self._pending[key] = []
            loop.call_soon(self._flush, key)
        fut = loop.create_future()
        batch.append((list(ids), fut))
        return await fut

    def _flush(self, key: tuple[Any, bool]) -> None:
        batch = self._pending.pop(key, [])
        try:
            texts = self._fast.decode_batch([ids for ids, _ in batch], skip_special_tokens=key[1])
        except Exception:  # noqa: BLE001 - one bad row: each caller gets its own answer or error
            texts = None
        for i, (ids, fut) in enumerate(batch):
            if fut.done():  # its episode was cancelled
                continue
            if texts is not None:
                fut.set_result(texts[i])
                continue
            try:
                fut.set_result(self.tokenizer.decode(ids, skip_special_tokens=key[1]))
            except Exception as e:  # noqa: BLE001
                fut.set_exception(e)


def decoder_for(executor: Any, tokenizer: Any) -> BatchDecoder:
    """The executor's BatchDecoder for `tokenizer` (made on first use; another tokenizer passed to one
    call gets its own)."""
    dec = getattr(executor, "_batch_decoder", None)
    if dec is None or dec.tokenizer is not tokenizer:
        dec = BatchDecoder(tokenizer)
        if tokenizer is getattr(executor, "hf_tokenizer", None):
            executor._batch_decoder = dec
    return dec
