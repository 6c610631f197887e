"""`EngineLoop` (rlhfkit/rollout/builtin/loop/engine_loop.py) alone, over fake device steps: schedule -> run ->
postprocess with no model. The fake "samples" token 1000 x (the prompt's first id) + position, so each
completion can be checked by hand: every request gets exactly its max_new_tokens tokens, in order, whatever
slot it ran in and however the slots were compacted, and the loop's counters add up."""

from __future__ import annotations

import torch

from rlhfkit.rollout.builtin.config import BuiltinEngineConfig
from rlhfkit.rollout.builtin.loop.engine_loop import EngineLoop
from rlhfkit.rollout.builtin.loop.inbox import Inbox
from rlhfkit.rollout.builtin.loop.scheduler import RequestState
from rlhfkit.rollout.engine_utils import EngineStats
from rlhfkit.types import GenerationRequest, SamplingParams

SLOTS = 3


class FakeSteps:
    """Device steps over `SLOTS` rows: a row's next token is 1000 * (its request's first prompt id) + its
    length so far; a row is done at its max_new_tokens."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.limit: dict[int, int] = {}
        self.base: dict[int, int] = {}
        self.decoded = 0

    def admit(self, plan) -> None:
        for slot, row, settings in zip(plan.slots, plan.row_of, plan.settings):
            self.base[slot] = 1000 * int(plan.tokens[row][0])
            self.limit[slot] = settings[6]  # max_new
            self.tokens[slot] = [self.base[slot]]  # the first token, sampled at prefill

    def decode(self, rows: int, kv_len: int, filtered: bool, steps: int) -> None:
        self.decoded += steps
        for slot, toks in self.tokens.items():
            for _ in range(steps):
                if len(toks) < self.limit[slot]:
                    toks.append(self.base[slot] + len(toks))

    def read_out(self, reads: list[int], width: int, wait: bool) -> tuple:
        n = len(reads)
        done = torch.tensor([len(self.tokens.get(s, ())) >= self.limit.get(s, 0) for s in range(n)])
        gen = torch.tensor([len(self.tokens.get(s, ())) for s in range(n)])
        toks = torch.zeros(n, width, dtype=torch.long)
        for s in range(n):
            got = self.tokens.get(s, [])[reads[s]:reads[s] + width]
            toks[s, :len(got)] = torch.tensor(got, dtype=torch.long)
        return torch.stack([done.long(), gen]), toks, torch.zeros(n, width), None

    def release(self, slots: list[int]) -> None:
        for s in slots:
            self.tokens.pop(s), self.limit.pop(s), self.base.pop(s)

    def move(self, src: list[int], dst: list[int], length: int) -> None:
        for a, b in zip(src, dst):
            self.tokens[b], self.limit[b], self.base[b] = self.tokens.pop(a), self.limit.pop(a), self.base.pop(a)

    def fail_all(self) -> None:
        self.tokens.clear()


def test_engine_loop_alone_completes_every_request_by_hand():
    steps, stats, inbox = FakeSteps(), EngineStats(), Inbox()
    cfg = BuiltinEngineConfig(max_num_seqs=SLOTS, max_model_len=64, sync_every=3, sync_every_batch=3)
    loop = EngineLoop(steps, cfg, inbox, stats, vocab_size=50, max_model_len=64, lookahead=0)
    lengths = [5, 2, 7, 1, 4, 6]
    results: dict[int, list[int]] = {}
    inbox.put([RequestState(GenerationRequest([i + 1, 9], SamplingParams(max_new_tokens=k, seed=i), i),
                            lambda out, i=i: results.__setitem__(i, out[0].token_ids), seed=i, stop_ids=[],
                            filtered=False) for i, k in enumerate(lengths)])
    for _ in range(50):
        loop.step(batch=True)
        if len(results) == len(lengths):
            break
    assert {i: results[i] for i in sorted(results)} == {
        i: [1000 * (i + 1) + t for t in range(k)] for i, k in enumerate(lengths)}
    assert stats.generated_tokens == sum(lengths) and stats.prefill_sequences == len(lengths)
    assert not loop.sched.busy() and steps.tokens == {}
    # each sync reads what 3 decode steps made, and a row never decodes past its length
    assert stats.decode_steps == steps.decoded and stats.decode_steps <= sum(lengths)


def test_reset_returns_the_requests_in_flight():
    steps, inbox = FakeSteps(), Inbox()
    cfg = BuiltinEngineConfig(max_num_seqs=SLOTS, max_model_len=64, sync_every=2)
    loop = EngineLoop(steps, cfg, inbox, EngineStats(), vocab_size=50, max_model_len=64, lookahead=0)
    reqs = [RequestState(GenerationRequest([i + 1], SamplingParams(max_new_tokens=20), i), lambda out: None,
                         seed=i, stop_ids=[], filtered=False) for i in range(5)]
    inbox.put(reqs)
    loop.step()
    assert len(loop.sched.running) == SLOTS and len(loop.sched.waiting) == 2
    assert {id(r) for r in loop.reset()} == {id(r) for r in reqs}
    assert not loop.sched.busy() and steps.tokens == {}
