"""The builtin engine's step loop (`EngineLoop`, owned by BuiltinEngine and run under its lock):

    step(batch)   drain the inbox into the scheduler
                  schedule: admit waiting prompts into free slots (prefill), as long as slots are free
                  run:      queue a chunk of decode steps (and, in a quiet batch, a look-ahead chunk)
                  postprocess: read the rows' new tokens back, finish the rows that are done,
                            then compact the slots

loop/front_end.py's module docstring describes the chunk sizes, the look-ahead and the syncs; the device
work goes through `steps` (loop/step_runner.py: the step runner, or its tensor-parallel mirror, loop/mirror.py).
"""

from __future__ import annotations

from typing import Callable, Sequence

from rlhfkit.rollout.builtin.config import BuiltinEngineConfig
from rlhfkit.rollout.builtin.loop.inbox import Inbox
from rlhfkit.rollout.builtin.loop.mirror import MirroredSteps
from rlhfkit.rollout.builtin.loop.scheduler import Admission, RequestState, SlotScheduler, length_bucket
from rlhfkit.rollout.builtin.loop.step_runner import AdmitPlan, StepRunner
from rlhfkit.rollout.builtin.model.vision import VisionIndex
from rlhfkit.rollout.engine_utils import EngineStats
from rlhfkit.rollout.stops import finish_completion, stop_string_cut
from rlhfkit.types import Completion


class EngineLoop:
    """See the module docstring. `version`: the policy version of the loaded weights (the engine sets it);
    `banned`: token ids never sampled (a VLM's vision markers); `vision_index`: a VLM's picture plan;
    `decode_text`: token ids -> text, for stop strings."""

    def __init__(self, steps: StepRunner | MirroredSteps, config: BuiltinEngineConfig, inbox: Inbox,
                 stats: EngineStats, *, vocab_size: int, max_model_len: int, lookahead: int,
                 banned: tuple[int, ...] = (), vision_index: VisionIndex | None = None,
                 decode_text: Callable[[Sequence[int]], str] | None = None) -> None:
        self.steps, self.config, self.inbox, self.stats = steps, config, inbox, stats
        self.vocab_size, self.max_model_len, self.lookahead = vocab_size, max_model_len, lookahead
        self.banned, self.vision_index, self.decode_text = banned, vision_index, decode_text
        self.sched = SlotScheduler(config.max_num_seqs, config.max_prefill_tokens)
        self.version = 0

    def drain_inbox(self) -> None:
        self.inbox.drain(self.sched.add)

    def reset(self) -> list[RequestState]:
        """Forget every request (a failed step): the scheduler starts empty; returns the requests that were
        running or waiting, for the caller to fail."""
        self.drain_inbox()
        reqs = {id(s.req): s.req for s in self.sched.running.values()}
        reqs.update({id(r): r for r in self.sched.waiting})
        self.sched = SlotScheduler(self.config.max_num_seqs, self.config.max_prefill_tokens)
        self.steps.fail_all()
        return list(reqs.values())

    def step(self, batch: bool = False) -> None:
        self.drain_inbox()
        self.schedule()
        self.run(batch)
        moves = self.sched.plan_compaction()
        if moves:
            self.move_slots(moves)

    def schedule(self) -> None:
        """Fill every free slot before decoding (one prefill call per token budget)."""
        had_running = bool(self.sched.running)
        while True:
            admissions = self.sched.plan_admissions(self.version)
            if not admissions:
                break
            self.stats.mid_run_admissions += had_running
            self.prefill(admissions)

    def run(self, batch: bool) -> None:
        """A chunk of decode steps and the sync after it; a quiet batch looks ahead (loop/front_end.py)."""
        steps, quiet = self.decode(batch, hold=self.lookahead)
        if steps and quiet and self.lookahead:
            snap = self.snapshot()  # as of the end of this chunk
            ahead, _ = self.decode(batch, cap=self.lookahead)
            self.sync(snap, ahead)
        else:
            self.sync()

    def prefill(self, admissions: list[Admission]) -> None:
        plan = AdmitPlan.from_admissions(admissions, self.vocab_size, self.config.max_stop_ids, self.banned,
                                         self.vision_index)
        self.steps.admit(plan)
        if plan.mm is not None and plan.mm.encode:
            self.stats.vision_calls += 1
            self.stats.pictures_encoded += len(plan.mm.encode)
        self.stats.prefill_calls += 1
        self.stats.prefill_sequences += len(admissions)
        self.stats.prefill_tokens += sum(plan.lengths)

    def decode(self, batch: bool = False, cap: int | None = None, hold: int = 0) -> tuple[int, bool]:
        """Queue the next chunk of decode steps (at most `cap`); returns the number of steps and
        whether the chunk is `quiet`: batch mode (no waiting request, no stop strings) with some row
        that cannot finish by length inside the chunk, so a look-ahead cannot be wasted on lengths.
        `hold`: a batch-mode chunk that would end every row by length stops `hold` steps short (quiet)."""
        running = self.sched.running
        max_len = self.max_model_len
        min_left, min_room, top, filtered, stops, max_left = None, None, 0, False, False, 0
        for seq in running.values():  # one pass: this runs for every sync of a full batch
            req = seq.req
            params = req.request.params
            left = params.max_new_tokens - seq.gen_bound
            bound = req.prompt_len + seq.gen_bound - 1  # seq.pos_bound
            top = max(top, bound)
            filtered = filtered or req.filtered
            stops = stops or bool(params.stop)
            if left > 0:
                min_left = left if min_left is None else min(min_left, left)
                max_left = max(max_left, left)
                if bound < max_len - 1:
                    room = max_len - 1 - bound
                    min_room = room if min_room is None else min(min_room, room)
        if min_left is None:
            return 0, False
        every = self.config.sync_every
        quiet = batch and not stops and not self.sched.waiting and self.inbox.empty()
        if quiet:
            every = self.config.sync_every_batch
        steps = min(every, min_left, cap or every)
        if min_room is not None:
            steps = max(1, min(steps, min_room))
        if quiet and 0 < hold < steps and max_left <= steps:
            steps -= hold
        quiet = quiet and max_left > steps
        kv_len = length_bucket(top + steps, max_len)
        rows = self.sched.decode_rows()
        self.steps.decode(rows, kv_len, filtered, steps)
        for seq in running.values():
            seq.gen_bound += steps
        self.stats.decode_steps += steps
        self.stats.decode_row_steps += steps * rows
        return steps, quiet

    def snapshot(self, wait: bool = False) -> tuple:
        """`SlotState.read_out` of slots 0..max(running), each from its last read column."""
        running = self.sched.running
        reads, width = [0] * (max(running) + 1), 1
        for slot, seq in running.items():
            reads[slot] = seq.read
            width = max(width, seq.gen_bound - seq.read)
        return self.steps.read_out(reads, width, wait)

    def sync(self, snap: tuple | None = None, after: int = 0) -> None:
        """Read every running row's new tokens; finish rows that are done. `snap`: a `_snapshot()`
        taken `after` decode steps ago (rows not done then may have advanced since)."""
        running = self.sched.running
        if not running:
            return
        flags, toks, lps, event = snap or self.snapshot(wait=True)
        if event is not None:
            event.synchronize()
        done, gen = flags[0].tolist(), flags[1].tolist()
        toks, lps = toks.tolist(), lps.tolist()
        watch = []
        for slot, seq in running.items():
            g = gen[slot]
            seq.gen_bound = g if done[slot] else g + after
            if g > seq.read:
                seq.tokens += toks[slot][:g - seq.read]
                seq.logprobs += lps[slot][:g - seq.read]
                seq.read = g
            if done[slot] or seq.req.request.params.stop:
                watch.append(slot)
        freed = []
        for slot in watch:
            seq = running[slot]
            if not done[slot]:
                p = seq.req.request.params
                assert self.decode_text is not None  # the engine refuses stop strings without a tokenizer
                keep, seq.checked_chars = stop_string_cut(seq.tokens, self.decode_text, p.stop, seq.checked_chars,
                                                          p.min_new_tokens)
                if keep is None:
                    continue
            self.finish(self.sched.release(slot), seq.tokens, seq.logprobs)
            freed.append(slot)
        if freed:
            self.steps.release(freed)

    def finish(self, seq, tokens: list[int], logprobs: list[float]) -> None:
        req, p = seq.req, seq.req.request.params
        ids, lps, reason = finish_completion(tokens, logprobs, req.stop_set, p.min_new_tokens, p.stop,
                                             self.decode_text)
        req.completions[seq.sample] = Completion(
            prompt_token_ids=list(req.request.prompt_token_ids), token_ids=ids,
            logprobs=lps if p.logprobs else None, finish_reason=reason, request_id=req.request.request_id,
            policy_versions=seq.token_versions(len(ids)))
        self.stats.generated_tokens += len(ids)
        req.remaining -= 1
        if req.remaining == 0:
            req.on_done(list(req.completions))

    def move_slots(self, moves: list[tuple[int, int]]) -> None:
        longest = max(self.sched.running[d].pos_bound + 1 for _, d in moves)
        self.steps.move([m[0] for m in moves], [m[1] for m in moves], min(longest, self.max_model_len))
        self.stats.slot_moves += len(moves)
