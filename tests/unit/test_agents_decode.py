"""BatchDecoder (rlhfkit/agents/decode.py): the decode calls of one event-loop turn become one
`decode_batch` of the Rust tokenizer, and each text equals `tokenizer.decode` (special tokens kept
or skipped); a tokenizer without that fast path decodes one by one."""

from __future__ import annotations

import asyncio

import pytest

from rlhfkit.agents.decode import BatchDecoder


@pytest.fixture(scope="module")
def tok(tiny_qwen2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen2_dir)


def rows(tok):
    import random

    rng = random.Random(0)
    special = list(tok.all_special_ids)
    return [[rng.choice(special) if rng.random() < 0.2 else rng.randrange(0, len(tok) - len(special))
             for _ in range(rng.randrange(0, 40))] for _ in range(30)]


@pytest.mark.parametrize("skip", [True, False])
def test_one_batch_per_turn_and_the_same_text(tok, skip):
    dec = BatchDecoder(tok)
    assert dec._fast is not None  # the tiny tokenizer is a fast one without space clean-up
    calls = []
    real = dec._fast

    class Counting:
        def decode_batch(self, batch, skip_special_tokens):
            calls.append(len(batch))
            return real.decode_batch(batch, skip_special_tokens=skip_special_tokens)

    dec._fast = Counting()
    ids = rows(tok)

    async def all_at_once():
        return await asyncio.gather(*(dec.decode(r, skip_special_tokens=skip) for r in ids))

    got = asyncio.run(all_at_once())
    assert calls == [len(ids)]
    assert got == [tok.decode(r, skip_special_tokens=skip) for r in ids]


def test_a_tokenizer_without_the_fast_path_decodes_one_by_one(tok):
    class Slow:
        def decode(self, ids, skip_special_tokens):
            return tok.decode(ids, skip_special_tokens=skip_special_tokens) + "!"

    dec = BatchDecoder(Slow())
    assert dec._fast is None
    assert asyncio.run(dec.decode([5, 6], skip_special_tokens=True)) == tok.decode([5, 6], skip_special_tokens=True) + "!"
