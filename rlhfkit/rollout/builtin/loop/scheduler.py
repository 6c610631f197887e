"""Continuous batching for the builtin engine: which sequences hold which KV slot, and when.

Pure Python bookkeeping (no tensors), so the policy is unit-testable on its own:

    waiting (FIFO of requests, n samples each) --admit--> running (slot -> sequence) --finish--> free
         admit: lowest free slots first; all samples admitted together share one prefill;
                a prefill batch holds at most `max_prefill_tokens` padded prompt tokens
         decode rows: slots 0 .. bucket(max live slot + 1) - 1 (holes and finished rows idle)
         compact: with nothing waiting and the live slots at most half the rows, move the
                  highest live slots into the lowest holes so the decode batch can shrink

Buckets keep the set of decode shapes small (one CUDA graph each): batch sizes 1, 2, 3, 4, 6, 8,
12, 16, 24, ... (powers of two and their 1.5x) and KV lengths in steps of a quarter of the
enclosing power of two, starting at 128 (waste below 25%).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from rlhfkit.types import Completion, GenerationRequest


def batch_bucket(n: int, max_rows: int) -> int:
    """Smallest bucket >= n among 1, 2, 3, 4, 6, 8, 12, ... capped at `max_rows`."""
    b = 1
    while True:
        for cand in (b, b + b // 2) if b >= 2 else (b,):
            if cand >= n:
                return min(cand, max_rows)
        b *= 2


def length_bucket(n: int, max_len: int) -> int:
    """Smallest length >= n among 128, 160, 192, 224, 256, 320, ... capped at `max_len`."""
    base = 128
    while True:
        for cand in (base, base + base // 4, base + base // 2, base + 3 * base // 4):
            if cand >= n:
                return min(cand, max_len)
        base *= 2


@dataclass
class RequestState:
    """One submitted request: its n samples, the completions so far and whom to tell when done."""

    request: GenerationRequest
    on_done: Callable[[list[Completion] | BaseException], None]
    seed: int
    stop_ids: list[int]
    filtered: bool
    completions: list[Completion | None] = field(default_factory=list)
    admitted: int = 0
    remaining: int = 0
    prompt_len: int = field(init=False, default=0)
    stop_set: frozenset = field(init=False, default=frozenset())

    def __post_init__(self) -> None:
        n = self.request.params.n
        self.completions = [None] * n
        self.remaining = n
        self.prompt_len = len(self.request.prompt_token_ids)
        self.stop_set = frozenset(self.stop_ids)


@dataclass
class Sequence:
    """One sample of a request, running in `slot`; `gen_bound` >= tokens generated (exact at a blocking
    sync; after a look-ahead sync, the length at the snapshot plus the steps queued since)."""

    req: RequestState
    sample: int
    slot: int
    gen_bound: int = 0
    checked_chars: int = 0
    read: int = 0  # tokens (and log-probs) copied to the host so far, in `tokens` / `logprobs`
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # (first generated token index, policy version) of each span of tokens sampled by one version of
    # the weights; a weight update between steps starts a new span at `gen_bound` (see `mark_version`)
    spans: list[tuple[int, int]] = field(default_factory=lambda: [(0, 0)])

    def mark_version(self, version: int) -> None:
        """Tokens from now on come from `version`. `gen_bound` is exact for a row still running
        (after a look-ahead sync too: it advanced one token per queued step) and a bound past the
        end of a row that finished, so every token before it came from the earlier version."""
        start, last = self.spans[-1]
        if last == version:
            return
        if start >= self.gen_bound:  # no token of the last span yet
            self.spans[-1] = (start, version)
        else:
            self.spans.append((self.gen_bound, version))

    def token_versions(self, n: int) -> list[int]:
        """The policy version of each of the first `n` generated tokens."""
        out: list[int] = []
        for k, (start, version) in enumerate(self.spans):
            end = self.spans[k + 1][0] if k + 1 < len(self.spans) else n
            out.extend([version] * (min(end, n) - min(start, n)))
        return out

    @property
    def pos_bound(self) -> int:
        """Upper bound of the position of the token the next decode step feeds."""
        return self.req.prompt_len + self.gen_bound - 1

    @property
    def steps_left(self) -> int:
        return self.req.request.params.max_new_tokens - self.gen_bound


@dataclass
class Admission:
    """Samples `first_sample ..` of `req` go to `slots`; slots[0] receives the prefill."""

    req: RequestState
    first_sample: int
    slots: list[int]


class SlotScheduler:
    def __init__(self, num_slots: int, max_prefill_tokens: int):
        self.num_slots = num_slots
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[RequestState] = deque()
        self.running: dict[int, Sequence] = {}
        self._free = list(range(num_slots))
        heapq.heapify(self._free)

    def add(self, req: RequestState) -> None:
        self.waiting.append(req)

    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def plan_admissions(self, version: int = 0) -> list[Admission]:
        """Admit from the head of the queue while slots and the prefill token budget allow; the
        admitted samples' first tokens come from policy `version`."""
        out: list[Admission] = []
        longest = 0
        while self.waiting and self._free:
            req = self.waiting[0]
            longest_if = max(longest, req.prompt_len)
            if out and longest_if * (len(out) + 1) > self.max_prefill_tokens:
                break
            k = min(req.request.params.n - req.admitted, len(self._free))
            slots = [heapq.heappop(self._free) for _ in range(k)]
            out.append(Admission(req, req.admitted, slots))
            for i, slot in enumerate(slots):
                self.running[slot] = Sequence(req, req.admitted + i, slot, gen_bound=1, spans=[(0, version)])
            req.admitted += k
            longest = longest_if
            if req.admitted == req.request.params.n:
                self.waiting.popleft()
        return out

    def release(self, slot: int) -> Sequence:
        seq = self.running.pop(slot)
        heapq.heappush(self._free, slot)
        return seq

    def decode_rows(self) -> int:
        return batch_bucket(max(self.running) + 1, self.num_slots) if self.running else 0

    def plan_compaction(self) -> list[tuple[int, int]]:
        """(src, dst) slot moves that let the decode batch shrink; empty while requests wait."""
        if self.waiting or not self.running:
            return []
        live = len(self.running)
        if batch_bucket(live, self.num_slots) >= self.decode_rows():
            return []
        holes = sorted(s for s in self._free if s < live)
        movers = sorted((s for s in self.running if s >= live), reverse=True)
        moves = list(zip(movers, holes))
        for src, dst in moves:
            seq = self.running.pop(src)
            seq.slot = dst
            self.running[dst] = seq
            self._free.remove(dst)
            self._free.append(src)
        heapq.heapify(self._free)
        return moves
