"""Stop conditions shared by the rollout engines: stop strings, stop ids, finish reasons.

Convention (vLLM's): a completion that ends on a stop token id (eos included) keeps that token as
its last `token_ids` entry; one that ends on a stop string keeps the tokens up to and including the
one whose text completes the stop string (vLLM trims only its *text* output, which `Completion`
does not carry); `finish_reason` is "stop" for both, "length" otherwise.
"""

from __future__ import annotations

from typing import AbstractSet, Callable, Sequence

Decode = Callable[[Sequence[int]], str]


def validate_stop_strings(stop: Sequence[str]) -> None:
    for s in stop:
        if not isinstance(s, str) or not s:
            raise ValueError(f"SamplingParams.stop must hold non-empty strings, got {s!r}")


def stop_string_cut(token_ids: Sequence[int], decode: Decode, stops: Sequence[str],
                    checked_chars: int = 0, min_tokens: int = 0) -> tuple[int | None, int]:
    """Where a stop string first ends.

    Returns `(keep, text_len)`: `keep` is the smallest number of leading tokens whose decoded text
    holds a stop string (None when none does), and `text_len` the decoded length of all
    `token_ids`, so a caller can pass it back as `checked_chars` and only search the new text.
    As in vLLM, stop strings count only once `min_tokens` tokens exist: an occurrence must end
    after the text of the first `min_tokens - 1` tokens.
    """
    base = len(decode(list(token_ids[:min_tokens - 1]))) if min_tokens > 1 else 0
    longest = max(len(s) for s in stops)

    def hit(text: str, from_char: int) -> bool:
        return any(text.find(s, max(from_char, base - len(s) + 1, 0)) >= 0 for s in stops)

    text = decode(list(token_ids))
    if not hit(text, checked_chars - longest + 1):
        return None, len(text)
    lo, hi = max(1, min_tokens), len(token_ids)  # the answer lies in [lo, hi]: binary search
    while lo < hi:
        mid = (lo + hi) // 2
        if hit(decode(list(token_ids[:mid])), 0):
            hi = mid
        else:
            lo = mid + 1
    return lo, len(text)


def first_stop_id(token_ids: Sequence[int], stop_ids: AbstractSet[int], min_new_tokens: int) -> int | None:
    """Index of the first stop id at or after `min_new_tokens - 1` generated tokens, else None."""
    if stop_ids.isdisjoint(token_ids):  # the common case of a length finish, at C speed
        return None
    for i, t in enumerate(token_ids):
        if t in stop_ids and i + 1 > min_new_tokens:
            return i
    return None


def finish_completion(token_ids: list[int], logprobs: list[float] | None, stop_ids: AbstractSet[int],
                      min_new_tokens: int, stops: Sequence[str],
                      decode: Decode | None) -> tuple[list[int], list[float] | None, str]:
    """Cut raw generated tokens at the first stop id / stop string; returns (ids, logprobs, reason)."""
    cut, reason = len(token_ids), "length"
    i = first_stop_id(token_ids, stop_ids, min_new_tokens)
    if i is not None:
        cut, reason = i + 1, "stop"
    if stops:
        if decode is None:
            raise ValueError("SamplingParams.stop needs a tokenizer: pass `tokenizer=` to the engine")
        keep, _ = stop_string_cut(token_ids[:cut], decode, stops, min_tokens=min_new_tokens)
        if keep is not None:
            cut, reason = keep, "stop"
    if cut == len(token_ids):  # nothing cut: the caller's lists, not copies
        return token_ids, logprobs, reason
    return token_ids[:cut], (logprobs[:cut] if logprobs is not None else None), reason
