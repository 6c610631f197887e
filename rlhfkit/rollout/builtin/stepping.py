"""One step of the builtin engine (`EngineStepping._step`, a mixin of BuiltinEngine, run under the engine
lock): admit waiting prompts into free slots (prefill), queue a chunk of decode steps, read the rows'
new tokens back and finish the rows that are done, then compact the slots. The module docstring of
engine.py describes the chunk sizes, the look-ahead and the syncs; the device work goes through
`self.steps` (step.py).

The engine provides `sched` (SlotScheduler), `steps` (the step runner or its tensor-parallel mirror),
`stats`, `config`, `spec`, `max_model_len`, `policy_version`, `_inbox`, `_lookahead`, `_decode_text`,
`banned` (token ids never sampled) and `_vision_index` (a VLM's picture plan, vision.py, or None).
"""

from __future__ import annotations

from typing import Any

from rlhfkit.rollout.builtin.scheduler import Admission, length_bucket
from rlhfkit.rollout.builtin.step import AdmitPlan
from rlhfkit.rollout.stops import finish_completion, stop_string_cut
from rlhfkit.types import Completion


class EngineStepping:
    """`_step` and the prefill / decode / sync / finish / compaction it is made of."""

    sched: Any
    steps: Any
    stats: Any
    config: Any
    spec: Any
    max_model_len: int
    policy_version: int
    _inbox: Any
    _lookahead: int
    _decode_text: Any
    banned: tuple[int, ...]
    _vision_index: Any

    def _step(self, batch: bool = False) -> None:
        self._drain_inbox()
        had_running = bool(self.sched.running)
        while True:  # fill every free slot before decoding (one prefill call per token budget)
            admissions = self.sched.plan_admissions(self.policy_version)
            if not admissions:
                break
            self.stats.mid_run_admissions += had_running
            self._prefill(admissions)
        steps, quiet = self._decode(batch, hold=self._lookahead)
        if steps and quiet and self._lookahead:
            snap = self._snapshot()  # as of the end of this chunk
            ahead, _ = self._decode(batch, cap=self._lookahead)
            self._sync(snap, ahead)
        else:
            self._sync()
        moves = self.sched.plan_compaction()
        if moves:
            self._move_slots(moves)

    def _prefill(self, admissions: list[Admission]) -> None:
        plan = AdmitPlan.from_admissions(admissions, self.spec.vocab_size, self.config.max_stop_ids, self.banned,
                                         self._vision_index)
        self.steps.admit(plan)
        if plan.mm is not None and plan.mm.encode:
            self.stats.vision_calls += 1
            self.stats.pictures_encoded += len(plan.mm.encode)
        self.stats.prefill_calls += 1
        self.stats.prefill_sequences += len(admissions)
        self.stats.prefill_tokens += sum(plan.lengths)

    def _decode(self, batch: bool = False, cap: int | None = None, hold: int = 0) -> tuple[int, bool]:
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
        quiet = batch and not stops and not self.sched.waiting and self._inbox.empty()
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

    def _snapshot(self, wait: bool = False) -> tuple:
        """`SlotState.read_out` of slots 0..max(running), each from its last read column."""
        running = self.sched.running
        reads, width = [0] * (max(running) + 1), 1
        for slot, seq in running.items():
            reads[slot] = seq.read
            width = max(width, seq.gen_bound - seq.read)
        return self.steps.read_out(reads, width, wait)

    def _sync(self, snap: tuple | None = None, after: int = 0) -> None:
        """Read every running row's new tokens; finish rows that are done. `snap`: a `_snapshot()`
        taken `after` decode steps ago (rows not done then may have advanced since)."""
        running = self.sched.running
        if not running:
            return
        flags, toks, lps, event = snap or self._snapshot(wait=True)
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
                keep, seq.checked_chars = stop_string_cut(seq.tokens, self._decode_text, p.stop, seq.checked_chars,
                                                          p.min_new_tokens)
                if keep is None:
                    continue
            self._finish(self.sched.release(slot), seq.tokens, seq.logprobs)
            freed.append(slot)
        if freed:
            self.steps.release(freed)

    def _finish(self, seq, tokens: list[int], logprobs: list[float]) -> None:
        req, p = seq.req, seq.req.request.params
        ids, lps, reason = finish_completion(tokens, logprobs, req.stop_set, p.min_new_tokens, p.stop,
                                             self._decode_text)
        req.completions[seq.sample] = Completion(
            prompt_token_ids=list(req.request.prompt_token_ids), token_ids=ids,
            logprobs=lps if p.logprobs else None, finish_reason=reason, request_id=req.request.request_id,
            policy_versions=seq.token_versions(len(ids)))
        self.stats.generated_tokens += len(ids)
        req.remaining -= 1
        if req.remaining == 0:
            req.on_done(list(req.completions))

    def _move_slots(self, moves: list[tuple[int, int]]) -> None:
        longest = max(self.sched.running[d].pos_bound + 1 for _, d in moves)
        self.steps.move([m[0] for m in moves], [m[1] for m in moves], min(longest, self.max_model_len))
        self.stats.slot_moves += len(moves)
